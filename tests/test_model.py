"""Llama model: cached decode == full forward, causality, row independence, tree masks, config."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax.models import config as model_config
from specjax.models import families, kv_cache, loader
from specjax.models.config import AttnKind, ModelConfig


@pytest.mark.parametrize("variant", ["plain", "qkv_bias+untied"])
def test_forward_under_strict_rank_promotion(runners, variant):
    r = runners[variant]
    with jax.numpy_rank_promotion("raise"):
        out = r.model(jnp.zeros((1, 3), jnp.int32), jnp.arange(3)[None], r.model.init_cache(1, 3))
    assert out.logits.shape == (1, 3, 64)


VARIANTS = {
    "plain": {},
    "qkv_bias+untied": {"qkv_bias": True, "tie_embeddings": False},
}
B, T, S = 2, 16, 16  # one shape for most full passes, so the jitted forward compiles rarely


def random_model(config: ModelConfig, seed: int):
    """A random model built in numpy (no eager jax ops to compile); norms and biases not 1 and 0."""
    abstract = nnx.eval_shape(lambda: loader.init_model(config))
    rng = np.random.default_rng(seed)
    weights = {}
    for path, v in nnx.to_flat_state(nnx.state(abstract, nnx.Param)):
        name, shape = ".".join(map(str, path)), v.shape
        if len(shape) == 2:
            w = rng.normal(size=shape) * (1.0 if name == "embed" else shape[0] ** -0.5)
        else:
            w = (1.0 if name.endswith("scale") else 0.0) + 0.2 * rng.normal(size=shape)
        weights[name] = w.astype(np.float32)
    return loader.model_from_weights(config, weights)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _forward(graphdef, params, tokens, positions, cache, start=None, window_mask=None):
    model = nnx.merge(graphdef, params)
    return model(tokens, positions, cache, start=start, window_mask=window_mask)


class Runner:
    """A model split once; every call goes through one jitted forward (compiled per shape)."""

    def __init__(self, model):
        self.model = model
        self.config = model.config
        self.graphdef, self.params = nnx.split(model)

    def __call__(self, tokens, positions, cache, start=None, window_mask=None):
        """`Output(logits, hidden, cache)` of the jitted model call."""
        tokens = jnp.asarray(tokens, jnp.int32)
        positions = jnp.asarray(positions, jnp.int32)
        start = None if start is None else jnp.asarray(start, jnp.int32)
        return _forward(self.graphdef, self.params, tokens, positions, cache, start, window_mask)

    def full(self, tokens, cache_len: int | None = None) -> np.ndarray:
        """Logits of the whole sequence in one pass from an empty cache."""
        b, t = np.shape(tokens)
        cache = self.model.init_cache(b, cache_len or t)
        return np.asarray(self(tokens, np.broadcast_to(np.arange(t), (b, t)), cache).logits)


@pytest.fixture(scope="module")
def runners(tiny_config):
    out = {}
    for i, (name, overrides) in enumerate(VARIANTS.items()):
        config = dataclasses.replace(tiny_config, **overrides)
        out[name] = Runner(random_model(config, seed=i))
    return out


@pytest.fixture(params=list(VARIANTS))
def runner(request, runners):
    return runners[request.param]


@pytest.fixture
def tiny_runner(runners):
    return runners["plain"]


def assert_close(actual, desired, rel: float = 2e-6):
    """Equal up to float32 noise: atol = rel * the logits' scale (max |logit| is ~10-15 here).

    A wrong mask or position shifts logits by O(0.1-1), five orders of magnitude above this.
    """
    desired = np.asarray(desired)
    atol = rel * max(1.0, np.abs(desired).max())
    np.testing.assert_allclose(np.asarray(actual), desired, rtol=0, atol=atol)


def _tokens(seed, shape, vocab=64):
    return np.random.default_rng(seed).integers(0, vocab, size=shape, dtype=np.int32)


# ---- cached decode == full forward (teacher forcing) -------------------------------------------


@pytest.mark.parametrize("window", [1, 3])
def test_cached_decode_matches_full_forward(runner, window):
    """Prefill a prefix, then feed the rest through the cache; every logit equals the full pass.

    Rows start at different offsets, and row 0's prefill leaves garbage in the slots it later
    overwrites: stale entries must be neither attended nor in the way.
    """
    n_new = 9
    tokens = _tokens(0, (B, T))
    full = runner.full(tokens, cache_len=S)

    starts = np.array([4, 7])  # row 0 checks positions 4..12, row 1 positions 7..15
    prefill = tokens[:, :7].copy()
    prefill[0, 4:] = _tokens(1, (3,))  # garbage past row 0's prefix, overwritten below
    positions = np.broadcast_to(np.arange(7), (B, 7))
    cache = runner(prefill, positions, runner.model.init_cache(B, S)).cache

    for offset in range(0, n_new, window):
        idx = starts[:, None] + offset + np.arange(window)
        out = runner(np.take_along_axis(tokens, idx, 1), idx, cache)
        cache = out.cache
        for r in range(B):
            assert_close(out.logits[r], full[r, idx[r]])


def test_full_forward_ignores_cache_length(tiny_runner):
    """Extra, never-written cache slots change nothing."""
    tokens = _tokens(2, (B, T))
    assert_close(tiny_runner.full(tokens, cache_len=2 * T), tiny_runner.full(tokens))


# ---- causality ---------------------------------------------------------------------------------


def test_causality_through_gradients(runners):
    """d logits[t] / d embedding(token t') is zero exactly when t' > t.

    Untied head and distinct tokens, so an embedding row reaches the logits only through the
    position holding that token.
    """
    model = runners["qkv_bias+untied"].model
    config = model.config
    graphdef, embed, rest = nnx.split(model, lambda path, _: path == ("embed",), ...)
    t = 8
    tokens = jnp.asarray(np.random.default_rng(5).permutation(config.vocab_size)[:t][None], jnp.int32)
    positions = jnp.arange(t, dtype=jnp.int32)[None]

    @jax.jit
    def grads(embed_state):
        def logits(e):
            return nnx.merge(graphdef, e, rest)(tokens, positions, model.init_cache(1, t)).logits[0]

        _, vjp = jax.vjp(logits, embed_state)
        probe = jax.random.normal(jax.random.key(0), (config.vocab_size,))
        cotangents = jnp.eye(t)[:, :, None] * probe[None, None, :]  # [t, T, V]: one position each
        g = jax.vmap(lambda c: jax.tree.leaves(vjp(c))[0])(cotangents)  # [t, vocab, D]
        return jnp.abs(g).sum(axis=-1)[:, tokens[0]]  # [t, t']

    influence = np.asarray(grads(embed))
    future = np.triu(np.ones((t, t), bool), k=1)
    assert np.all(influence[future] == 0.0)
    assert np.all(influence[~future] > 0.0)  # past and present do flow: the check can fail


def test_future_tokens_do_not_change_earlier_logits(tiny_runner):
    tokens = _tokens(6, (B, T))
    changed = tokens.copy()
    changed[:, 6:] = (changed[:, 6:] + 1) % 64
    a, b = tiny_runner.full(tokens), tiny_runner.full(changed)
    np.testing.assert_array_equal(a[:, :6], b[:, :6])
    assert np.abs(a[:, 6:] - b[:, 6:]).max() > 1e-3


# ---- rows of a batch ---------------------------------------------------------------------------


def test_rows_independent_of_neighbours(tiny_runner):
    tokens = _tokens(7, (B, T))
    other = tokens.copy()
    other[1] = _tokens(8, (T,))
    a, b = tiny_runner.full(tokens), tiny_runner.full(other)
    assert_close(a[0], b[0])
    assert np.abs(a[1] - b[1]).max() > 1e-3


def test_right_padding_does_not_leak(tiny_runner):
    """A row's logits over its prompt do not depend on what garbage follows it."""
    prompt = _tokens(10, (1, 5))
    alone = tiny_runner.full(prompt)
    batch = _tokens(11, (B, T))
    batch[0, :5] = prompt[0]
    assert_close(tiny_runner.full(batch)[0, :5], alone[0])


# ---- tree attention (window_mask) --------------------------------------------------------------

# parents of a 5-node draft tree: 0 is the root (the pending token), 1 and 2 its children,
# 3 a child of 1, 4 a child of 2
PARENTS = (-1, 0, 0, 1, 2)


def _ancestors(parents) -> np.ndarray:
    n = len(parents)
    m = np.zeros((n, n), bool)
    for i in range(n):
        j = i
        while j >= 0:
            m[i, j] = True
            j = parents[j]
    return m


def _depths(parents) -> np.ndarray:
    return _ancestors(parents).sum(axis=1) - 1


def _access(start, t, s, window_mask=None, **kw):
    config = model_config.preset("tiny", **kw)
    cache = loader.init_model(config).init_cache(len(start), s)
    start = jnp.asarray(start)
    positions = start[:, None] + jnp.arange(t)[None]
    return kv_cache.Access.of(cache, config, positions, start=start, window_mask=window_mask)


def test_access_tree_sees_ancestors_and_prefix():
    """The cache (read before the window is written) up to the row's start; the window's own
    tokens by the tree's ancestry."""
    anc = _ancestors(PARENTS)
    t, s = len(PARENTS), 12
    start = np.array([3, 0])
    access = _access(start, t, s, jnp.asarray(np.stack([anc, anc])))
    cache_mask = np.broadcast_to(access.cache_mask(AttnKind.GLOBAL, ring=False), (2, t, s))  # [B, 1, S]
    for b in range(2):
        expected = np.zeros((t, s), bool)
        expected[:, : start[b]] = True  # committed prefix; nothing from the window's slots on
        np.testing.assert_array_equal(cache_mask[b], expected)
        np.testing.assert_array_equal(np.asarray(access.new_mask(AttnKind.GLOBAL))[b], anc)


def test_access_causal_default_and_sliding_window():
    start, t, s = [0, 2, 5], 4, 10
    access = _access(start, t, s)
    tri = np.tril(np.ones((t, t), bool))
    np.testing.assert_array_equal(np.asarray(access.new_mask(AttnKind.GLOBAL)), np.broadcast_to(tri, (3, t, t)))
    # a local layer of window 3: query at position p sees p - 2 .. p
    local = _access(start, t, s, layer_kinds=("local", "global"), sliding_window=3)
    cache = np.asarray(local.cache_mask(AttnKind.LOCAL, ring=False))
    new = np.asarray(local.new_mask(AttnKind.LOCAL))
    for b, st in enumerate(start):
        for q in range(t):
            p = st + q
            np.testing.assert_array_equal(cache[b, q], [(k < st) and (p - k < 3) for k in range(s)])
            np.testing.assert_array_equal(new[b, q], [(k <= q) and (q - k < 3) for k in range(t)])


def test_tree_verify_equals_chain_forward_per_path(runner):
    """Each node of a tree window gets the logits of the chain prefix + its root-to-node path.

    Row 1 verifies the same tree at another offset, after a different prefix.
    """
    anc = _ancestors(PARENTS)
    depth = _depths(PARENTS)
    n = len(PARENTS)
    prefix_len = np.array([7, 4])
    prefix = _tokens(14, (B, 7))
    tree = _tokens(13, (B, n))
    positions = np.broadcast_to(np.arange(7), (B, 7))
    cache = runner(prefix, positions, runner.model.init_cache(B, S)).cache
    logits = np.asarray(runner(
        tree, prefix_len[:, None] + depth[None], cache,
        start=prefix_len, window_mask=jnp.asarray(np.stack([anc, anc])),
    ).logits)

    # the same nodes as chains, right-padded to the one [B, T] shape: node (r, i) -> chain
    chains, where = [], []
    for r in range(B):
        for node in range(n):
            path = tree[r, np.nonzero(anc[node])[0]]  # ancestor indices ascend root-to-node here
            seq = np.concatenate([prefix[r, : prefix_len[r]], path])
            chains.append(np.pad(seq, (0, T - len(seq))))
            where.append((r, node, len(seq) - 1))
    chains += [chains[0]] * (-len(chains) % B)
    full = np.concatenate([runner.full(np.stack(chains[i: i + B])) for i in range(0, len(chains), B)])
    for k, (r, node, last) in enumerate(where):
        assert_close(logits[r, node], full[k, last])


# ---- config ------------------------------------------------------------------------------------

BASE = dict(vocab_size=64, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, ffn_dim=64)


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"num_heads": 4, "num_kv_heads": 3}, "multiple of num_kv_heads"),
        ({"dtype": "float64"}, "dtype"),
        ({"param_dtype": "int8"}, "param_dtype"),
    ],
    ids=["heads", "dtype", "param_dtype"],
)
def test_config_validation(overrides, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig(**{**BASE, **overrides})


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param({"num_kv_heads": 0}, id="num_kv_heads=0"),
        pytest.param({"head_dim": 7}, id="head_dim=7"),
        pytest.param({"vocab_size": 0}, id="vocab_size=0"),
    ],
)
def test_config_rejects_impossible_sizes(overrides):
    with pytest.raises(ValueError):
        ModelConfig(**{**BASE, **overrides})


def test_config_unknown_preset_and_frozen():
    with pytest.raises(ValueError, match="unknown model preset 'nope'.*smollm2-135m"):
        model_config.preset("nope")
    cfg = model_config.preset("tiny", num_layers=3)
    assert cfg.num_layers == 3 and model_config.PRESETS["tiny"].num_layers == 2
    assert hash(cfg) == hash(model_config.preset("tiny", num_layers=3))
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.dim = 8  # type: ignore[misc]
    with pytest.raises(TypeError):
        ModelConfig(64, 32, 2, 4, 2, 8, 64)  # keyword-only


def test_num_params_published_counts():
    """Independent of our code: the counts HF reports for these checkpoints."""
    assert families.num_params(model_config.preset("smollm2-135m")) == 134_515_008
    assert families.num_params(model_config.preset("qwen2.5-coder-0.5b")) == 494_032_768


# ---- variants ----------------------------------------------------------------------------------


def test_qkv_bias_is_used(runners):
    runner = runners["qkv_bias+untied"]
    tokens = _tokens(15, (B, T))
    base = runner.full(tokens)
    assert np.isfinite(base).all() and base.shape == (B, T, 64)
    graphdef, params = runner.graphdef, runner.params
    for name in ("bq", "bk", "bv"):
        m = nnx.merge(graphdef, jax.tree.map(lambda x: x, params))  # a copy
        bias = getattr(m.layers[0].attn, name)
        bias[...] = bias[...] + 0.5
        assert np.abs(Runner(m).full(tokens) - base).max() > 1e-4, name


def test_untied_head_is_used(runners):
    tokens = _tokens(16, (B, T))
    positions = np.broadcast_to(np.arange(T), (B, T))
    untied = runners["qkv_bias+untied"]
    out = untied(tokens, positions, untied.model.init_cache(B, S))
    assert_close(out.logits, out.hidden @ untied.model.lm_head[...])
    tied = runners["plain"]
    assert not hasattr(tied.model, "lm_head")
    out = tied(tokens, positions, tied.model.init_cache(B, S))
    assert_close(out.logits, jnp.einsum("btd,vd->btv", out.hidden, tied.model.embed[...]))
