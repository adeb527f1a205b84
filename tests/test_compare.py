"""`specjax.compare`: the report of `make run` (auto against plain) from fixed timings."""

import pytest

from specjax import compare


def _report(auto_s, plain_s, chunks, tokens=100, **kw):
    return compare.report("config", [(s, tokens) for s in auto_s], [(s, tokens) for s in plain_s], chunks,
                          tau=2.5, **kw)


def test_speedup_is_the_median_with_its_range():
    r = _report([1.0, 1.25, 0.8], [2.0, 2.0, 2.0], {"ngram:8": 10, "none": 3}, identical=(3, 3))
    assert r.speedups == pytest.approx([2.0, 1.6, 2.5])
    assert (r.median, r.low, r.high) == pytest.approx((2.0, 1.6, 2.5))
    assert r.claim == pytest.approx(2.0)
    assert r.text() == ("[config: auto tau 2.50 (ngram:8 x10, none x3); 2.00x plain decoding, median of 3 "
                        "(range 1.60-2.50x; plain 2.0 s, auto 1.0 s per run, 3 interleaved runs each, "
                        "compile excluded); identical to plain 3/3]")


def test_speedup_counts_tokens_per_second():
    # auto made fewer tokens in the same time (a sampled run): it is not faster
    r = compare.report("", [(1.0, 50)], [(1.0, 100)], {"ngram:4": 2}, tau=1.5)
    assert r.median == pytest.approx(0.5)
    assert "one run: no spread" in r.text() and not r.text().startswith("[:")


def test_a_range_across_one_is_called_noise():
    r = _report([1.0, 1.0, 1.0], [0.95, 1.05, 1.1], {"ngram:2": 4, "none": 4})
    assert "within run-to-run noise" in r.text()
    assert "noise" not in _report([1.0, 1.0], [1.2, 1.3], {"ngram:2": 4}).text()


def test_auto_that_never_speculated_claims_no_speedup():
    # plain on every chunk: the same loop as the baseline, so a faster timing is noise, not a speedup
    r = _report([0.7, 0.75, 0.8], [1.0, 1.0, 1.0], {"none": 8}, identical=(3, 3))
    assert not r.speculated and r.claim is None
    text = r.text()
    assert text == ("[config: auto decoded plain on every chunk (none x8): no speculation, no speedup "
                    "claimed (plain 1.0 s, auto 0.8 s per run, 3 interleaved runs each, compile excluded); "
                    "identical to plain 3/3]")
    assert "x plain decoding" not in text
    assert r.to_dict()["speedup_median"] is None and r.to_dict()["speculated"] is False
    # an option listed with zero chunks is not speculation either
    assert not _report([1.0], [1.0], {"none": 5, "ngram:8": 0}).speculated


@pytest.mark.parametrize("auto, plain, chunks, match", [
    ([], [], {"none": 1}, "at least one Pair"),
    ([(1.0, 10)], [], {"none": 1}, "pair up"),
    ([(0.0, 10)], [(1.0, 10)], {"none": 1}, "auto_s=0.0"),
    ([(1.0, 10)], [(float("nan"), 10)], {"none": 1}, "plain_s=nan"),
    ([(1.0, 0)], [(1.0, 10)], {"none": 1}, "auto_tokens=0"),
    ([(1.0, 10)], [(1.0, 10)], {"none": -1}, "counts"),
])
def test_bad_input_is_refused(auto, plain, chunks, match):
    with pytest.raises(ValueError, match=match):
        compare.report("x", auto, plain, chunks, tau=1.0)


# ---- `specjax generate --method auto` end to end, on the tiny random model ----------------------------

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
    from specjax.engine import Engine

    engines = []

    def load(cls, name, **kw):
        engines.append(Engine(tiny_model, _CharTokenizer(), name="tiny"))
        return engines[-1]

    monkeypatch.setattr(Engine, "load", classmethod(load))
    return engines


def test_generate_auto_reports_each_prompt_class_from_interleaved_runs(tiny_cli, capsys, monkeypatch):
    from specjax import cli, scheduler

    made = []
    init = scheduler.Scheduler.__init__

    def spy(self, *a, **kw):
        init(self, *a, **kw)
        made.append(self)

    monkeypatch.setattr(scheduler.Scheduler, "__init__", spy)
    rc = cli.main(["generate", "--method", "auto", "--demo", "--repeats", "2", "--max-new-tokens", "12"])
    out, err = capsys.readouterr()
    assert rc == 0
    assert "--- demo-config (configuration request) ---" in out and "--- demo-question (open question) ---" in out
    lines = [ln for ln in err.splitlines() if ln.startswith(("[configuration request:", "[open question:"))]
    assert len(lines) == 2, err
    for ln in lines:  # a speedup with its spread over 2 runs, or no claim at all
        assert ("x plain decoding, median of 2 (range " in ln) != ("no speculation, no speedup claimed" in ln), ln
        assert "2 interleaved runs each, compile excluded); identical to plain 2/2]" in ln, ln
    # auto, plain, plain, auto: each a fresh scheduler; the plain arm opts out of speculation and only
    # the first run calibrates (the others reuse its cost model)
    assert len(made) == 4
    assert [all(r.opt_out for r in s.requests) for s in made] == [False, True, True, False]
    assert all(s.costs is made[0].costs for s in made)
    # one set of programs for both arms: everything compiled while the first scheduler prepared
    (engine,) = tiny_cli
    assert sum(s.compile_s > 0 for s in made) == 1


def test_generate_auto_json_has_the_comparison(tiny_cli, capsys):
    import json

    from specjax import cli

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
    from specjax import cli

    assert cli.main(["generate", *argv]) == 2
    assert match in capsys.readouterr().err


def test_the_cli_keeps_compiled_programs_under_the_specjax_cache(monkeypatch, tmp_path):
    import jax
    from jax._src import compilation_cache

    from specjax import cli

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
