"""`specjax.bench.compare`: the report of `make run` (auto against plain) from fixed timings."""

import pytest

from specjax.bench import compare


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


def test_repeated_share_tells_a_loop_from_repeated_names():
    loop = "services: web: image: nginx ports: - 8080:80".split() * 6  # one line of 7 words, six times
    assert compare.repeated_share([loop]) == pytest.approx(35 / 42)  # all but the first 7 words
    # a configuration file that names its service again and again, in short spans: no repetition
    config = ("services: ledger: image: ledger:1.0 ports: - 3000:3000 environment: LEDGER_PORT: 3000 "
              "LEDGER_DB: ledger-db depends_on: - ledger-db ledger-db: image: postgres:16 volumes: "
              "- ledger-data:/var/lib/postgresql/data volumes: ledger-data:").split()
    assert compare.repeated_share([config]) == 0.0
    # each output is scanned on its own, the share counts every output's tokens
    assert compare.repeated_share([loop, config]) == pytest.approx(35 / (42 + len(config)))
    assert compare.repeated_share([]) == 0.0 and compare.repeated_share([[1, 2, 3]]) == 0.0


def test_a_speedup_from_repetition_says_so():
    r = _report([1.0, 1.0], [2.9, 2.9], {"ngram:8": 10}, repeated=0.83)
    first, note = r.text().split("\n")
    assert first.startswith("[config: auto tau 2.50") and "2.90x plain decoding" in first
    assert note == ("[config: 83% of the output repeats 8-token spans it already wrote: the speedup comes "
                    "largely from the model repeating itself]")
    assert r.to_dict()["repeated"] == pytest.approx(0.83)
    assert "\n" not in _report([1.0], [2.0], {"ngram:8": 10}, repeated=0.1).text()
    # no speedup claimed, nothing to explain
    assert "repeats" not in _report([1.0], [1.0], {"none": 10}, repeated=0.9).text()
    with pytest.raises(ValueError, match="repeated=1.5"):
        _report([1.0], [1.0], {"none": 1}, repeated=1.5)
