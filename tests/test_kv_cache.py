"""The cache with a kind per layer: sliding-window layers in a full buffer or a ring, across the window
boundary, for plain steps, chain and tree windows, batch > 1 and ragged rows; and the proof that a
speculative window straddling the ring's end stays exact (rejected tokens never corrupt a kept one).

The model is a tiny Gemma 3 (local, global, local layers; W = 4), so a few tokens cross the window.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax.models import config as model_config
from specjax.models import loader
from specjax.models.config import AttnKind

W = 4  # the sliding window
B, T = 2, 24
CONFIG = model_config.preset(
    "tiny", family="gemma3", num_layers=3, layer_kinds=("local", "global", "local"), sliding_window=W,
    rope_local_theta=100.0, qk_norm=True, norm_offset=1.0, mlp_activation="gelu_tanh", embed_scale=True,
    query_pre_attn_scalar=16.0)


def random_model(config, seed=0):
    """Random weights in numpy (no eager jax ops to compile); norm scales around 0 (Gemma's 1 + w)."""
    abstract = nnx.eval_shape(lambda: loader.init_model(config))
    rng = np.random.default_rng(seed)
    weights = {}
    for path, v in nnx.to_flat_state(nnx.state(abstract, nnx.Param)):
        name, shape = ".".join(map(str, path)), v.shape
        scale = (shape[-1] if name == "embed" else shape[0]) ** -0.5 if len(shape) == 2 else 0.3  # Gemma scales
        # its embedding by sqrt(D): rows of unit scale then, which leave the attention a say
        weights[name] = (rng.normal(size=shape) * scale).astype(np.float32)
    return loader.model_from_weights(config, weights)


@pytest.fixture(scope="module")
def model():
    return random_model(CONFIG)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _forward(graphdef, params, tokens, positions, cache, start=None, window_mask=None, kept=None):
    return nnx.merge(graphdef, params)(tokens, positions, cache, start=start, window_mask=window_mask, kept=kept)


class Runner:
    def __init__(self, model):
        self.model = model
        self.graphdef, self.params = nnx.split(model)

    def __call__(self, tokens, positions, cache, start=None, window_mask=None, kept=None):
        arr = lambda x: None if x is None else jnp.asarray(x, jnp.int32)  # noqa: E731
        return _forward(self.graphdef, self.params, arr(tokens), arr(positions), cache, arr(start),
                        window_mask, arr(kept))

    def full(self, tokens) -> np.ndarray:
        """Logits of whole sequences from position 0 (full buffers: the reference)."""
        b, t = np.shape(tokens)
        return np.asarray(self(tokens, np.broadcast_to(np.arange(t), (b, t)), self.model.init_cache(b, t)).logits)


@pytest.fixture(scope="module")
def runner(model):
    return Runner(model)


def _tokens(seed, shape):
    return np.random.default_rng(seed).integers(0, 64, size=shape, dtype=np.int32)


def assert_close(actual, desired, rel=2e-6):
    desired = np.asarray(desired)
    np.testing.assert_allclose(np.asarray(actual), desired, rtol=0, atol=rel * max(1.0, np.abs(desired).max()))


# ---- the layers and the cache they get --------------------------------------------------------


def test_the_window_changes_the_logits(runner):
    """The control the other tests lean on: with a window longer than the text, positions past W differ."""
    import dataclasses

    tokens = _tokens(0, (B, T))
    unwindowed = Runner(random_model(dataclasses.replace(CONFIG, sliding_window=T)))
    a, b = runner.full(tokens), unwindowed.full(tokens)
    assert_close(a[:, :W], b[:, :W])  # within the window the two models agree
    assert np.abs(a[:, W:] - b[:, W:]).max() > 1e-2


def test_init_cache_kinds_and_ring_length(model):
    full = model.init_cache(2, 64)
    assert full.ring is None and [k.shape[1] for k in full.k] == [64, 64, 64]
    ring = model.init_cache(2, 64, window=5)
    assert ring.ring == W - 1 + 5 and [k.shape[1] for k in ring.k] == [8, 64, 8]
    assert ring.nbytes < full.nbytes
    assert model.init_cache(2, 8, window=5).ring is None  # a ring no shorter than the cache: full buffers
    assert CONFIG.local_layers == (0, 2) and CONFIG.kind(1) == AttnKind.GLOBAL


def test_a_forward_wider_than_the_ring_was_built_for_is_refused(runner, model):
    cache = model.init_cache(1, 64, window=2)
    with pytest.raises(ValueError, match=r"init_cache\(\.\.\., window=3\)"):
        runner(_tokens(1, (1, 3)), [[0, 1, 2]], cache)


# ---- cached decode == full forward across the window ------------------------------------------


@pytest.mark.parametrize("layout", ["full", "ring"])
@pytest.mark.parametrize("step", [1, 3])
def test_cached_decode_matches_full_forward(runner, model, layout, step):
    """Ragged prompts (row 0 padded with garbage), then windows of `step` tokens through the cache
    past several window lengths and ring turns; every logit equals the full pass."""
    tokens = _tokens(2, (B, T))
    full = runner.full(tokens)
    starts = np.array([3, 7])
    prefill = tokens[:, :7].copy()
    prefill[0, 3:] = _tokens(3, (4,))  # padding past row 0's prompt
    cache = model.init_cache(B, T + step, window=step if layout == "ring" else None)
    assert (cache.ring is not None) == (layout == "ring")
    cache = runner(prefill, np.broadcast_to(np.arange(7), (B, 7)), cache, kept=starts).cache
    for offset in range(0, 15, step):
        idx = starts[:, None] + offset + np.arange(step)
        out = runner(np.take_along_axis(tokens, idx, 1), idx, cache)
        cache = out.cache
        for r in range(B):
            assert_close(out.logits[r], full[r, idx[r]])


PARENTS = (-1, 0, 0, 1, 2, 3)  # a root, two branches, depth 3 on the first
FULL = 64  # the reference forwards' length


def _tree(parents):
    n = len(parents)
    anc = np.zeros((n, n), bool)
    for i in range(n):
        j = i
        while j >= 0:
            anc[i, j] = True
            j = parents[j]
    return anc, anc.sum(1) - 1


# ---- speculative windows straddling the ring: rejected tokens never corrupt kept ones ----------


def _speculate(runner, model, cache, seq, rng, *, k, tree, steps):
    """Steps of verify -> accept a random path -> commit, as the decoder runs them, checking every
    window's logits against a full forward over each node's own chain. `seq`: per row, the committed
    tokens (the cache holds all but the last)."""
    anc, depth = _tree(PARENTS) if tree else (np.tril(np.ones((k + 1, k + 1), bool)), np.arange(k + 1))
    n = len(depth)
    for _ in range(steps):
        start = np.array([len(s) - 1 for s in seq])
        window = np.stack([[s[-1], *rng.integers(0, 64, n - 1)] for s in seq]).astype(np.int32)
        out = runner(window, start[:, None] + depth[None], cache, start=start,
                     window_mask=jnp.asarray(np.broadcast_to(anc, (B, n, n))))
        chains = [list(seq[r][:-1]) + list(window[r, np.nonzero(anc[i])[0]]) for r in range(B) for i in range(n)]
        full = runner.full(np.stack([c + [0] * (FULL - len(c)) for c in chains]))  # one shape: one compile
        for r in range(B):
            for i in range(n):
                assert_close(out.logits[r, i], full[r * n + i, len(chains[r * n + i]) - 1])
        # accept a random path per row (its depth varies, so the rows commit different counts)
        leaves = [int(rng.integers(0, n)) for _ in range(B)]
        paths = [list(np.nonzero(anc[leaf])[0]) for leaf in leaves]
        width = int(depth.max()) + 1
        path = jnp.asarray([p + [0] * (width - len(p)) for p in paths], jnp.int32)
        cache = out.cache.compact(jnp.asarray(start, jnp.int32), path) if tree else out.cache
        for r in range(B):
            seq[r] = list(seq[r]) + [int(window[r, i]) for i in paths[r][1:]] + [int(rng.integers(0, 64))]
    return seq


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_speculative_windows_straddling_the_ring_stay_exact(runner, model, tree):
    """The ring holds W - 1 + window entries, the fewest that work: windows of K + 1 drafts start at
    every offset of the ring, rows accept different depths, and what a row rejected lies in the
    ring until a kept token overwrites it. Every logit of every window equals a full forward."""
    k = 3
    width = len(PARENTS) if tree else k + 1
    rng = np.random.default_rng(4)
    prompts = [list(_tokens(5, (6,))), list(_tokens(6, (3,)))]
    cache = model.init_cache(B, 96, window=width)
    assert cache.ring == W - 1 + width
    p = max(map(len, prompts))
    padded = np.stack([pr + [0] * (p - len(pr)) for pr in prompts])
    cache = runner(padded, np.broadcast_to(np.arange(p), (B, p)), cache, kept=[len(x) - 1 for x in prompts]).cache
    seq = _speculate(runner, model, cache, prompts, rng, k=k, tree=tree, steps=12)
    assert min(map(len, seq)) > 3 * cache.ring  # the ring turned over several times


def test_a_ring_too_short_is_caught(runner, model):
    """Negative control: a ring two entries short (built for narrower forwards, the guard bypassed
    with `kept`) lets a rejected draft overwrite a position a later query needs, and the check fails."""
    k = 3
    rng = np.random.default_rng(4)
    prompts = [list(_tokens(5, (6,))), list(_tokens(6, (3,)))]
    cache = model.init_cache(B, 96, window=k - 1)
    p = max(map(len, prompts))
    padded = np.stack([pr + [0] * (p - len(pr)) for pr in prompts])
    cache = runner(padded, np.broadcast_to(np.arange(p), (B, p)), cache, kept=[len(x) - 1 for x in prompts]).cache

    class Bypass(Runner):
        def __call__(self, tokens, positions, cache, start=None, window_mask=None, kept=None):
            if kept is None and cache.ring is not None:
                kept = np.full(len(tokens), np.shape(tokens)[1])
            return super().__call__(tokens, positions, cache, start, window_mask, kept)

    with pytest.raises(AssertionError):
        _speculate(Bypass(model), model, cache, prompts, rng, k=k, tree=False, steps=12)
