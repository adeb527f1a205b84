"""`specjax.models.cpu_attention`: the CPU attention kernel equals XLA's attention, a row computes the
same bits alone as inside a window, and the model takes the kernel only where it applies."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax import sharding
from specjax.models import config as model_config, cpu_attention, loader
from specjax.models.config import AttnKind

needs_kernel = pytest.mark.skipif(not cpu_attention.available(),
                                  reason=f"CPU attention kernel not built here: {cpu_attention.status()}")


def _inputs(seed, b, t, c, g, h, s, window=None):
    rng = np.random.default_rng(seed)
    f = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    q, k, v = f(b, t, c, g, h), f(b, s, c, h), f(b, s, c, h)
    mask = jnp.asarray(rng.random((b, t, t)) < 0.5) | jnp.eye(t, dtype=bool)[None]
    hi = jnp.asarray(rng.integers(0, s - t + 1, b), jnp.int32)
    lo = jnp.zeros((b, t), jnp.int32)
    if window is not None:  # a sliding window's first slot per query
        lo = jnp.maximum(hi[:, None] + jnp.arange(t)[None] - window + 1, 0).astype(jnp.int32)
    return q, k, v, mask, lo, hi


@needs_kernel
@pytest.mark.parametrize("b,t,c,g,h,s,window", [
    (1, 1, 3, 3, 64, 640, None),  # SmolLM2's decode step
    (2, 5, 2, 4, 16, 50, None),
    (3, 9, 1, 7, 20, 33, 6),  # H not a multiple of 8; a sliding window
    (2, 64, 2, 1, 8, 100, None),  # one tile of queries
    (1, 150, 2, 3, 16, 170, None),  # a prefill bucket: three tiles
    (1, 4, 1, 2, 8, 4, None),  # the window fills the buffer: no committed context
])
def test_kernel_equals_xla_attention(b, t, c, g, h, s, window):
    args = _inputs(b * t + s, b, t, c, g, h, s, window)
    got = jax.jit(cpu_attention.attend, static_argnums=6)(*args, 0.3)
    want = cpu_attention.reference(*args, 0.3)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-6)


@needs_kernel
def test_reference_is_the_models_attention_mask():
    """`seen` is `Access`'s committed context plus the window's own slots, as the XLA path masks them."""
    from specjax.models import kv_cache

    cfg = model_config.preset("tiny", sliding_window=4, layer_kinds=(AttnKind.LOCAL, AttnKind.GLOBAL))
    cache = kv_cache.KVCache.zeros(cfg, 2, 12)
    positions = jnp.array([[3, 4, 5], [7, 8, 9]], jnp.int32)
    access = kv_cache.Access.of(cache, cfg, positions)
    for kind in AttnKind:
        lo, hi = access.cache_bounds(kind)
        got = cpu_attention.seen(cache.k[0], access.new_mask(kind), lo, hi)
        committed = access.cache_mask(kind, False)
        window = jnp.zeros((2, 3, 12), bool)
        for r, st in enumerate((3, 7)):
            window = window.at[r, :, st:st + 3].set(access.new_mask(kind)[r])
        np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.broadcast_to(committed, got.shape) | window))


@needs_kernel
def test_a_row_is_the_same_alone_as_in_its_window():
    """Row t of a causal window at slot w0 equals the one-token forward at slot w0 + t, whose earlier
    window tokens are already in the cache: bit for bit (why speculative greedy equals plain)."""
    b, t, c, g, h, s = 2, 6, 2, 3, 24, 40
    q, k, v, _, lo, hi = _inputs(7, b, t, c, g, h, s)
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
    window = np.asarray(cpu_attention.attend(q, k, v, causal, lo, hi, 0.25))
    for i in range(t):
        alone = cpu_attention.attend(q[:, i:i + 1], k, v, jnp.ones((b, 1, 1), bool), lo[:, i:i + 1], hi + i, 0.25)
        np.testing.assert_array_equal(np.asarray(alone)[:, 0], window[:, i])


@needs_kernel
def test_gradient_is_the_reference_gradient():
    args = _inputs(3, 2, 3, 2, 2, 8, 12)
    loss = lambda f: lambda q, k, v: (f(q, k, v, *args[3:], 0.5) ** 2).sum()
    got = jax.grad(loss(cpu_attention.attend), argnums=(0, 1, 2))(*args[:3])
    want = jax.grad(loss(cpu_attention.reference), argnums=(0, 1, 2))(*args[:3])
    for a, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(w), rtol=1e-4, atol=1e-5)


def _hlo(model, t, cache):
    graphdef, params = nnx.split(model)
    fwd = lambda p, tok, pos, cache: nnx.merge(graphdef, p)(tok, pos, cache).logits
    tok, pos = jnp.zeros((1, t), jnp.int32), jnp.arange(t, dtype=jnp.int32)[None] + 2
    return jax.jit(fwd).lower(params, tok, pos, cache).as_text()


@needs_kernel
def test_the_model_takes_the_kernel_only_where_it_applies():
    cfg = model_config.preset("tiny", num_layers=2, sliding_window=4, layer_kinds=(AttnKind.LOCAL, AttnKind.GLOBAL))
    model = loader.init_model(cfg)
    calls = lambda text: text.count("@specjax_attend(")
    assert calls(_hlo(model, 1, model.init_cache(1, 16))) == 2  # full buffers: both layers
    assert calls(_hlo(model, 2, model.init_cache(1, 16, window=2))) == 1  # the local layer's ring: XLA
    assert calls(_hlo(model, 64, model.init_cache(1, 80))) == 2  # a prefill bucket
    assert calls(_hlo(model, cpu_attention.MAX_WINDOW + 1, model.init_cache(1, cpu_attention.MAX_WINDOW + 8))) == 0
    mesh = sharding.make_mesh(devices=jax.devices()[:1])
    with sharding.use(mesh):
        assert calls(_hlo(model, 1, model.init_cache(1, 16))) == 0
    with cpu_attention.use_kernel(False):  # the benchmarks' switch
        assert calls(_hlo(model, 1, model.init_cache(1, 16))) == 0


@needs_kernel
def test_a_prefill_is_the_same_bits_whatever_the_buffers_length():
    """A causal 150-token prefill (three query tiles) into buffers of 160 and of 300 slots, then a
    row of it alone: the same bits (XLA's attention over the whole buffer is not: its reductions change
    with the length). Why plain and speculative programs, whose caches differ by the window's slack,
    start from the same cache."""
    b, t, c, g, h = 1, 150, 2, 3, 16
    q, k, v, _, lo, hi = _inputs(3, b, t, c, g, h, 300)
    hi = jnp.zeros_like(hi)
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
    long = np.asarray(cpu_attention.attend(q, k, v, causal, lo, hi, 0.25))
    short = np.asarray(cpu_attention.attend(q, k[:, :160], v[:, :160], causal, lo, hi, 0.25))
    np.testing.assert_array_equal(long, short)
    row = cpu_attention.attend(q[:, 130:131], k, v, jnp.ones((b, 1, 1), bool), lo[:, :1], hi + 130, 0.25)
    np.testing.assert_array_equal(np.asarray(row)[:, 0], long[:, 130])
    xla = np.asarray(cpu_attention.reference(q, k, v, causal, lo, hi, 0.25))
    np.testing.assert_allclose(xla, long, rtol=2e-5, atol=2e-6)


@needs_kernel
@pytest.mark.parametrize("t", [1, 5])
def test_model_forward_is_the_same_with_xla_attention(monkeypatch, t):
    """A tiny Llama with a sliding-window layer: cached forwards through the kernel and through XLA's
    attention agree to fp32 rounding, logits and the caches they leave."""
    cfg = model_config.preset("tiny", sliding_window=3, layer_kinds=(AttnKind.LOCAL, AttnKind.GLOBAL))
    model = loader.init_model(cfg, seed=1)
    rng = np.random.default_rng(0)

    def run():
        cache = model.init_cache(1, 24)
        tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (1, 8)), jnp.int32)
        out = model(tokens, jnp.arange(8)[None], cache)  # a prefill of 8 (the kernel takes it too)
        step = jnp.asarray(rng.integers(0, cfg.vocab_size, (1, t)), jnp.int32)
        return model(step, 8 + jnp.arange(t)[None], out.cache)

    rng = np.random.default_rng(0)
    with_kernel = run()
    monkeypatch.setattr(cpu_attention, "available", lambda: False)
    rng = np.random.default_rng(0)
    without = run()
    np.testing.assert_allclose(np.asarray(with_kernel.logits), np.asarray(without.logits), rtol=1e-5, atol=1e-5)
    for a, b in zip(with_kernel.cache.k + with_kernel.cache.v, without.cache.k + without.cache.v):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_kernel_errors_are_clear(monkeypatch):
    monkeypatch.setattr(cpu_attention, "available", lambda: False)
    args = _inputs(0, 1, 1, 1, 1, 8, 4)
    with pytest.raises(RuntimeError, match="specjax_attend is not available"):
        cpu_attention.attend(*args, 1.0)
