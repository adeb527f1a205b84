"""Acceptance rules on hand-made logits: greedy prefix matching and lossless speculative sampling."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from specjax.core import acceptance
from specjax.core import sampling
from specjax.core.sampling import Greedy, Sample, SamplingParams
from specjax.core import tree as tree_lib
from specjax.core.tree import chain_topology

N = 20_000  # rows (independent keys) for the distribution checks
V = 6  # one vocabulary and few window sizes, so the jitted rule compiles a handful of times
ALPHA = 1e-3  # chi-square p-value threshold; the seeds are fixed, so the tests are deterministic
ZERO = -1e4  # a logit whose softmax weight is exactly 0 in float32


speculative = jax.jit(acceptance.speculative)


def _accept(config, keys, draft, q, logits, params):
    """The Decoder's default sampled chain rule (Leviathan's), as (n, next)."""
    acc = acceptance.Speculative().accept(acceptance.Window(
        sampling=config, keys=keys, nodes=draft, q=q, logits=logits, params=params,
        topo=chain_topology(draft.shape[1])))
    return acc.n, acc.next


accept = jax.jit(_accept, static_argnums=0)
probs = jax.jit(sampling.probs)


@jax.jit
def _draw(keys, q):
    """One token per [row, slot] from q [B, K, V], with its own key per row."""
    split = jax.vmap(lambda key: jax.random.split(key, q.shape[1]))(keys)
    return jax.vmap(jax.vmap(jax.random.categorical))(split, jnp.log(q)).astype(jnp.int32)


def _keys(n, seed=0):
    return jax.random.split(jax.random.key(seed), n)


def _logits(p):
    """Logits whose softmax (temperature 1) is the distribution `p`; zero-probability tokens stay 0."""
    p = np.asarray(p, np.float64)
    return jnp.asarray(np.where(p > 0, np.log(np.maximum(p, 1e-300)), ZERO), jnp.float32)


def _tile(x, n):
    x = jnp.asarray(x)
    return jnp.broadcast_to(x, (n,) + x.shape)


def chi_square_p(samples, probs):
    """p-value of `samples` (token ids) against `probs`; bins with expected count < 5 are merged.

    Tokens of probability 0 must never be drawn: that is asserted, not tested statistically.
    """
    probs = np.asarray(probs, np.float64)
    probs = probs / probs.sum()
    counts = np.bincount(np.asarray(samples).ravel(), minlength=len(probs)).astype(np.float64)
    drawn_impossible = np.flatnonzero(counts * (probs == 0))
    assert drawn_impossible.size == 0, f"drew tokens of probability 0: {drawn_impossible}"
    n = counts.sum()
    expected = probs * n
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    return stats.chisquare(obs[keep], exp[keep]).pvalue


# ---- greedy ------------------------------------------------------------------------------------


def test_greedy_all_first_and_middle_rejection():
    rng = np.random.default_rng(0)
    target = np.array([3, 1, 4, 1, 5])  # argmax at window positions 0..K
    logits = rng.normal(size=(3, 5, 8)).astype(np.float32)
    logits[:, np.arange(5), target] = 10.0
    draft = jnp.asarray([[3, 1, 4, 1],  # all four match: bonus = argmax at position K
                         [2, 1, 4, 1],  # first rejected: correction = argmax at 0
                         [3, 1, 0, 1]], jnp.int32)  # third rejected; the later match does not count
    n, nxt = acceptance.greedy(draft, jnp.asarray(logits))
    assert n.tolist() == [4, 0, 2]
    assert nxt.tolist() == [5, 3, 4]
    n2, nxt2 = accept(Greedy(), _keys(3), draft, None, jnp.asarray(logits),
                                 SamplingParams.create(3, 1.0))
    assert n2.tolist() == n.tolist() and nxt2.tolist() == nxt.tolist()  # greedy config ignores temperature


# ---- speculative sampling ------------------------------------------------------------------------


def test_one_hot_p_equal_to_draft_accepts_all():
    draft = jnp.asarray([2, 0, 5], jnp.int32)
    bonus = 4
    p = np.zeros((4, V))
    p[np.arange(3), draft] = 1.0
    p[3, bonus] = 1.0
    n, nxt = speculative(_keys(N), _tile(draft, N), None, _tile(_logits(p), N), SamplingParams.create(N, 1.0))
    assert (n == 3).all() and (nxt == bonus).all()


def test_forced_rejection_samples_the_residual():
    """p(x) = 0 at the draft, so every row rejects it and draws from norm(max(0, p - q))."""
    p = np.array([0.1, 0.4, 0.2, 0.3, 0.0, 0.0])
    q = np.array([0.3, 0.1, 0.2, 0.1, 0.1, 0.2])
    residual = np.maximum(p - q, 0) / np.maximum(p - q, 0).sum()  # [0, .6, 0, .4, 0, 0]
    logits = _tile(_logits(np.stack([p, p])), N)  # K = 1: the draft, then the bonus slot
    qs = _tile(jnp.asarray(q[None], jnp.float32), N)
    n, nxt = speculative(_keys(N), jnp.full((N, 1), 5, jnp.int32), qs, logits, SamplingParams.create(N, 1.0))
    assert (n == 0).all()
    np.testing.assert_allclose(residual.sum(), 1.0)
    assert chi_square_p(nxt, residual) > ALPHA
    assert chi_square_p(nxt, p) < 1e-6  # power: the statistic tells the residual from p itself


def test_emitted_token_is_distributed_as_p_for_any_q():
    """Draft x ~ q, accept with min(1, p/q), else residual: the emitted token is distributed as p."""
    p = np.array([0.1, 0.4, 0.2, 0.2, 0.05, 0.05])
    q = np.array([0.3, 0.1, 0.2, 0.1, 0.1, 0.2])
    qs = _tile(jnp.asarray(q[None], jnp.float32), N)
    draft = _draw(_keys(N, seed=1), qs)
    n, nxt = speculative(_keys(N, seed=2), draft, qs, _tile(_logits(np.stack([p, p])), N),
                         SamplingParams.create(N, 1.0))
    first = jnp.where(n == 1, draft[:, 0], nxt)
    assert chi_square_p(first, p) > ALPHA
    assert chi_square_p(first, q) < 1e-6  # power: sampling from q is told apart
    # the acceptance rate is sum_x min(p(x), q(x))
    np.testing.assert_allclose(float(n.mean()), np.minimum(p, q).sum(), atol=0.015)


def test_p_equal_q_accepts_everything_and_bonus_is_p():
    k = 3
    logits = jax.random.normal(jax.random.key(3), (k + 1, V)) * 2
    params = SamplingParams.create(N, 0.8, top_k=4)
    full = _tile(logits, N)
    q = probs(full, params)[:, :k]  # exactly the library's p at the draft slots
    n, nxt = speculative(_keys(N, 5), _draw(_keys(N, 4), q), q, full, params)
    assert (n == k).all()
    bonus_p = np.asarray(probs(full[:1], SamplingParams.create(1, 0.8, top_k=4)))[0, k]
    assert (bonus_p > 0).sum() == 4
    assert chi_square_p(nxt, bonus_p) > ALPHA


@pytest.mark.parametrize("with_q", [False, True])
def test_temperature_zero_rows_in_a_sampled_batch_are_greedy(with_q):
    k, reps = 3, N // 4
    logits = jax.random.normal(jax.random.key(6), (4, k + 1, V))
    target = np.array(jnp.argmax(logits, -1))
    draft = np.array(jax.random.randint(jax.random.key(7), (4, k), 0, V))
    draft[0] = target[0, :k]  # greedy row, all match
    draft[2] = target[2, :k]
    draft[2, 1] = (target[2, 1] + 1) % V  # greedy row, second draft wrong
    temperature = np.array([0.0, 1.0, 0.0, 1.0], np.float32)
    params = SamplingParams(temperature=jnp.asarray(np.tile(temperature, reps)),
                            top_k=jnp.zeros((N,), jnp.int32), top_p=jnp.ones((N,)))
    q = None
    if with_q:  # what a draft model gives: one-hot at temperature 0, a distribution otherwise
        soft = jax.nn.softmax(jax.random.normal(jax.random.key(8), (4, k, V)), -1)
        q = jnp.where(temperature[:, None, None] > 0, soft, jax.nn.one_hot(draft, V))
        q = jnp.tile(q, (reps, 1, 1))
    n, nxt = accept(Sample(), _keys(N, 9), jnp.tile(jnp.asarray(draft), (reps, 1)), q,
                    jnp.tile(logits, (reps, 1, 1)), params)
    n, nxt = np.asarray(n).reshape(reps, 4), np.asarray(nxt).reshape(reps, 4)
    assert (n[:, 0] == k).all() and (nxt[:, 0] == target[0, k]).all()
    assert (n[:, 2] == 1).all() and (nxt[:, 2] == target[2, 1]).all()
    assert len(set(nxt[:, 1].tolist())) > 1  # the sampled rows do sample


def test_top_k_applies_to_p():
    """top-k 2: a draft outside the top 2 is always rejected and the correction stays in the top 2."""
    p = np.array([0.35, 0.25, 0.2, 0.1, 0.1, 0.0])
    n, nxt = speculative(_keys(N, 10), jnp.full((N, 1), 2, jnp.int32), None,
                         _tile(_logits(np.stack([p, p])), N), SamplingParams.create(N, 1.0, top_k=2))
    assert (n == 0).all()
    assert chi_square_p(nxt, np.array([0.35, 0.25, 0, 0, 0, 0])) > ALPHA


def test_top_p_applies_to_p():
    """top-p 0.65 keeps {0, 1}: the emitted token, the correction and the bonus stay in the nucleus."""
    p = np.array([0.4, 0.3, 0.15, 0.1, 0.05, 0.0])
    nucleus = np.array([0.4, 0.3, 0, 0, 0, 0]) / 0.7
    n, nxt = speculative(_keys(N, 11), jnp.zeros((N, 1), jnp.int32), None,
                         _tile(_logits(np.stack([p, p])), N), SamplingParams.create(N, 1.0, top_p=0.65))
    n, nxt = np.asarray(n), np.asarray(nxt)
    first = np.where(n == 1, 0, nxt)
    assert chi_square_p(first, nucleus) > ALPHA  # P(accept draft 0) = p'(0) = 4/7
    assert (nxt[n == 0] == 1).all()  # the residual of a one-hot q at 0 is the rest of the nucleus
    assert chi_square_p(nxt[n == 1], nucleus) > ALPHA  # the bonus is drawn from the filtered p


def test_speculative_under_strict_rank_promotion():
    with jax.numpy_rank_promotion("raise"):
        speculative(_keys(2), jnp.zeros((2, 1), jnp.int32), None, jnp.zeros((2, 2, 4)),
                               SamplingParams.create(2, 1.0))


# ---- the interface the Decoder's verify step calls -----------------------------------------------


def test_library_rules_satisfy_the_interface_and_check_the_window_shape():
    tree_topo = tree_lib.topology(((0,), (1,), (0, 0)))
    for rule in (acceptance.Greedy(), acceptance.SpecInfer(), acceptance.Speculative(),
                 acceptance.TypicalAcceptance()):
        assert isinstance(rule, acceptance.AcceptanceRule), rule
        rule.check(chain_topology(3))  # every rule verifies a chain
    for rule in (acceptance.Greedy(), acceptance.SpecInfer(), acceptance.TypicalAcceptance()):
        rule.check(tree_topo)
    with pytest.raises(ValueError, match="chains only.*SpecInfer"):
        acceptance.Speculative().check(tree_topo)


def test_the_decoder_refuses_a_rule_for_the_wrong_shape_or_a_non_rule():
    from specjax.core.decoder import Decoder
    from specjax.methods.ngram.proposer import NgramProposer

    class TreeLookup(NgramProposer):  # the prompt-lookup proposer laid out on a two-branch tree
        @property
        def topology(self):
            return tree_lib.topology(((0,), (1,)))

    chain = NgramProposer(k=2)
    assert isinstance(Decoder(proposer=chain, acceptance=acceptance.Speculative(), sampling="sample",
                              cache_length=32).acceptance, acceptance.Speculative)
    with pytest.raises(ValueError, match="chains only"):
        Decoder(proposer=TreeLookup(k=1), acceptance=acceptance.Speculative(), sampling="sample",
                cache_length=32)
    with pytest.raises(TypeError, match="not an acceptance rule"):
        Decoder(proposer=chain, acceptance="speculative", cache_length=32)


def test_argmax_is_jnp_argmax_bit_for_bit():
    """`sampling.argmax` (two vectorised reductions) equals `jnp.argmax` on ties, NaN, -inf and masked
    rows, over any leading dims; and it is what greedy decoding and verification take."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 4, 97)).astype(np.float32)
    x[0, 0, [5, 40]] = 9.0  # a tie: the first index
    x[0, 1, 17] = np.nan  # a NaN: jnp.argmax returns its index
    x[0, 2, [3, 60]] = np.nan
    x[1, 0, :] = -np.inf  # a fully masked row: 0
    x[1, 1, :] = 1.0  # all equal: 0
    x[1, 2, :-1] = -np.inf  # one survivor: the last index
    got = np.asarray(sampling.argmax(jnp.asarray(x)))
    want = np.asarray(jnp.argmax(jnp.asarray(x), axis=-1))
    np.testing.assert_array_equal(got, want)
    assert got.dtype == np.int32 and got[0, 0] == 5 and got[0, 1] == 17 and got[0, 2] == 3 and got[1, 2] == 96
    np.testing.assert_array_equal(np.asarray(Greedy().draw(None, jnp.asarray(x[0]))), want[0])
