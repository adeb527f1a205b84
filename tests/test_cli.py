"""`specjax.cli`: flags onto specs and options (each method's record's flags), each command's checks before any model loads, the
commands end to end on the tiny random model (Engine.load replaced), and the CLI's compilation cache."""

import json

import pytest

from specjax.cli import commands as cli, specs
from specjax.methods.config import SpecConfig
from specjax.serving.engine import Engine
from specjax.methods.eagle.record import LoadedEagle


# ---- flags onto a SpecConfig ------------------------------------------------------------------------


@pytest.mark.parametrize("argv, want", [
    ([], SpecConfig()),
    (["--method", "auto"], SpecConfig()),  # auto's options come from the controller, not one spec
    (["--method", "ngram"], SpecConfig(method="ngram", k=4)),
    (["--method", "ngram", "--k", "6", "--ngram-min", "2", "--ngram-max", "4"],
     SpecConfig.make("ngram", k=6, ngram_min=2, ngram_max=4)),
    (["--method", "draft", "--k", "2", "--draft-model", "x"], SpecConfig(method="draft", k=2)),
    (["--method", "medusa", "--k", "3"], SpecConfig(method="medusa", k=3)),
    (["--method", "medusa", "--tree", "small"], SpecConfig.make("medusa", tree="small")),
    (["--method", "medusa", "--tree", "[[0],[1],[0,0]]"], SpecConfig.make("medusa", tree=((0,), (1,), (0, 0)))),
    (["--method", "medusa", "--tree", "heads"], SpecConfig.make("medusa", tree="heads")),
    (["--method", "eagle", "--k", "3"], None),  # from the loaded head's tuning, flags overriding
])
def test_generate_flags_make_their_spec(argv, want):
    args = cli.build_parser().parse_args(["generate", "--prompt", "x", *argv])
    assert specs.spec_of(args, args.method, strict=True) == want


@pytest.mark.parametrize("argv, match", [
    (["--method", "ngram", "--k", "0"], "k=0"),
    (["--method", "ngram", "--k", "17"], "k=17"),
    (["--method", "medusa", "--tree", "huge"], "unknown tree 'huge'"),
    (["--method", "medusa", "--tree", "[[0],[1,0]]"], "parent"),
    (["--method", "ngram", "--tree", "small"], "'medusa' or 'recycle' only"),
    (["--method", "eagle", "--nodes", "-1"], "--nodes=-1"),
    (["--method", "draft"], "--draft-model"),
    (["--batch-size", "0"], "--batch-size=0"),
    (["--json-schema", "/nonexistent/schema.json"], "no such file"),
    (["--json-schema", "/nonexistent/schema.json", "--regex", "[a-z]+"], "give one constraint"),
])
def test_generate_bad_flags_fail_before_loading(argv, match, monkeypatch, capsys):
    monkeypatch.setattr(Engine, "load", lambda *a, **k: pytest.fail("loaded the model before checking"))
    assert cli.main(["generate", "--prompt", "x", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and match in err, err


def test_prompts_with_different_constraints_in_one_batch_fail_before_loading(monkeypatch, capsys):
    """Outside auto a batch runs one constraint: the demo's schema prompt beside free ones at
    --batch-size 3 is refused before the model loads (auto takes them, a pool slot each)."""
    monkeypatch.setattr(Engine, "load", lambda *a, **k: pytest.fail("loaded the model before checking"))
    assert cli.main(["generate", "--demo", "--batch-size", "3", "--method", "ngram"]) == 2
    err = capsys.readouterr().err
    assert "demo-config, demo-schema, demo-question share a batch but not a constraint" in err, err
    assert "--batch-size 1, or --method auto" in err


def test_generate_auto_takes_a_json_schema_for_every_prompt(tiny_json_cli, capsys, monkeypatch, tmp_path):
    """`--json-schema FILE` with auto: every prompt constrained in both arms, forced among the options."""
    import json

    import jsonschema

    from specjax.cli import commands as cli
    from specjax.serving import scheduler

    made = []
    init = scheduler.Scheduler.__init__
    monkeypatch.setattr(scheduler.Scheduler, "__init__", lambda self, *a, **kw: (init(self, *a, **kw), made.append(self))[0])
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
    (tmp_path / "s.json").write_text(json.dumps(schema))
    assert cli.main(["generate", "--method", "auto", "--prompt", "abc", "--repeats", "1", "--max-new-tokens", "16",
                     "--json-schema", str(tmp_path / "s.json"), "--auto-methods", "ngram,forced", "--json"]) == 0
    (rec,) = [json.loads(ln) for ln in capsys.readouterr().out.splitlines()]
    assert rec["stop_reason"] == "stop_token", rec
    jsonschema.validate(json.loads(rec["text"]), schema)
    assert [r.pool_slot > 0 for s in made for r in s.requests] == [True, True]


def test_a_method_contributes_its_flags_from_its_record(monkeypatch, capsys):
    """A record's `Flag`s reach every command that takes a method and set their option; the bound
    is checked before any model loads. Nothing in the CLI names the method."""
    from specjax.methods import registry
    from specjax.methods.ngram.options import NgramOptions
    from specjax.methods.ngram.proposer import NgramProposer

    toy = registry.Record("toy", NgramProposer.from_spec, option_type=NgramOptions, flags=(
        registry.Flag("--toy-longest", "ngram_max", int, "toy: longest n-gram", min=2),))
    monkeypatch.setitem(registry.RECORDS, "toy", toy)
    parser = cli.build_parser()
    args = parser.parse_args(["generate", "--prompt", "x", "--method", "toy", "--toy-longest", "5"])
    assert specs.spec_of(args, "toy", strict=True) == SpecConfig.make("toy", k=4, ngram_max=5)
    for command in (["bench"], ["loadbench"], ["serve"]):
        assert parser.parse_args([*command, "--toy-longest", "4"]).toy_longest == 4
    monkeypatch.setattr(Engine, "load", lambda *a, **k: pytest.fail("loaded the model before checking"))
    assert cli.main(["generate", "--prompt", "x", "--method", "toy", "--toy-longest", "1"]) == 2
    assert "--toy-longest=1: must be >= 2" in capsys.readouterr().err
    clash = registry.Record("clash", NgramProposer.from_spec, flags=(registry.Flag("--toy-longest", "k", int),))
    monkeypatch.setitem(registry.RECORDS, "clash", clash)
    with pytest.raises(ValueError, match="one flag, one option"):
        registry.flags()


# ---- the commands end to end on the tiny random model ------------------------------------------------


class _CharTokenizer:
    """Characters as token ids (1..62); no stop tokens, no chat template."""

    stop_ids = ()

    def encode(self, text, *, add_bos=None):
        return [1 + ord(c) % 62 for c in text]

    def decode(self, ids, *, skip_special=False):
        return "".join(chr(96 + int(i) % 26) for i in ids)

    def decode_stream(self, *, skip_special=False):
        tok = self

        class Stream:
            def push(self, ids):
                return tok.decode(ids)

            def flush(self):
                return ""

        return Stream()


@pytest.fixture
def tiny_cli(tiny_model, monkeypatch):
    from specjax.serving.engine import Engine

    engines = []

    def load(cls, name, **kw):
        engines.append(Engine(tiny_model, _CharTokenizer(), name="tiny"))
        return engines[-1]

    monkeypatch.setattr(Engine, "load", classmethod(load))
    return engines


@pytest.fixture
def tiny_json_cli(tiny_model, monkeypatch):
    """The tiny model behind `Engine.load`, with a byte-level tokenizer that spells JSON (so the demo's
    schema compiles over its vocabulary) and a stop token."""
    from test_server_constraints import json_engine

    from specjax.serving.engine import Engine

    engines = []

    def load(cls, name, **kw):
        engines.append(Engine(tiny_model, json_engine().tokenizer, name="tiny"))
        return engines[-1]

    monkeypatch.setattr(Engine, "load", classmethod(load))
    return engines


def test_generate_auto_reports_each_prompt_class_from_interleaved_runs(tiny_json_cli, capsys, monkeypatch):
    """`make run`'s command on the tiny model: the three demo prompts (the schema one constrained in both
    arms, through a constraint pool), auto among prompt lookup, the prediction and the forced text."""
    from specjax.cli import commands as cli
    from specjax.serving import scheduler

    made = []
    init = scheduler.Scheduler.__init__

    def spy(self, *a, **kw):
        init(self, *a, **kw)
        made.append(self)

    monkeypatch.setattr(scheduler.Scheduler, "__init__", spy)
    rc = cli.main(["generate", "--method", "auto", "--demo", "--repeats", "2", "--max-new-tokens", "12",
                   "--auto-methods", "ngram,predict,forced"])
    out, err = capsys.readouterr()
    assert rc == 0
    for head in ("demo-config (configuration request)", "demo-schema (configuration as JSON)",
                 "demo-question (open question)"):
        assert f"--- {head} ---" in out, out
    lines = [ln for ln in err.splitlines() if ln.startswith(("[configuration request:", "[configuration as JSON:",
                                                              "[open question:")) and "repeats" not in ln]
    assert len(lines) == 3, err  # a repetition note may follow a line (the tiny model loops)
    for ln in lines:  # a speedup with its spread over 2 runs, or no claim at all
        assert ("x plain decoding, median of 2 (range " in ln) != ("no speculation, no speedup claimed" in ln), ln
        assert "2 interleaved runs each, compile excluded); identical to plain 2/2]" in ln, ln
    # auto, plain, plain, auto: each a fresh scheduler; the plain arm opts out of speculation and only
    # the first run calibrates (the others reuse its cost model)
    assert len(made) == 4
    assert [all(r.opt_out for r in s.requests) for s in made] == [False, True, True, False]
    assert all(s.costs is made[0].costs for s in made)
    # one set of programs for both arms: everything compiled while the first scheduler prepared
    assert sum(s.compile_s > 0 for s in made) == 1
    assert {o.method for o in made[0].options} == {"none", "ngram", "predict", "forced"}
    assert all(s.constraint_pool is not None for s in made)
    constrained = [[r.pool_slot > 0 for r in s.requests] for s in made]
    assert constrained == [[False, True, False]] * 4  # the schema prompt, in both arms


def test_chat_on_a_model_without_a_template_is_one_clear_error(tiny_cli, capsys):
    """Completion mode: a base model (no chat template) with --chat fails in one line, before
    anything compiles."""
    from specjax.cli import commands as cli

    assert cli.main(["generate", "--chat", "--prompt", "hello", "--max-new-tokens", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and "without --chat" in err, err


def test_generate_auto_json_has_the_comparison(tiny_cli, capsys):
    import json

    from specjax.cli import commands as cli

    assert cli.main(["generate", "--method", "auto", "--prompt", "abcabcabc", "--repeats", "1",
                     "--max-new-tokens", "8", "--json", "--auto-methods", "ngram"]) == 0
    (rec,) = [json.loads(ln) for ln in capsys.readouterr().out.splitlines()]
    c = rec["comparison"]
    assert len(c["speedups"]) == len(c["auto_s"]) == len(c["plain_s"]) == 1
    assert c["speculated"] == any(k != "none" and n for k, n in c["chunks"].items())
    assert (c["speedup_median"] is None) == (not c["speculated"]) and rec["identical_to_plain"] is True


@pytest.mark.parametrize("argv, match", [
    (["--method", "auto", "--prompt", "x", "--repeats", "0"], "--repeats=0"),
    (["--method", "auto", "--prompt", "x", "--auto-methods", "ngram,hydra"], "--auto-methods 'ngram,hydra'"),
    (["--method", "ngram", "--prompt", "x", "--repeats", "3"], "for --method auto"),
])
def test_generate_auto_flags_are_checked(tiny_cli, capsys, argv, match):
    from specjax.cli import commands as cli

    assert cli.main(["generate", *argv]) == 2
    assert match in capsys.readouterr().err


def test_cli_generate_and_loadbench_run_on_the_tiny_model(tiny_model, monkeypatch, capsys, tmp_path):
    """The CLI's own paths end to end (the Engine.load of a tiny random model): generate with a
    method, loadbench with plain, prompt lookup and auto."""
    monkeypatch.setattr(Engine, "load", classmethod(lambda cls, name, **kw: Engine(tiny_model, _CharTokenizer(),
                                                                                  name="tiny")))
    assert cli.main(["generate", "--method", "ngram", "--k", "2", "--prompt", "abcabcabc", "--json",
                     "--max-new-tokens", "6"]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    assert json.loads(line)["method"] == "ngram" and json.loads(line)["k"] == 2
    out = tmp_path / "load.json"
    assert cli.main(["loadbench", "--methods", "none,ngram,auto", "--concurrency", "1", "--max-new-tokens", "4",
                     "--json", str(out)]) == 0
    assert {r["method"] for r in json.loads(out.read_text())} == {"none", "ngram", "auto"}
    # a method with tuned settings (recycle) runs the chain --k gives, not its tuned template
    runs = tmp_path / "runs.json"
    assert cli.main(["loadbench", "--methods", "recycle", "--k", "2", "--concurrency", "1", "--max-new-tokens", "4",
                     "--runs-json", str(runs)]) == 0
    ran = [r for r in json.loads(runs.read_text()) if r["method"] == "recycle"]
    assert ran and all(set(r["chunks"]) == {"recycle:2"} for r in ran), [r["chunks"] for r in ran]


def test_bench_spec_of_every_method_label(tiny_model):
    """`specjax bench`'s labels map to specs; a method with tuned settings (eagle, eagle-tree) takes
    them from the loaded head, flags overriding."""
    import numpy as np
    from flax import nnx

    from specjax.bench import offline
    from specjax.methods.config import TREES
    from specjax.models.eagle import EagleConfig, EagleHead

    args = cli.build_parser().parse_args(["bench", "--k", "3", "--tree", "small"])
    by_label = {m: specs.bench_spec(args, m) for m in offline.OFFLINE_METHODS}
    assert by_label["none"].method == "none" and by_label["ngram"].k == 3 and by_label["draft"].options is None
    assert by_label["medusa"].options.tree == TREES["small"] and by_label["eagle"] is None and by_label["eagle-tree"] is None
    eng = Engine(tiny_model)
    head = EagleHead(EagleConfig.for_model(tiny_model.config, draft_vocab=64), rngs=nnx.Rngs(2))
    eng.set_asset("eagle", LoadedEagle(head, np.arange(64)))
    chain, tree = specs.bench_spec(args, "eagle", eng), specs.bench_spec(args, "eagle-tree", eng)
    assert (chain.method, chain.k, chain.options.nodes) == ("eagle", 3, 0)
    assert (tree.method, tree.k, tree.options.nodes, tree.options.topk) == ("eagle", 3, 16, 4)  # untuned head: the defaults


# ---- training and tuning commands: their checks come before any work -------------------------------


@pytest.mark.parametrize("argv,message", [
    (["--conversations", "0"], "--conversations"),
    (["--max-minutes", "-1"], "max-minutes"),
    (["--features", "final", "--feature-layers", "1"], "feature-layers"),
])
def test_cli_extract_rejects_bad_input_before_work(tmp_path, capsys, monkeypatch, argv, message):
    from specjax.cli import commands as cli
    from specjax.serving.engine import Engine

    monkeypatch.setattr(Engine, "load", lambda *a, **k: pytest.fail("loaded the model before checking"))
    assert cli.main(["train-heads", "extract", "--out", str(tmp_path), *argv]) == 2
    assert message in capsys.readouterr().err


def test_tune_cli_rejects_a_directory_without_a_head(tmp_path, capsys):
    from specjax.cli import commands as cli

    assert cli.main(["tune-heads", "--eagle", str(tmp_path)]) == 2
    assert "manifest.json" in capsys.readouterr().err


def test_cli_rejects_a_file_as_out(tmp_path, capsys):
    f = tmp_path / "f"
    f.write_text("")
    assert cli.main(["train-heads", "--out", str(f)]) == 2
    assert "is a file" in capsys.readouterr().err


# ---- the compilation cache ---------------------------------------------------------------------------


def test_the_cli_keeps_compiled_programs_under_the_specjax_cache(monkeypatch, tmp_path):
    import jax
    from jax._src import compilation_cache

    from specjax.cli import commands as cli

    keys = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
            "jax_persistent_cache_min_entry_size_bytes")
    saved = {k: getattr(jax.config, k) for k in keys}
    monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))
    try:
        jax.config.update("jax_compilation_cache_dir", None)  # the test session's own cache (conftest)
        monkeypatch.setenv("SPECJAX_COMPILE_CACHE", "0")
        assert cli.compile_cache() is None and jax.config.jax_compilation_cache_dir is None
        monkeypatch.setenv("SPECJAX_COMPILE_CACHE", "1")
        assert cli.compile_cache() == str(tmp_path / "jax-compile")
        assert [getattr(jax.config, k) for k in keys] == [str(tmp_path / "jax-compile"), 0.0, -1]
        jax.config.update("jax_compilation_cache_dir", str(tmp_path / "mine"))  # JAX's own setting wins
        assert cli.compile_cache() == str(tmp_path / "mine")
    finally:
        for k, v in saved.items():
            jax.config.update(k, v)
        compilation_cache.reset_cache()


@pytest.mark.parametrize("argv, match", [
    (["warm-recycle", "--prompts-file", "tasks", "--out", "OUT", "--recycle-k", "33"], "--recycle-k"),
    (["warm-recycle", "--prompts-file", "tasks", "--out", "OUT", "--per-task", "0"], "--per-task"),
    (["tune-recycle", "NOWHERE", "--prompts-file", "tasks"], "no manifest.json"),
])
def test_recycle_commands_refuse_bad_flags_before_any_work(argv, match, monkeypatch, capsys, tmp_path):
    """`warm-recycle` and `tune-recycle` check their flags before a model loads."""
    from train_heads import recycle

    for name in ("warm", "tune"):
        monkeypatch.setattr(recycle, name, lambda *a, **k: pytest.fail("started before checking"))
    argv = [str(tmp_path / a) if a in ("OUT", "NOWHERE") else a for a in argv]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and match in err, err


def test_auto_methods_cut_every_option_to_the_chosen(tiny_model):
    """`--auto-methods` is what auto may run: a method with options shipped for the model (token
    recycling's warm start for SmolLM2) adds none unless chosen; predict and forced only when chosen."""
    from specjax.serving.engine import Engine

    eng = Engine(tiny_model, name="smollm2-135m")
    every = specs.auto_controller(eng, None)
    assert {o.method for o in every.extra} == {"recycle"} and set(every.methods) == {"ngram"}
    cut = specs.auto_controller(eng, ("ngram", "forced"))
    assert cut.extra == () and cut.methods == ("ngram", "forced")
    assert specs.auto_controller(eng, ("recycle",)).extra == every.extra


def test_q8_arithmetic_on_a_model_it_cannot_take_is_one_clear_error(tmp_path, capsys):
    """`--weights-arith q8` needs a GGUF kept packed: an HF directory is refused in one line, before any
    weight is read."""
    from specjax.cli import commands as cli

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert cli.main(["generate", "--model", str(tmp_path), "--weights-arith", "q8", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "weights_arith='q8'" in err and "an HF directory" in err, err
