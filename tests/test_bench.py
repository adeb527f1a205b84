"""`specjax loadbench` under load and `specjax bench` offline: records, tables, plots, telemetry; bad input fails before loading."""

import json

import pytest
from conftest import need_module

from specjax.cli import commands as cli
from specjax.bench import load as loadbench
from specjax.serving.engine import Engine, GenerateOptions
from specjax.bench.load import LoadPlan
from specjax.bench.prompts import Prompt
from specjax.methods.medusa.record import LoadedHeads

FIELDS = {"method", "concurrency", "task", "tau", "speedup_vs_none", "throughput_tok_s", "ttft_p50_s",
          "itl_p50_s", "itl_p99_s", "peak_mem_bytes", "arrays_bytes", "greedy_identical", "weights_bytes",
          "draft_weights_bytes", "caches_bytes", "memory"}  # then each batch-shared state the run carries


@pytest.fixture(scope="module")
def results(tiny_model):
    eng = Engine(tiny_model)
    prompts = loadbench.interleave([
        Prompt(1, [5, 9, 12, 5, 9, 12, 5, 9], "copy"), Prompt(2, [3, 4, 5, 3, 4, 5], "copy"),
        Prompt(3, [40, 41, 42, 43, 40], "chat"), Prompt(4, list(range(1, 20)), "chat"),
    ])
    plan = LoadPlan(methods=("ngram", "auto"), concurrency=(1, 2), chunk=4)
    req_rows, run_rows = loadbench.run(eng, prompts, plan, GenerateOptions(max_new_tokens=10),
                                       progress=False)
    return req_rows, run_rows, loadbench.summarize(req_rows, run_rows)


def test_interleave_mixes_tasks():
    ps = [Prompt(i, "x", t) for i, t in enumerate("aaabbc")]
    assert [p.task for p in loadbench.interleave(ps)] == list("abcaba")


def test_records(results):
    req_rows, run_rows, records = results
    assert {(r["method"], r["concurrency"]) for r in run_rows} == {
        (m, c) for m in ("none", "ngram", "auto") for c in (1, 2)}  # none is always the baseline
    assert len(req_rows) == 3 * 2 * 4
    assert {r["task"] for r in records} == {"all", "copy", "chat"}
    for r in records:
        assert FIELDS <= set(r)
        assert r["greedy_identical"] is True and r["greedy_identical_n"] == r["requests"]
        assert r["tau"] >= 1.0 and r["throughput_tok_s"] > 0 and r["itl_p99_s"] >= r["itl_p50_s"]
        assert r["arrays_bytes"] == (r["weights_bytes"] + r["draft_weights_bytes"] + r["caches_bytes"]
                                     + r.get("ngram_table_bytes", 0))
        # measured, not summed: on CPU the run's peak resident set holds the arrays and more
        assert r["peak_mem_source"] == "rss" and r["peak_mem_bytes"] > r["arrays_bytes"]
        programs, measured = r["memory"]["programs"], r["memory"]["measured"]
        assert programs["count"] > 0 and measured["peak_rss_bytes"] == r["peak_mem_bytes"]
        assert (r.get("ngram_table_bytes", 0) > 0) == (r["method"] != "none")  # prompt lookup's shared table
        if r["method"] == "none":
            assert r["speedup_vs_none"] == pytest.approx(1.0)
    assert all(r["tau"] > 1.0 for r in records if r["method"] == "ngram" and r["task"] == "copy")
    json.dumps(records)
    auto = [r for r in run_rows if r["method"] == "auto"]
    assert all("cost_s_per_step" in r and "none" in r["cost_s_per_step"] and "ngram:4" in r["cost_s_per_step"] for r in auto)
    for r in run_rows:  # every chunk's decision, in order
        log = r["chunk_log"]
        assert sum(r["chunks"].values()) == len(log) and all(a["start_s"] <= b["start_s"] for a, b in zip(log, log[1:]))
        assert {c["reason"] for c in log} <= ({"fixed"} if r["method"] != "auto" else {"gain", "no_gain", "probe"})


def test_markdown_plots_and_telemetry(results, tmp_path):
    req_rows, _, records = results
    md = loadbench.markdown(records)
    assert md.count("\n| auto | 2 |") == 3 and md.count("\n| auto, 2 slots |") == 1  # task rows, memory row
    need_module("matplotlib")
    paths = loadbench.plot(records, str(tmp_path / "plots"))
    assert [p.rsplit("/", 1)[1] for p in paths] == ["speedup_vs_concurrency.png", "tau_by_task.png"]
    rows = loadbench.telemetry_rows(req_rows)
    agg = [r for r in rows if r["kind"] == "aggregate" and r["task"] == "all"]
    assert len(agg) == 6 and all(json.dumps(r) for r in rows)
    ngram = next(r for r in agg if r["method"] == "ngram" and r["concurrency"] == 1)
    assert ngram["num_draft_tokens"] == 4 * ngram["num_drafts"] > 0


@pytest.mark.parametrize("kw, match", [
    (dict(methods=("ngram", "hydra")), "unknown method 'hydra'"),
    (dict(methods=("none",), concurrency=(1, 0)), "concurrency 0"),
    (dict(methods=("none",), concurrency=()), "concurrency"),
    (dict(methods=("none",), rate=0.0), "rate"),
    (dict(methods=("none",), rate=-2.0), "rate"),
])
def test_bad_plan(kw, match):
    with pytest.raises(ValueError, match=match):
        LoadPlan(**kw)


def _write(tmp_path, text):
    p = tmp_path / "prompts.jsonl"
    p.write_text(text)
    return str(p)


@pytest.mark.parametrize("argv, match", [
    (["--methods", "none,bogus"], "unknown method 'bogus'"),
    (["--concurrency", "0"], "concurrency 0"),
    (["--concurrency", "1,x"], "comma-separated integers"),
    (["--rate", "0"], "rate"),
    (["--prompts-file", "EMPTY"], "empty"),
    (["--prompts-file", "BAD"], "malformed"),
    (["--prompts-file", "MISSING"], "does not exist"),
    (["--methods", "draft"], "draft-model"),
    (["--max-new-tokens", "0"], "max_new_tokens"),
])
def test_cli_bad_input_fails_before_loading(argv, match, tmp_path, monkeypatch, capsys):
    _fails_before_loading("loadbench", argv, match, tmp_path, monkeypatch, capsys)


def _fails_before_loading(command, argv, match, tmp_path, monkeypatch, capsys):
    """`specjax COMMAND ARGV` exits 2 with one error line holding `match`, before any model loads."""
    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the input was checked")

    monkeypatch.setattr(Engine, "load", no_load)
    files = {"EMPTY": _write(tmp_path, "\n\n"), "MISSING": str(tmp_path / "nope.jsonl")}
    if "BAD" in argv:
        files["BAD"] = _write(tmp_path, '{"question_id": 1, "task": "qa", "turns": ["hi"]}\n{"task": "qa"\n')
    argv = [files.get(a, a) for a in argv]
    head = ["--methods", "none,ngram"] if command == "loadbench" else []
    assert cli.main([command, *head, *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and match in err


def test_auto_gets_the_medusa_options_the_heads_support(tiny_model):
    from flax import nnx

    from specjax.methods.config import SpecConfig
    from specjax.serving.controller import ControllerConfig
    from specjax.models.heads import HeadsConfig, MedusaHeads

    heads = MedusaHeads(HeadsConfig.for_model(tiny_model.config, num_heads=4), base=tiny_model,
                        rngs=nnx.Rngs(0))
    eng = Engine(tiny_model, assets={"medusa": LoadedHeads(heads)})
    auto = ControllerConfig(ks=(0, 2, 8)).with_assets(eng.assets)
    assert [o.label for o in auto.options] == ["none", "ngram:2", "ngram:8", "medusa:2"]
    tree = SpecConfig.make("medusa", tree="small")
    auto = ControllerConfig(ks=(0, 4)).with_assets(eng.assets, {"medusa": tree})
    assert auto.options[-2:] == (SpecConfig(method="medusa", k=4), tree)
    assert auto.options[-1].label == f"medusa-tree:{tree.k}"


# ---- `specjax bench`: offline, methods side by side ------------------------------------------------


def test_offline_bench_side_by_side(tiny_model):
    from specjax.bench import offline
    from specjax.methods.config import SpecConfig

    eng = Engine(tiny_model)
    prompts = [Prompt(1, [5, 9, 12, 5, 9, 12, 5, 9], "copy"), Prompt(2, [40, 41, 42, 43, 40], "chat"),
               Prompt(3, [3, 4, 5, 3, 4, 5], "copy")]
    specs = {"none": SpecConfig(), "ngram": SpecConfig(method="ngram", k=4)}
    rows = offline.run(eng, prompts, specs, GenerateOptions(max_new_tokens=12, stop_ids=()), batch_size=2,
                     repeats=2, progress=False)
    assert len(rows) == 2 * 2 * 3
    records = offline.summarize(rows)
    assert [(r["method"], r["task"]) for r in records] == [
        ("none", "all"), ("none", "chat"), ("none", "copy"), ("ngram", "all"), ("ngram", "chat"), ("ngram", "copy")]
    for r in records:
        assert r["greedy_identical_n"] == r["prompts"] and r["tok_s"] > 0 and r["speedup_vs_none"] > 0
    none_all = records[0]
    assert none_all["tau"] == 1.0 and none_all["speedup_vs_none"] == 1.0 and none_all["prompts"] == 6
    ngram_copy = records[-1]
    assert ngram_copy["tau"] > 1 and len(ngram_copy["accepted_tokens_per_pos"]) == 4
    assert "| ngram | copy | 4 |" in offline.markdown(records)


@pytest.mark.parametrize("argv, match", [
    (["--methods", "none,auto"], "specjax loadbench"),
    (["--methods", "bogus"], "unknown method 'bogus'"),
    (["--methods", "draft"], "draft-model"),
    (["--batch-size", "0"], "batch-size"),
    (["--max-new-tokens", "0"], "max_new_tokens"),
])
def test_offline_bench_bad_input_fails_before_loading(argv, match, tmp_path, monkeypatch, capsys):
    _fails_before_loading("bench", argv, match, tmp_path, monkeypatch, capsys)


# ---- `specjax loadbench --surge`: a ramp of arrival rates, per phase --------------------------------


SURGE_FIELDS = {"method", "phase", "rate", "requests", "ttft_p50_s", "latency_mean_s", "latency_p50_s",
                "itl_p50_s", "itl_p99_s", "throughput_tok_s", "speculated_fraction", "mean_batch_size",
                "memory",
                "latency_vs_none", "throughput_vs_none", "itl_p99_vs_none", "chunks"}


def test_surge_bench_at_tiny_scale(tiny_model, tmp_path):
    from specjax.bench import surge

    phases = ((40.0, 0.25), (400.0, 0.1), (40.0, 0.25))
    times, index = surge.arrivals(phases)  # the seed the bench uses
    assert times == sorted(times) and set(index) == {0, 1, 2}
    assert all(lo <= t < hi for t, i in zip(times, index) for lo, hi in [surge.windows(phases)[i]])
    eng = Engine(tiny_model)
    prompts = [Prompt(1, [5, 9, 12, 5, 9, 12, 5, 9], "config"), Prompt(2, [40, 41, 42, 43, 40], "diagnostic")]
    plan = LoadPlan(methods=("auto",), concurrency=(4,), chunk=4, surge=phases, batch_sizes=(1, 2))
    req_rows, run_rows = loadbench.run(eng, prompts, plan, GenerateOptions(max_new_tokens=10), progress=False)
    assert len(req_rows) == 2 * len(times) and {r["phase"] for r in req_rows} == {0, 1, 2}
    records = surge.summarize(req_rows, run_rows, phases)
    assert {(r["method"], r["phase"]) for r in records} == {(m, p) for m in ("none", "auto") for p in (0, 1, 2, "all")}
    for r in records:
        assert SURGE_FIELDS <= set(r), SURGE_FIELDS - set(r)
        assert 0 <= r["speculated_fraction"] <= 1 and r["requests"] >= 1
    assert sum(r["requests"] for r in records if r["phase"] != "all" and r["method"] == "auto") == len(times)
    table = surge.markdown(records)
    assert table.count("| auto |") == 4  # the memory table is the load bench's
    need_module("matplotlib")
    assert surge.plot(req_rows, run_rows, phases, str(tmp_path)).endswith("surge.png")


@pytest.mark.parametrize("argv, match", [
    (["--surge", "1:0"], "must be > 0"),
    (["--surge", "fast"], "RATE:SECONDS"),
    (["--surge", "1:5", "--concurrency", "1,4"], "one --concurrency"),
    (["--surge", "1:5", "--concurrency", "4", "--batch-sizes", "8"], "batch size 8"),
])
def test_surge_bad_input_fails_before_loading(argv, match, tmp_path, monkeypatch, capsys):
    _fails_before_loading("loadbench", argv, match, tmp_path, monkeypatch, capsys)


def test_output_folders_are_made_before_any_work(tmp_path, monkeypatch, capsys):
    from specjax.bench.prompts import check_output_paths

    out = tmp_path / "new" / "deeper" / "records.json"
    check_output_paths(str(out), None)
    assert out.parent.is_dir()
    (tmp_path / "blocker").write_text("a file")
    with pytest.raises(ValueError, match="cannot be created"):
        check_output_paths(str(tmp_path / "blocker" / "x.json"))
    monkeypatch.setattr(Engine, "load", lambda *a, **k: (_ for _ in ()).throw(AssertionError("loaded")))
    assert cli.main(["loadbench", "--json", str(tmp_path / "blocker" / "x.json")]) == 2
    assert "cannot write" in capsys.readouterr().err
