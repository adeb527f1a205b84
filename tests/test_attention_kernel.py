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


def _ring(full, hi, t, entries):
    """A ring of `entries` holding the slots of `full` [B, L, ...] that end with each row's window at
    `hi` (slot s at entry s % entries), as models/kv_cache.py keeps a sliding-window layer's keys."""
    out = np.zeros((full.shape[0], entries, *full.shape[2:]), np.float32)
    for b, w0 in enumerate(np.asarray(hi)):
        for s in range(max(w0 + t - entries, 0), w0 + t):
            out[b, s % entries] = full[b, s]
    return jnp.asarray(out)


@needs_kernel
@pytest.mark.parametrize("t,window", [(1, 4), (5, 4), (3, 7)])
def test_a_ring_computes_the_bits_of_a_full_buffer(t, window):
    """A sliding-window layer's ring (W - 1 + T entries, the fewest a forward of T fits) holding the
    same keys as a full buffer: the kernel gives the same bits from both (slots in position order, each
    read from its entry), and XLA's reference over the ring agrees to rounding."""
    b, c, g, h, length = 3, 2, 3, 16, 40
    q, k, v, mask, lo, hi = _inputs(t + window, b, t, c, g, h, length, window)
    mask = mask & jnp.tril(jnp.ones((t, t), bool))[None]
    hi = jnp.asarray([0, 9, length - t], jnp.int32)  # empty context, a partial turn, several turns
    lo = jnp.maximum(hi[:, None] + jnp.arange(t)[None] - window + 1, 0).astype(jnp.int32)
    entries = window - 1 + t
    kr, vr = _ring(np.asarray(k), hi, t, entries), _ring(np.asarray(v), hi, t, entries)
    full = np.asarray(cpu_attention.attend(q, k, v, mask, lo, hi, 0.3))
    ring = np.asarray(jax.jit(cpu_attention.attend, static_argnums=(6, 7))(q, kr, vr, mask, lo, hi, 0.3, True))
    np.testing.assert_array_equal(ring, full)
    want = cpu_attention.reference(q, kr, vr, mask, lo, hi, 0.3, ring=True)
    np.testing.assert_allclose(ring, np.asarray(want), rtol=2e-5, atol=2e-6)
    grad = lambda f: jax.grad(lambda q: (f(q) ** 2).sum())(q)
    np.testing.assert_allclose(
        np.asarray(grad(lambda q: cpu_attention.attend(q, kr, vr, mask, lo, hi, 0.3, True))),
        np.asarray(grad(lambda q: cpu_attention.reference(q, kr, vr, mask, lo, hi, 0.3, ring=True))),
        rtol=1e-4, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("hi", [0, 3, 30])
def test_a_prefill_longer_than_the_ring_reads_its_own_keys(hi):
    """A prefill of T tokens into a ring of fewer than W - 1 + T entries: the ring's committed slots
    read before the writes, the window's keys from the forward's own (`new`): the bits of the same
    prefill into a full buffer, and XLA's reference to rounding, gradients included."""
    b, t, c, g, h, window, length = 2, 12, 2, 3, 16, 5, 48
    q, k, v, mask, _, _ = _inputs(hi + 1, b, t, c, g, h, length, window)
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
    his = jnp.full((b,), hi, jnp.int32)
    pos = his[:, None] + jnp.arange(t)[None]
    lo = jnp.maximum(pos - window + 1, 0).astype(jnp.int32)
    mask = mask & (pos[:, :, None] - pos[:, None, :] < window)  # the local layer's window among the new
    entries = window - 1 + 2  # built for forwards of 2: the prefill does not fit
    kn, vn = k[:, hi:hi + t], v[:, hi:hi + t]
    before = _ring(np.asarray(k), his, 0, entries), _ring(np.asarray(v), his, 0, entries)  # slots up to hi
    full = np.asarray(cpu_attention.attend(q, k, v, mask, lo, his, 0.3))
    ring = np.asarray(cpu_attention.attend(q, *before, mask, lo, his, 0.3, True, new=(kn, vn)))
    np.testing.assert_array_equal(ring, full)
    want = cpu_attention.reference(q, *before, mask, lo, his, 0.3, True, (kn, vn))
    np.testing.assert_allclose(ring, np.asarray(want), rtol=2e-5, atol=2e-6)
    loss = lambda f: lambda q, kn, vn: (f(q, kn, vn) ** 2).sum()
    got = jax.grad(loss(lambda q, kn, vn: cpu_attention.attend(q, *before, mask, lo, his, 0.3, True, new=(kn, vn))),
                   argnums=(0, 1, 2))(q, kn, vn)
    ref = jax.grad(loss(lambda q, kn, vn: cpu_attention.reference(q, *before, mask, lo, his, 0.3, True, (kn, vn))),
                   argnums=(0, 1, 2))(q, kn, vn)
    for a, w in zip(got, ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(w), rtol=1e-4, atol=1e-5)


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
    assert calls(_hlo(model, 2, model.init_cache(1, 16, window=2))) == 2  # the local layer's ring too
    q, ring = jnp.zeros((1, 3, 1, 1, 8)), jnp.zeros((1, 4 - 1 + 2, 1, 8))  # W = 4, built for forwards of 2
    assert cpu_attention.fits(q[:, :2], ring, 4) and not cpu_attention.fits(q, ring, 4)
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
@pytest.mark.parametrize("layout", ["full", "ring"])
@pytest.mark.parametrize("t", [1, 5])
def test_model_forward_is_the_same_with_xla_attention(monkeypatch, t, layout):
    """A tiny Llama with a sliding-window layer: cached forwards through the kernel and through XLA's
    attention agree to fp32 rounding, logits and the caches they leave; with the local layer's ring,
    the decode or verify window takes the kernel and the longer prefill XLA's attention."""
    cfg = model_config.preset("tiny", sliding_window=3, layer_kinds=(AttnKind.LOCAL, AttnKind.GLOBAL))
    model = loader.init_model(cfg, seed=1)
    rng = np.random.default_rng(0)

    def run():
        cache = model.init_cache(1, 24, window=t if layout == "ring" else None)
        assert (cache.ring is not None) == (layout == "ring")
        tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (1, 8)), jnp.int32)
        out = model(tokens, jnp.arange(8)[None], cache, kept=jnp.array([8]))  # a prefill of 8
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


@needs_kernel
def test_a_ring_layers_window_rows_are_the_single_steps_bits():
    """A tiny model with a sliding-window layer whose cache is a ring: a 5-token verify window gives,
    row for row, the bits of five one-token steps (why "q8" arithmetic, which turns an ulp into a
    different int8 activation, stays exact against its own plain loop on Gemma 3). Negative control:
    XLA's attention over the ring does not (its reductions over the ring change with the window)."""
    cfg = model_config.preset("tiny", sliding_window=3, layer_kinds=(AttnKind.LOCAL, AttnKind.GLOBAL))
    model = loader.init_model(cfg, seed=1)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 14)), jnp.int32)
    start = jnp.array([8, 6])  # ragged rows
    pos = start[:, None] + jnp.arange(5)[None]

    def differing_bits():
        cache = model.init_cache(2, 32, window=5)
        cache = model(tokens[:, :8], jnp.broadcast_to(jnp.arange(8), (2, 8)), cache, kept=start).cache
        window = model(jnp.take_along_axis(tokens, pos, 1), pos, cache, start=start).logits
        rows = []
        for i in range(5):
            out = model(jnp.take_along_axis(tokens, pos[:, i:i + 1], 1), pos[:, i:i + 1], cache, start=start + i)
            cache = out.cache
            rows.append(out.logits[:, 0])
        return int((np.asarray(window).view(np.uint32) != np.stack(rows, 1).view(np.uint32)).sum())

    assert model.init_cache(2, 32, window=5).ring is not None
    assert differing_bits() == 0
    with cpu_attention.use_kernel(False):
        assert differing_bits() > 0


@needs_kernel
def test_residual_is_its_own_call_with_the_adds_bits(monkeypatch):
    """`cpu_attention.residual`: x + y to the bit, as its own call in a Gemma 3 block (so no product
    fuses into it), with the add's gradient; XLA's add without the kernel."""
    from test_kv_cache import CONFIG, random_model

    rng = np.random.default_rng(0)
    x, y = (jnp.asarray(rng.standard_normal((2, 3, 8)), jnp.float32) for _ in range(2))
    got = jax.jit(cpu_attention.residual)(x, y)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(x + y))
    gx, gy = jax.grad(lambda x, y: (cpu_attention.residual(x, y) * y).sum(), argnums=(0, 1))(x, y)
    np.testing.assert_array_equal(np.asarray(gx), np.asarray(y))
    np.testing.assert_allclose(np.asarray(gy), np.asarray(x + 2 * y), rtol=1e-6)
    model = random_model(CONFIG)
    assert _hlo(model, 1, model.init_cache(1, 16)).count("@specjax_residual(") == 2 * CONFIG.num_layers
    monkeypatch.setattr(cpu_attention, "available", lambda: False)
    monkeypatch.setattr(cpu_attention, "_register_residual", lambda: False)
    assert _hlo(model, 1, model.init_cache(1, 16)).count("@specjax_residual(") == 0
