"""Speculative loop: greedy output equals the plain loop token for token, whatever the proposer.

One Engine serves the whole module, so each (proposer, K, batch, sampling method) compiles once.
"""

import dataclasses
import math
import traceback

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax.core.decoder import verify
from specjax.methods.config import SpecConfig
from specjax.serving.engine import Engine, GenerateOptions
from specjax.models import config as model_config
from specjax.models import loader
from specjax.models.kv_cache import KVCache
from specjax.methods import DraftModelProposer, NgramProposer
from specjax.methods.ngram import proposer as ngram
from specjax.core.proposer import Stateless
from specjax.core.sampling import Greedy, Sample, SamplingParams
from specjax.core.state import DecodeState, Shared
from specjax.core.tree import chain_topology
from specjax.methods.draft.record import DraftModel

PROMPTS = [
    [5, 9, 12, 5, 9, 12, 5, 9],  # repeats: prompt lookup finds matches
    list(range(1, 31)),  # 30 tokens, near the end of the 32 bucket (cache-full test)
    [40, 41, 42, 43, 40, 41],
]
REF_NEW = 32  # the plain reference is this long; runs up to 32 new tokens share its cache size
M = 17
# per K, a budget with (M - 1) % (K + 1) == 0, so a proposer that is always right gives tau == K + 1
ALIGNED = {1: 17, 2: 19, 4: 21, 8: 19}


@pytest.fixture(scope="module")
def draft_model():
    """An untrained draft with the target's shapes (so swapping its weights reuses programs)."""
    return loader.init_model(model_config.preset("tiny"), seed=1)


@pytest.fixture(scope="module")
def eng(tiny_model, draft_model):
    return Engine(tiny_model, assets={"draft": DraftModel(draft_model)})


@pytest.fixture(scope="module")
def ref(eng):
    """Plain greedy continuations of PROMPTS (the oracle every speculative run must equal)."""
    return [r.tokens for r in eng.generate(PROMPTS, max_new_tokens=REF_NEW)]


@dataclasses.dataclass(frozen=True, kw_only=True)
class TableProposer(Stateless):
    """Drafts from a precomputed greedy continuation: row b's first `right[b]` drafts are the true
    greedy tokens, the rest are `(true + 1) % vocab`, so row b accepts exactly `right[b]` per step."""

    k: int
    vocab: int

    def propose(self, params, pstate, state, sampling_config, keys):
        table, right = params  # [B, L] prompt + greedy continuation, [B]
        j = jnp.arange(self.k)[None, :]
        cols = jnp.minimum(state.lengths[:, None] + j, table.shape[1] - 1)
        true = jnp.take_along_axis(table, cols, axis=1)
        return jnp.where(j < right[:, None], true, (true + 1) % self.vocab), None, pstate


def _table(ref):
    table = np.zeros((len(PROMPTS), 32 + REF_NEW + 16), np.int32)
    for r, (p, t) in enumerate(zip(PROMPTS, ref)):
        table[r, : len(p) + len(t)] = p + t
    return jnp.asarray(table)


def _use_table(monkeypatch, eng, ref, right):
    """Routes every speculative spec of `eng` to a TableProposer with per-row `right` counts."""
    params = (_table(ref), jnp.asarray(right, jnp.int32))
    vocab = eng.config.vocab_size
    monkeypatch.setattr(eng, "proposer", lambda spec: (TableProposer(k=spec.k, vocab=vocab), params))


def _check_telemetry(results, k):
    for r in results:
        c = r.counters
        assert r.k == k and len(c.accepted_tokens_per_pos) == k and len(c.accept_hist) == k + 1
        assert c.num_accepted_tokens == sum(c.accepted_tokens_per_pos)
        assert c.num_accepted_tokens == sum(n * h for n, h in enumerate(c.accept_hist))
        assert c.num_draft_tokens == k * r.target_forwards
        assert sum(c.accept_hist) == c.num_drafts == r.target_forwards
        assert r.tau == pytest.approx((r.new_tokens - 1) / r.target_forwards)
        # each forward commits its accepted drafts plus one token, minus what a stop or the budget cut
        assert r.new_tokens - 1 <= c.num_accepted_tokens + r.target_forwards
        # accepted_tokens_per_pos is non-increasing: position j is kept only if j-1 was
        assert all(a >= b for a, b in zip(c.accepted_tokens_per_pos, c.accepted_tokens_per_pos[1:]))


# ---- greedy identity ---------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_prompt_lookup_equals_plain(eng, ref, k):
    res = eng.generate(PROMPTS, max_new_tokens=M, spec=SpecConfig(method="ngram", k=k))
    for r, want in zip(res, ref):
        assert r.tokens == want[:M]
        assert r.stop_reason == "max_new_tokens"
    _check_telemetry(res, k)
    assert sum(r.counters.num_accepted_tokens for r in res) > 0  # the lookup did get drafts accepted


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_random_draft_model_equals_plain(eng, ref, k):
    res = eng.generate(PROMPTS, max_new_tokens=M, spec=SpecConfig(method="draft", k=k))
    assert [r.tokens for r in res] == [t[:M] for t in ref]
    _check_telemetry(res, k)
    assert sum(r.counters.num_accepted_tokens for r in res) > 0  # the draft does get drafts accepted


def test_draft_equal_to_target_accepts_everything(eng, ref, tiny_model, monkeypatch):
    """The draft's own cache stays in step with the commits: a draft identical to the target is
    always right, so every step accepts all K (a cache position off by one would break this)."""
    monkeypatch.setitem(eng.assets.methods, "draft", DraftModel(tiny_model))
    k, m = 4, ALIGNED[4]
    res = eng.generate(PROMPTS, max_new_tokens=m, spec=SpecConfig(method="draft", k=k))
    for r, want in zip(res, ref):
        assert r.tokens == want[:m]
        assert r.counters.accept_hist == [0] * k + [(m - 1) // (k + 1)]
        assert r.tau == k + 1
    _check_telemetry(res, k)


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_oracle_and_wrong_proposers(eng, ref, k, monkeypatch):
    m = ALIGNED[k]
    spec = SpecConfig(method="ngram", k=k)  # any method but "none"; the proposer is replaced

    _use_table(monkeypatch, eng, ref, [k] * 3)  # always right
    res = eng.generate(PROMPTS, max_new_tokens=m, spec=spec)
    for r, want in zip(res, ref):
        assert r.tokens == want[:m]
        assert r.target_forwards == (m - 1) // (k + 1)
        assert r.tau == k + 1 and r.counters.num_accepted_tokens == r.counters.num_draft_tokens
    _check_telemetry(res, k)

    _use_table(monkeypatch, eng, ref, [0] * 3)  # always wrong
    res = eng.generate(PROMPTS, max_new_tokens=m, spec=spec)
    for r, want in zip(res, ref):
        assert r.tokens == want[:m]
        assert r.tau == 1 and r.counters.num_accepted_tokens == 0 and r.target_forwards == m - 1
    _check_telemetry(res, k)

    right = [0, 1, k]  # rows accept different counts in one batch
    _use_table(monkeypatch, eng, ref, right)
    res = eng.generate(PROMPTS, max_new_tokens=m, spec=spec)
    for r, want, n in zip(res, ref, right):
        assert r.tokens == want[:m]
        fwd = math.ceil((m - 1) / (n + 1))
        assert r.target_forwards == fwd
        assert r.counters.accept_hist == [fwd if i == n else 0 for i in range(k + 1)]
        assert r.counters.accepted_tokens_per_pos == [fwd if j < n else 0 for j in range(k)]
    _check_telemetry(res, k)
    if k > 1:
        assert len({r.tau for r in res}) == 3


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_max_new_tokens_never_exceeded(eng, ref, k, monkeypatch):
    """An always-right proposer overshoots the budget in its last window; commit cuts it exactly."""
    _use_table(monkeypatch, eng, ref, [k] * 3)
    for m in sorted({ALIGNED[k] + 1, ALIGNED[k] + k, 30}):
        res = eng.generate(PROMPTS, max_new_tokens=m, spec=SpecConfig(method="ngram", k=k))
        for r, want in zip(res, ref):
            assert r.tokens == want[:m] and r.new_tokens == m and r.stop_reason == "max_new_tokens"
            assert r.target_forwards == math.ceil((m - 1) / (k + 1))
        _check_telemetry(res, k)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_batch_of_one(eng, ref, method):
    for i in (0, 2):
        (r,) = eng.generate([PROMPTS[i]], max_new_tokens=M, spec=SpecConfig(method=method, k=4))
        assert r.tokens == ref[i][:M]
        _check_telemetry([r], 4)


def test_temperature_zero_rows_of_a_sampled_program_are_greedy(eng, ref):
    """The lossless rule at temperature 0 (p one-hot) is greedy acceptance."""
    spec = SpecConfig(method="ngram", k=4)
    batch = eng.start(PROMPTS, GenerateOptions(max_new_tokens=M), spec=spec,
                      sampling_config=Sample())
    assert [r.tokens for r in batch.run()] == [t[:M] for t in ref]


# ---- stopping ----------------------------------------------------------------------------------


def _stop_inside_window(tokens, k):
    """A token whose first occurrence is inside (not last in) an always-right window of K + 1."""
    for i in range(1, len(tokens)):
        if tokens[i] not in tokens[:i] and (i - 1) % (k + 1) < k:
            return i, tokens[i]
    pytest.fail(f"no usable stop token in {tokens}")


@pytest.mark.parametrize("proposer", ["oracle", "ngram"])
def test_stop_token_inside_an_accepted_window(eng, ref, proposer, monkeypatch):
    k, m = 4, ALIGNED[4]
    i, stop = _stop_inside_window(ref[0][:m], k)
    plain = eng.generate(PROMPTS, max_new_tokens=m, stop_ids=(stop,))
    assert plain[0].tokens == ref[0][: i + 1]
    if proposer == "oracle":
        _use_table(monkeypatch, eng, ref, [k] * 3)
    res = eng.generate(PROMPTS, max_new_tokens=m, spec=SpecConfig(method="ngram", k=k), stop_ids=(stop,))
    assert [r.tokens for r in res] == [r.tokens for r in plain]
    assert [r.stop_reason for r in res] == [r.stop_reason for r in plain]
    assert res[0].stop_reason == "stop_token" and res[0].tokens[-1] == stop
    if proposer == "oracle":  # the stop came in a window whose later accepted drafts were dropped
        assert res[0].counters.num_accepted_tokens == k * res[0].target_forwards
        assert res[0].new_tokens < 1 + (k + 1) * res[0].target_forwards
    _check_telemetry(res, k)


def test_cache_full_stops_the_row(eng, ref):
    """`Engine.start` sizes the cache so it never fills; a hand-built Batch with a small cache does.

    Row 1 (30 prompt tokens) runs out of room for another K+1 window long before its budget.
    """
    k, capacity = 4, 40
    spec = SpecConfig(method="ngram", k=k)
    batch = eng.start(PROMPTS, GenerateOptions(max_new_tokens=M), spec=spec, cache_length=capacity)
    res = batch.run()
    full = res[1]
    assert full.stop_reason == "cache_full"
    assert full.tokens == ref[1][: full.new_tokens]
    length = len(PROMPTS[1]) + full.new_tokens
    assert length <= capacity < length + k + 1
    for r in (0, 2):
        assert res[r].tokens == ref[r][:M] and res[r].stop_reason == "max_new_tokens"
    _check_telemetry(res, k)


def _state(lengths, *, capacity, max_new=100, stop=()):
    b = len(lengths)
    stop_ids = np.full((b, 8), -1, np.int32)
    stop_ids[:, : len(stop)] = stop
    return DecodeState(
        tokens=jnp.zeros((b, capacity), jnp.int32), lengths=jnp.asarray(lengths, jnp.int32),
        prompt_lengths=jnp.full((b,), 2, jnp.int32), max_new=jnp.full((b,), max_new, jnp.int32),
        done=jnp.zeros((b,), bool), cache=KVCache(k=(), v=(), length=0), sampling=SamplingParams.create(b),
        stop_ids=jnp.asarray(stop_ids), keys=jax.random.split(jax.random.key(0), b),
        row_forwards=jnp.zeros((b,), jnp.int32), shared=Shared(forwards=jnp.zeros((), jnp.int32)))


# ---- prompt lookup -----------------------------------------------------------------------------


def _buffer(rows, width=16, junk=5):
    tokens = np.full((len(rows), width), junk, np.int32)
    for r, t in enumerate(rows):
        tokens[r, : len(t)] = t
    return jnp.asarray(tokens), jnp.asarray([len(t) for t in rows], jnp.int32)


def _lookup(proposer, tokens, lengths):
    return jax.jit(proposer.lookup)(tokens, lengths)  # one compile instead of many eager ops


def test_ngram_lookup():
    tokens, lengths = _buffer([
        [1, 2, 3, 9, 1, 2, 4, 7, 1, 2],  # [1, 2] at 0 and 4: the most recent one wins
        [5, 1, 2, 3, 8, 2, 3, 6, 1, 2, 3],  # [1, 2, 3] beats the more recent [2, 3] and [3]
        [1, 2, 3, 4],  # no match: the last token, K times
        [7, 8, 9, 5],  # 5 follows only in the junk past the length, which is never read
        [3, 9, 8, 3],  # only a 1-gram match
    ])
    draft = _lookup(NgramProposer(k=3, min_n=1, max_n=3), tokens, lengths)
    assert draft.shape == (5, 3)
    assert draft.tolist() == [[4, 7, 1], [8, 2, 3], [4, 4, 4], [5, 5, 5], [9, 8, 3]]
    assert _lookup(NgramProposer(k=3, min_n=1, max_n=1), tokens, lengths)[1].tolist() == [6, 1, 2]
    assert _lookup(NgramProposer(k=3, min_n=2, max_n=3), tokens, lengths)[4].tolist() == [3, 3, 3]
    state = _state([10, 11], capacity=16).replace(tokens=tokens[:2])
    propose = jax.jit(lambda s: NgramProposer(k=3).propose(None, None, s, Greedy(), None))
    out, q, pstate = propose(state)
    assert out.tolist() == draft[:2].tolist() and q is None and pstate is None


def test_ngram_lookup_past_the_end_of_a_match():
    """A match near the end has fewer than K followers; the proposal keeps its fixed shape."""
    tokens, lengths = _buffer([[4, 6, 4]])
    draft = _lookup(NgramProposer(k=4, min_n=1, max_n=2), tokens, lengths)
    assert draft.shape == (1, 4) and draft[0, :2].tolist() == [6, 4]


# ---- compile cache and bad input -----------------------------------------------------------------


def test_compile_once_per_bucket(tiny_model):
    eng = Engine(tiny_model)
    spec = SpecConfig(method="ngram", k=4)
    eng.generate(PROMPTS, max_new_tokens=M, spec=spec)
    assert eng.compile_count == 2  # prefill and loop
    other = [[3, 1, 3], list(range(20, 51)), [7] * 12]  # other lengths, same 32 bucket
    eng.generate(other, max_new_tokens=M + 5, spec=spec)
    assert eng.compile_count == 2
    eng.generate(PROMPTS, max_new_tokens=M, spec=spec, temperature=0.7, seed=1)
    assert eng.compile_count == 4  # the sampled prefill and loop
    eng.generate(other, max_new_tokens=M + 2, spec=spec, temperature=(1.3, 0.5, 0.9), top_k=(5, 0, 2),
                 top_p=0.9, seed=2)  # per-row values
    assert eng.compile_count == 4


def test_bad_input_fails_before_compiling(tiny_model, eng):
    bare = Engine(tiny_model)
    with pytest.raises(ValueError, match="needs a draft model"):
        bare.generate(PROMPTS, max_new_tokens=4, spec=SpecConfig(method="draft"))
    assert bare.compile_count == 0
    before = eng.compile_count
    with pytest.raises(ValueError, match="max_new_tokens"):
        eng.generate(PROMPTS, max_new_tokens=0, spec=SpecConfig(method="draft"))
    with pytest.raises(ValueError, match="top_p"):
        eng.generate(PROMPTS, max_new_tokens=4, spec=SpecConfig(method="ngram"), temperature=1.0, top_p=0)
    with pytest.raises(ValueError, match="outside"):
        eng.generate([[1, 64]], max_new_tokens=4, spec=SpecConfig(method="ngram", k=3))
    assert eng.compile_count == before


def test_draft_vocabulary_must_match(tiny_model):
    e = Engine(tiny_model)
    with pytest.raises(ValueError, match="vocabulary"):
        e.set_asset("draft", DraftModel(loader.init_model(model_config.preset("tiny", vocab_size=32), seed=2)))
    assert e.asset("draft") is None
    with pytest.raises(ValueError, match="vocabulary"):
        Engine(tiny_model, assets={"draft": DraftModel(loader.init_model(model_config.preset("tiny", vocab_size=80), seed=2))})


def test_draft_larger_than_target_warns(tiny_model):
    big = loader.init_model(model_config.preset("tiny", num_layers=4), seed=2)
    with pytest.warns(UserWarning, match="larger than its target"):
        Engine(tiny_model, assets={"draft": DraftModel(big)})


# ---- the library under the project's strict numpy settings ---------------------------------------


def test_ngram_lookup_under_strict_rank_promotion():
    tokens, lengths = _buffer([[1, 2, 1]])
    with jax.numpy_rank_promotion("raise"):
        NgramProposer(k=2).lookup(tokens, lengths)


def test_verify_positions_under_strict_rank_promotion(tiny_model):
    state = _state([3], capacity=8).replace(cache=tiny_model.init_cache(1, 8))
    with jax.numpy_rank_promotion("raise"):
        try:
            verify(tiny_model, state, jnp.zeros((1, 2), jnp.int32), chain_topology(2))
        except ValueError as e:  # count only the verify line itself, not the model's own bug
            ours = [f for f in traceback.extract_tb(e.__traceback__) if "site-packages" not in f.filename]
            assert ours[-1].name == "verify", f"failed at {ours[-1].filename}:{ours[-1].lineno}"
            raise


def test_draft_propose_under_strict_rank_promotion(tiny_model):
    graphdef, params = nnx.split(tiny_model)
    state = _state([3], capacity=8)
    with jax.numpy_rank_promotion("raise"):
        try:
            DraftModelProposer(k=2, graphdef=graphdef).propose(
                params, tiny_model.init_cache(1, 8), state, Greedy(), state.keys)
        except ValueError as e:  # count only the proposer's own line, not the model's bug
            ours = [f for f in traceback.extract_tb(e.__traceback__) if "site-packages" not in f.filename]
            assert ours[-1].name == "propose", f"failed at {ours[-1].filename}:{ours[-1].lineno}"
            raise


# ---- the real model ----------------------------------------------------------------------------


@pytest.mark.oracle
def test_real_model_prompt_lookup_equals_plain(smollm2):
    eng = Engine(smollm2.model, smollm2.tokenizer, buckets=(64,))
    prompts = ["Repeat exactly: the quick brown fox jumps over the lazy dog, the quick brown fox.",
               "Count from 1 to 20, separated by commas."]
    plain = eng.generate(prompts, chat=True, max_new_tokens=32)
    spec = eng.generate(prompts, chat=True, max_new_tokens=32, spec=SpecConfig(method="ngram", k=4))
    assert [r.tokens for r in spec] == [r.tokens for r in plain]
    _check_telemetry(spec, 4)
    assert sum(r.counters.num_accepted_tokens for r in spec) > 0


# ---- prompt lookup replayed on the host (the adaptive controller's free evidence) ------------------


@pytest.mark.parametrize("min_n, max_n", [(1, 3), (2, 2), (1, 1)])
def test_host_lookup_equals_device_lookup(min_n, max_n):
    rng = np.random.default_rng(min_n * 10 + max_n)
    rows = [rng.integers(0, v, size=n).tolist() for v in (3, 5, 40) for n in (1, 2, 3, 7, 20, 31)]
    tokens, lengths = _buffer(rows, width=32)
    want = _lookup(NgramProposer(k=5, min_n=min_n, max_n=max_n), tokens, lengths).tolist()
    for row, w in zip(rows, want):
        grown = ngram.HostLookup(row[:1], k=5, min_n=min_n, max_n=max_n)  # as the scheduler grows it
        grown.extend(row[1:])
        assert grown.propose() == w == ngram.HostLookup(row, k=5, min_n=min_n, max_n=max_n).propose(), row


def test_replay_counts_what_prompt_lookup_keeps(eng):
    """Greedy: replaying prompt lookup over the committed text gives the real run's counters, but for
    the last step (cut short by max_new_tokens); replayed in pieces, as chunks cut it, the same."""
    k, m = 4, 31
    res = eng.generate(PROMPTS, max_new_tokens=m, spec=SpecConfig(method="ngram", k=k))
    total = 0
    for prompt, r in zip(PROMPTS, res):
        text = prompt + r.tokens
        kept, steps = ngram.replay(ngram.HostLookup(text[:len(prompt) + 1], k=k), text)
        real, real_steps = r.counters.accepted_tokens_per_pos, r.target_forwards
        gap = [a - b for a, b in zip(real, kept)]
        if steps == real_steps:
            assert gap == [0] * k
        else:  # one step more in the real run: its kept drafts
            assert steps == real_steps - 1 and set(gap) <= {0, 1} and gap == sorted(gap, reverse=True)
        lookup, pieces = ngram.HostLookup(text[:len(prompt) + 1], k=k), []
        for end in range(len(prompt) + 3, len(text) + 1, 5):
            pieces.append(ngram.replay(lookup, text[:end]))
        pieces.append(ngram.replay(lookup, text))
        assert [sum(p[0][j] for p in pieces) for j in range(k)] == kept
        assert sum(p[1] for p in pieces) == steps
        total += sum(kept)
    assert total > 0  # the replay did find drafts that would be kept
