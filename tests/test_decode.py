"""Plain decoding through the Engine: greedy oracle, batching, compile cache, stopping, sampling."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import padded_logits
from scipy import stats

from specjax.core import sampling
from specjax.serving.engine import Engine, GenerateOptions
from specjax.core.sampling import Sample, SamplingParams
from specjax.methods.config import SpecConfig

BUCKETS = (8, 16)
REF_LEN = 32  # the naive reference pads every sequence to this length: one compile

PROMPTS = {  # token-id prompts of different lengths, all in bucket 8
    "a": [5, 17, 42, 9, 33],
    "b": [60, 2, 11],
    "c": [7, 7, 30, 51, 19, 23, 1],
}


@pytest.fixture(scope="module")
def compiles():
    """Counts programs XLA compiles or the session's persistent cache loads (conftest), independently
    of `Engine.compile_count`."""
    from conftest import PROGRAM_EVENTS

    events = []

    def listen(event, _secs, **_):
        if event in PROGRAM_EVENTS:
            events.append(event)

    jax.monitoring.register_event_duration_secs_listener(listen)
    yield events
    jax.monitoring.unregister_event_duration_listener(listen)


@pytest.fixture(scope="module")
def engine(tiny_model):
    return Engine(tiny_model, buckets=BUCKETS)


def reference_greedy(model, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Argmax decoding that recomputes every whole sequence each step, with no cache reuse.

    Sequences are right-padded to REF_LEN (causality makes the padding irrelevant) so that
    every step reuses one compiled forward.
    """
    seqs = [list(p) for p in prompts]
    for _ in range(n):
        logits = padded_logits(model, seqs, REF_LEN)
        for r, seq in enumerate(seqs):
            seq.append(int(np.argmax(logits[r, len(seq) - 1])))
    return [seq[len(p):] for seq, p in zip(seqs, prompts)]


@pytest.fixture(scope="module")
def greedy_ref(tiny_model):
    """Reference continuations of 12 tokens per prompt."""
    return dict(zip(PROMPTS, reference_greedy(tiny_model, list(PROMPTS.values()), 12)))


# ---- greedy --------------------------------------------------------------------------------------


def test_greedy_matches_naive_reference(engine, greedy_ref):
    results = engine.generate([PROMPTS["a"], PROMPTS["c"]], max_new_tokens=12)
    for r, k in zip(results, "ac"):
        assert r.tokens == greedy_ref[k], k
        assert r.stop_reason == "max_new_tokens" and r.new_tokens == 12
    assert len(set(map(tuple, greedy_ref.values()))) == 3  # the prompts do lead to different text


def test_batch_rows_equal_each_prompt_alone(engine):
    batch = engine.generate([PROMPTS["b"], PROMPTS["c"]], max_new_tokens=12)
    for r, k in zip(batch, "bc"):
        assert r.tokens == engine.generate([PROMPTS[k]], max_new_tokens=12)[0].tokens


def test_batch_size_padding_rows(engine):
    """batch_size larger than the prompts pads with dummy rows that are not returned."""
    results = engine.generate([PROMPTS["a"]], max_new_tokens=12, batch_size=2)
    ref = engine.generate([PROMPTS["a"], PROMPTS["b"]], max_new_tokens=12)
    assert len(results) == 1 and results[0].tokens == ref[0].tokens


def test_generate_splits_into_batches(engine, greedy_ref):
    results = engine.generate([PROMPTS["a"], PROMPTS["b"], PROMPTS["c"]], max_new_tokens=12, batch_size=2)
    assert [r.tokens for r in results] == [greedy_ref[k] for k in "abc"]


@pytest.mark.parametrize("n", [1, 3, 16])
def test_max_new_tokens_exact(engine, greedy_ref, n):
    (r,) = engine.generate([PROMPTS["a"]], max_new_tokens=n)
    assert r.new_tokens == len(r.tokens) == n and r.stop_reason == "max_new_tokens"
    assert r.tokens[:12] == greedy_ref["a"][: min(n, 12)]
    assert r.target_forwards == n - 1  # the first token comes from the prefill


# ---- stop tokens ---------------------------------------------------------------------------------


def _stop_for(row: list[int], other: list[int]) -> tuple[int, int]:
    """A token first produced at index >= 2 of `row` that `other` never produces, and its index."""
    for i in range(2, len(row)):
        if row[i] not in row[:i] and row[i] not in other:
            return row[i], i
    pytest.fail(f"no usable stop token in {row} vs {other}; pick other prompts")


def test_stop_token_ends_only_its_row(engine):
    free = engine.generate([PROMPTS["a"], PROMPTS["c"]], max_new_tokens=12)
    stop, i = _stop_for(free[0].tokens, free[1].tokens)
    r0, r1 = engine.generate([PROMPTS["a"], PROMPTS["c"]], max_new_tokens=12, stop_ids=(63, stop))
    assert r0.tokens == free[0].tokens[: i + 1] and r0.tokens[-1] == stop
    assert r0.stop_reason == "stop_token" and r0.target_forwards == i
    assert r1.tokens == free[1].tokens and r1.stop_reason == "max_new_tokens"


def test_stop_token_as_first_token(engine):
    first = engine.generate([PROMPTS["b"]], max_new_tokens=12)[0].tokens[0]
    (r,) = engine.generate([PROMPTS["b"]], max_new_tokens=12, stop_ids=(first,))
    assert r.tokens == [first] and r.stop_reason == "stop_token" and r.target_forwards == 0


# ---- cache full ----------------------------------------------------------------------------------


def test_cache_full_stops_rows(engine):
    """A Batch whose cache is smaller than prompt + budget stops each row when its cache is full.

    `Engine.start` sizes the cache so this cannot happen unless `cache_length=` is given.
    """
    free = engine.generate([PROMPTS["a"], PROMPTS["b"]], max_new_tokens=12)
    capacity = 10
    batch = engine.start([PROMPTS["a"], PROMPTS["b"]], GenerateOptions(max_new_tokens=12), cache_length=capacity)
    r0, r1 = batch.run()
    assert r0.tokens == free[0].tokens[: capacity - len(PROMPTS["a"])]
    assert r1.tokens == free[1].tokens[: capacity - len(PROMPTS["b"])]
    assert r0.stop_reason == r1.stop_reason == "cache_full"


# ---- compile cache and streaming -----------------------------------------------------------------


def test_compile_once_per_bucket(engine, compiles):
    """Values never recompile; shapes (prompt bucket, max_new bucket, batch, method) do.

    Counted twice: `Engine.compile_count`, and XLA backend compiles of any kind.
    """

    def delta(**kw):
        count, backend = engine.compile_count, len(compiles)
        engine.generate(**kw)
        return engine.compile_count - count, len(compiles) - backend

    delta(prompts=[PROMPTS["a"]], max_new_tokens=5)  # warm (maybe compiled by an earlier test)
    # another length in the same prompt bucket, max_new in the same power-of-two, other stop ids
    assert delta(prompts=[PROMPTS["c"]], max_new_tokens=9, stop_ids=(3,)) == (0, 0)
    # sampling is a different (static) method: compiled once, then its values are free
    delta(prompts=[PROMPTS["a"]], max_new_tokens=5, temperature=0.7, top_k=5, top_p=0.9)
    assert delta(prompts=[PROMPTS["b"]], max_new_tokens=16, temperature=1.3, seed=3) == (0, 0)
    other = dict(max_new_tokens=2, temperature=0.2, top_k=2, top_p=0.5, seed=4)
    assert delta(prompts=[PROMPTS["b"]], **other) == (0, 0)
    # a new prompt bucket, a new max_new bucket: prefill and loop compile again, once
    assert delta(prompts=[list(range(12))], max_new_tokens=5)[0] == 2
    assert delta(prompts=[list(range(13))], max_new_tokens=5) == (0, 0)
    assert delta(prompts=[PROMPTS["a"]], max_new_tokens=17)[0] == 2
    assert delta(prompts=[PROMPTS["b"]], max_new_tokens=32) == (0, 0)


def test_stream_matches_run_without_compiling(engine, compiles):
    prompts = [PROMPTS["a"], PROMPTS["b"]]
    opts = GenerateOptions(max_new_tokens=9)
    full = engine.start(prompts, opts).run()
    count, before = engine.compile_count, len(compiles)
    chunks = list(engine.start(prompts, opts).stream(chunk=3))
    assert engine.compile_count == count and len(compiles) == before
    assert len(chunks) == 1 + 3  # the prefill's token, then 8 tokens in chunks of 3
    assert all(len(c[r]) <= 3 for c in chunks for r in range(2))
    for r in range(2):
        assert sum((c[r] for c in chunks), []) == full[r].tokens


def test_stream_with_stop_token(engine):
    free = engine.generate([PROMPTS["a"], PROMPTS["c"]], max_new_tokens=12)
    stop, i = _stop_for(free[0].tokens, free[1].tokens)
    opts = GenerateOptions(max_new_tokens=12, stop_ids=(stop,))
    chunks = list(engine.start([PROMPTS["a"], PROMPTS["c"]], opts).stream(chunk=2))
    assert sum((c[0] for c in chunks), []) == free[0].tokens[: i + 1]
    assert sum((c[1] for c in chunks), []) == free[1].tokens


# ---- sampling ------------------------------------------------------------------------------------


def _sampled(engine, prompts, seed, **kw):
    return [r.tokens for r in engine.generate(prompts, max_new_tokens=12, temperature=1.0, seed=seed, **kw)]


def test_sampling_seeds(engine, greedy_ref):
    a = _sampled(engine, [PROMPTS["a"], PROMPTS["b"]], seed=0)
    assert a == _sampled(engine, [PROMPTS["a"], PROMPTS["b"]], seed=0)
    b = _sampled(engine, [PROMPTS["a"], PROMPTS["b"]], seed=1)
    assert a[0] != b[0] and a[1] != b[1]
    assert a[0] != greedy_ref["a"]
    same = _sampled(engine, [PROMPTS["a"], PROMPTS["a"]], seed=0)
    assert same[0] == a[0] and same[1] != same[0]  # one prompt twice: each row its own stream


def test_sample_stream_independent_of_neighbours(engine):
    a = _sampled(engine, [PROMPTS["a"], PROMPTS["b"]], seed=5)[0]
    assert a == _sampled(engine, [PROMPTS["a"], PROMPTS["c"]], seed=5)[0]
    assert a == _sampled(engine, [PROMPTS["a"]], seed=5)[0]  # and of the batch size


def _expected_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """softmax(logits / T), keep the top k, keep the smallest prefix with mass >= top_p, renormalise."""
    z = logits / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p)
    keep = np.zeros_like(p, bool)
    keep[order[: top_k or len(p)]] = True
    q = np.where(keep, p, 0.0)
    q /= q.sum()
    csum = np.cumsum(q[order])
    if top_p < 1:
        assert np.min(np.abs(csum - top_p)) > 1e-3  # no boundary case: the kept set is unambiguous
    n = int(np.searchsorted(csum, top_p) + 1)
    keep = np.zeros_like(p, bool)
    keep[order[:n]] = True
    out = np.where(keep, q, 0.0)
    return out / out.sum()


_sample = jax.jit(lambda method, keys, logits, params: method.draw(keys, logits, params), static_argnums=0)
LOGITS = np.array([0.3, 2.0, -1.0, 1.2, 0.0, 1.5, -0.5, 0.8], np.float32)
CASES = [  # (temperature, top_k, top_p)
    (1.0, 0, 1.0),
    (0.7, 3, 1.0),
    (1.5, 0, 0.8),
    (1.0, 5, 0.7),
    (2.0, 4, 0.95),
    (0.5, 0, 0.6),
]


def _params(cases, n):
    t, k, p = (np.repeat(np.asarray(col), n) for col in zip(*cases))
    return SamplingParams(temperature=jnp.asarray(t, jnp.float32), top_k=jnp.asarray(k, jnp.int32),
                          top_p=jnp.asarray(p, jnp.float32))


def test_probs_match_hand_computed():
    params = _params(CASES, 1)
    got = np.asarray(jax.jit(sampling.probs)(jnp.tile(jnp.asarray(LOGITS), (len(CASES), 1)), params))
    for row, case in zip(got, CASES):
        np.testing.assert_allclose(row, _expected_probs(LOGITS.astype(np.float64), *case), atol=1e-6)


def test_sample_distribution_chi_square():
    """20k draws per (temperature, top_k, top_p), all in one batch: each row its own parameters."""
    n = 20_000
    params = _params(CASES, n)
    logits = jnp.tile(jnp.asarray(LOGITS), (n * len(CASES), 1))
    keys = jax.random.split(jax.random.key(1234), n * len(CASES))
    draws = np.asarray(_sample(Sample(), keys, logits, params))
    for i, case in enumerate(CASES):
        expected = _expected_probs(LOGITS.astype(np.float64), *case)
        counts = np.bincount(draws[i * n: (i + 1) * n], minlength=len(LOGITS))
        support = expected > 0
        assert counts[~support].sum() == 0, case  # filtered-out tokens never appear
        assert support.sum() < len(LOGITS) or case == CASES[0]  # every other case filters something
        result = stats.chisquare(counts[support], n * expected[support])
        assert result.pvalue > 1e-3, (case, counts, n * expected)


def test_sample_temperature_zero_row_is_argmax():
    logits = jax.random.normal(jax.random.key(0), (64, 8))
    params = SamplingParams(temperature=jnp.asarray([0.0, 1.0] * 32), top_k=jnp.zeros((64,), jnp.int32),
                            top_p=jnp.ones((64,)))
    draws = np.asarray(_sample(Sample(), jax.random.split(jax.random.key(1), 64),
                               logits, params))
    argmax = np.asarray(jnp.argmax(logits, -1))
    np.testing.assert_array_equal(draws[::2], argmax[::2])
    assert np.any(draws[1::2] != argmax[1::2])


def test_top_p_one_filters_nothing():
    logits = jax.random.normal(jax.random.key(1), (1, 1000)) * 10
    filtered = jax.jit(sampling.filtered_logits)(logits, SamplingParams.create(1, 1.0, 0, 1.0))
    np.testing.assert_array_equal(np.asarray(filtered), np.asarray(logits))


def test_sampling_under_strict_rank_promotion():
    with jax.numpy_rank_promotion("raise"):
        sampling.filtered_logits(jnp.zeros((2, 8)), SamplingParams.create(2, 1.0, 3, 0.9))


# ---- bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "prompts, kw, match",
    [
        pytest.param([[1, 2]], {"temperature": -0.1}, "temperature", id="temperature<0"),
        pytest.param([[1, 2]], {"temperature": float("nan")}, "temperature", id="temperature-nan"),
        pytest.param([[1, 2]], {"top_p": 0.0}, "top_p", id="top_p=0"),
        pytest.param([[1, 2]], {"top_p": 1.5}, "top_p", id="top_p>1"),
        pytest.param([[1, 2]], {"top_k": -1}, "top_k", id="top_k<0"),
        pytest.param([[1, 2]], {"top_k": 2.5}, "top_k", id="top_k-fraction"),
        pytest.param([[1, 2]], {"max_new_tokens": 0}, "max_new_tokens", id="max_new_tokens=0"),
        pytest.param([[1, 2]], {"max_new_tokens": 2.5}, "max_new_tokens", id="max_new_tokens-fraction"),
        pytest.param([[1, 2]], {"stop_ids": tuple(range(9))}, "at most 8", id="9-stop-ids"),
        pytest.param([[1, 2]], {"max_new_tokens": 600}, "context of 512", id="past-max_seq_len"),
        pytest.param([[]], {}, "prompt 0 is empty", id="empty-prompt"),
        pytest.param([[1, 2], list(range(17))], {}, "17 tokens is longer than the largest bucket \\(16\\)",
                     id="prompt-past-largest-bucket"),
        pytest.param([[1, 64]], {}, "outside \\[0, 64\\)", id="token-id=vocab"),
        pytest.param([[-1, 3]], {}, "outside \\[0, 64\\)", id="token-id<0"),
        pytest.param(["text"], {}, "no tokenizer", id="text-without-tokenizer"),
        pytest.param([], {}, "no prompts", id="no-prompts"),
        pytest.param([[1, 2], [70]], {"batch_size": 1}, "prompt 1 has token ids \\[70\\]",
                     id="bad-prompt-in-2nd-batch"),
    ],
)
def test_bad_input_fails_before_compiling(tiny_model, prompts, kw, match):
    eng = Engine(tiny_model, buckets=BUCKETS)
    # TypeError: a fraction where an int is due meets the annotation checker first under the
    # jaxtyping hook (pyproject.toml), naming the parameter; the library's own check otherwise
    with pytest.raises((ValueError, TypeError), match=match):
        eng.generate(prompts, **kw)
    assert eng.compile_count == 0


def test_start_rejects_too_many_prompts(tiny_model):
    eng = Engine(tiny_model, buckets=BUCKETS)
    with pytest.raises(ValueError, match="3 prompts for batch_size=2"):
        eng.start([[1], [2], [3]], GenerateOptions(), batch_size=2)
    assert eng.compile_count == 0


def test_generate_tokenizes_each_prompt_once(tiny_model):
    """`Engine.generate` tokenizes (and checks) every prompt once up front, and hands the token ids to
    its batches, which do not tokenize again."""

    class CountingTokenizer:
        stop_ids = ()

        def __init__(self):
            self.calls = 0

        def encode(self, text, add_bos=True):
            self.calls += 1
            return [1 + ord(c) % 50 for c in text]

        def decode(self, ids, skip_special=False):
            return " ".join(map(str, ids))

    tok = CountingTokenizer()
    eng = Engine(tiny_model, tok)
    out = eng.generate(["abc", "de", "fgh"], batch_size=2, max_new_tokens=2)
    assert tok.calls == 3 and len(out) == 3
    ref = Engine(tiny_model).generate([[1 + ord(c) % 50 for c in p] for p in ("abc", "de", "fgh")], batch_size=2,
                                      max_new_tokens=2)
    assert [r.tokens for r in out] == [r.tokens for r in ref]


def test_generate_builds_the_proposer_once(tiny_model, monkeypatch):
    """One `Engine.generate` call builds its proposer once (validation included), however many
    batches it runs."""
    from specjax.methods import registry

    calls = []
    build = registry.build
    monkeypatch.setattr(registry, "build", lambda spec, assets: calls.append(spec) or build(spec, assets))
    out = Engine(tiny_model).generate([[1, 2, 3], [4, 5], [6, 7, 8]], batch_size=2, max_new_tokens=2,
                                      spec=SpecConfig(method="ngram", k=2))
    assert len(out) == 3 and len(calls) == 1
