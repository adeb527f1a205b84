"""`specjax.models.linear`: every formulation of the model's products equals `x @ w`.

The weight layout ("kn" / "nk") and the CPU kernel behind `jax.ffi` are load-time performance
decisions: outputs, gradients, the loaders' weight names and the mesh layout must not notice them.
"""

import dataclasses

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from jax.sharding import PartitionSpec as P

from specjax import sharding
from specjax.models import config as model_config, eagle, heads, linear, loader

needs_kernel = pytest.mark.skipif(not linear.kernel_available(),
                                  reason=f"CPU dense kernel not built here: {linear.kernel_status()}")


def _ref(x, w_kn):
    return np.asarray(x, np.float64) @ np.asarray(w_kn, np.float64)


def _close(a, b, k):
    # fp32 sums of k products of unit normals: rounding grows like sqrt(k) * eps * |terms|
    np.testing.assert_allclose(np.asarray(a, np.float64), b, rtol=1e-4, atol=2e-5 * np.sqrt(k) * 4)


@settings(max_examples=40, deadline=None)
@given(m=st.integers(1, linear.KERNEL_MAX_ROWS + 2), k=st.integers(1, 70), n=st.integers(1, 40),
       batch=st.booleans(), seed=st.integers(0, 2**16))
def test_dense_equals_reference_in_every_layout(m, k, n, batch, seed):
    """M = 1..KERNEL_MAX_ROWS + 2 rows (the kernel's row tiles and remainders, K not a multiple of 16):
    "kn", "nk" (the kernel where built) and "nk" through XLA's dot all give `x @ w`."""
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (m, k), jnp.float32)
    if batch and m > 1:  # leading dims [B, T] flatten into the kernel's M
        x = x.reshape(1, m, k)
    w = jax.random.normal(kw, (k, n), jnp.float32)
    ref = _ref(x, w)
    for layout in linear.LAYOUTS:
        stored = linear.to_layout(w, layout)
        _close(jax.jit(linear.dense, static_argnums=2)(x, stored, layout), ref, k)
    _close(jnp.einsum("...k,nk->...n", x, w.T), ref, k)  # the fallback formula itself


@needs_kernel
@pytest.mark.parametrize("m,k,n", [(1, 576, 1536), (5, 576, 192), (9, 1536, 576), (16, 64, 1030), (32, 48, 20)])
def test_kernel_on_model_shapes(m, k, n):
    x = jax.random.normal(jax.random.key(m), (m, k), jnp.float32)
    w = jax.random.normal(jax.random.key(n), (n, k), jnp.float32)
    _close(jax.jit(linear.dense_nk_kernel)(x, w), _ref(x, w.T), k)


@needs_kernel
def test_dense_takes_the_kernel_only_where_it_applies():
    """The lowered program holds the custom call for a few fp32 rows, XLA's dot for one or many."""
    w = jnp.ones((8, 16), jnp.float32)
    lower = lambda x: jax.jit(linear.dense, static_argnums=2).lower(x, w, "nk").as_text()
    assert linear._TARGET in lower(jnp.ones((2, 3, 16), jnp.float32))
    assert linear._TARGET not in lower(jnp.ones((1, 1, 16), jnp.float32))  # a decode step: XLA's GEMV
    assert linear._TARGET not in lower(jnp.ones((linear.KERNEL_MAX_ROWS + 1, 16), jnp.float32))
    assert linear._TARGET not in lower(jnp.ones((2, 16), jnp.bfloat16))


@needs_kernel
def test_kernel_errors_are_clear():
    x, w = jnp.ones((2, 8), jnp.float32), jnp.ones((4, 8), jnp.float32)
    with pytest.raises(ValueError, match=r"x \[M, K\] and w \[N, K\] with the same K; got x \(2, 8\) and w \(4, 7\)"):
        linear.dense_nk_kernel(x, jnp.ones((4, 7), jnp.float32))
    with pytest.raises(ValueError, match=r"fp32 only; got x bfloat16"):
        linear.dense_nk_kernel(x.astype(jnp.bfloat16), w)
    with pytest.raises(ValueError, match=r"do not contract \(K=8; 'kn' stores \[K, N\]"):
        linear.dense(x, w, "kn")
    with pytest.raises(ValueError, match="weight_layout='kx'"):
        linear.dense(x, w, "kx")


@settings(max_examples=25, deadline=None)
@given(m=st.integers(1, linear.KERNEL_MAX_ROWS + 2), k=st.integers(1, 70),
       ns=st.lists(st.integers(0, 40), min_size=1, max_size=4), seed=st.integers(0, 2**16))
def test_dense_many_is_each_product(m, k, ns, seed):
    """`dense_many` (q/k/v and gate/up as one kernel call) gives, in every layout, each weight's
    `dense` bit for bit (the same row tiles and sums), and `x @ w`; empty weights included."""
    keys = jax.random.split(jax.random.key(seed), len(ns) + 1)
    x = jax.random.normal(keys[0], (1, m, k), jnp.float32)
    ws = [jax.random.normal(kw, (k, n), jnp.float32) for kw, n in zip(keys[1:], ns)]
    for layout in linear.LAYOUTS:
        stored = [linear.to_layout(w, layout) for w in ws]
        many = jax.jit(linear.dense_many, static_argnums=2)(x, stored, layout)
        one = [jax.jit(linear.dense, static_argnums=2)(x, w, layout) for w in stored]
        assert len(many) == len(ws)
        for a, b, w in zip(many, one, ws):
            np.testing.assert_array_equal(a, b)
            _close(a, _ref(x, w), k)


@needs_kernel
def test_dense_many_is_one_kernel_call():
    """Three weights sharing x are one custom call where the kernel applies; more than MAX_PARTS, or
    one row, fall back to a call (or XLA's dot) each."""
    ws = [jnp.ones((n, 16), jnp.float32) for n in (8, 4, 4)]
    lower = lambda x, ws: jax.jit(linear.dense_many, static_argnums=2).lower(x, ws, "nk").as_text()
    assert lower(jnp.ones((1, 5, 16), jnp.float32), ws).count(f"custom_call @{linear._TARGET}(") == 1
    assert linear._TARGET not in lower(jnp.ones((1, 1, 16), jnp.float32), ws)
    many = ws * 2
    assert lower(jnp.ones((5, 16), jnp.float32), many).count(f"custom_call @{linear._TARGET}(") == len(many)
    with pytest.raises(ValueError, match="takes 1 to 4 weights; got 5"):
        linear.dense_nk_kernels(jnp.ones((2, 16), jnp.float32), ws + ws[:2])
    with pytest.raises(ValueError, match=r"do not contract \(K=16"):
        linear.dense_many(jnp.ones((2, 16), jnp.float32), [ws[0], jnp.ones((4, 15), jnp.float32)], "nk")


@needs_kernel
def test_dense_many_gradient():
    x = jax.random.normal(jax.random.key(1), (4, 24), jnp.float32)
    ws = tuple(jax.random.normal(jax.random.key(i), (n, 24), jnp.float32) for i, n in enumerate((10, 3, 17)))
    f = lambda x, ws: sum(jnp.sum(jnp.sin(y) * (i + 1)) for i, y in enumerate(linear.dense_many(x, ws, "nk")))
    g = lambda x, ws: sum(jnp.sum(jnp.sin(x @ w.T) * (i + 1)) for i, w in enumerate(ws))
    for a, b in zip(jax.tree.leaves(jax.grad(f, (0, 1))(x, ws)), jax.tree.leaves(jax.grad(g, (0, 1))(x, ws))):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-4)  # sums of ~30 terms of size ~10


@needs_kernel
def test_kernel_gradient_and_vmap():
    x = jax.random.normal(jax.random.key(1), (3, 24), jnp.float32)
    w = jax.random.normal(jax.random.key(2), (10, 24), jnp.float32)
    f = lambda x, w: jnp.sum(jnp.sin(linear.dense(x, w, "nk")))
    g = lambda x, w: jnp.sum(jnp.sin(x @ w.T))
    for a, b in zip(jax.grad(f, (0, 1))(x, w), jax.grad(g, (0, 1))(x, w)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    xs = jnp.stack([x, 2 * x])
    np.testing.assert_allclose(jax.vmap(lambda x: linear.dense(x, w, "nk"))(xs), xs @ w.T, rtol=1e-5, atol=1e-5)


def test_fallback_without_kernel(monkeypatch):
    """Without the kernel (no compiler, SPECJAX_DENSE_KERNEL=0) "nk" is XLA's dot and the layout
    choice falls back to "kn"."""
    monkeypatch.setattr(linear, "kernel_available", lambda: False)
    x, w = jnp.ones((3, 8), jnp.float32), jnp.arange(32.0, dtype=jnp.float32).reshape(4, 8)
    assert linear._TARGET not in jax.jit(linear.dense, static_argnums=2).lower(x, w, "nk").as_text()
    np.testing.assert_allclose(linear.dense(x, w, "nk"), x @ w.T)
    assert linear.preferred_layout("cpu") == "kn"


def test_preferred_layout(monkeypatch):
    monkeypatch.setattr(linear, "kernel_available", lambda: True)
    assert linear.preferred_layout("cpu") == "nk"
    assert linear.preferred_layout("cpu", dtype="bfloat16") == "kn"  # the kernel is fp32
    assert linear.preferred_layout("gpu") == "kn" and linear.preferred_layout("tpu") == "kn"
    with pytest.raises(ValueError, match="weight_layout='NK'"):
        model_config.preset("tiny", weight_layout="NK")


# ---- the model in both layouts -------------------------------------------------------------------


def _pair(**over):
    kn = model_config.preset("tiny", **over)
    nk = dataclasses.replace(kn, weight_layout="nk")
    return loader.init_model(kn, seed=3), loader.init_model(nk, seed=3)


def _forward(model, t):
    cache = model.init_cache(2, 64)
    toks = (jnp.arange(2 * t, dtype=jnp.int32).reshape(2, t) * 7) % model.config.vocab_size
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (2, t)) + 3
    graphdef, params = nnx.split(model)
    return jax.jit(lambda p: nnx.merge(graphdef, p)(toks, pos, cache))(params)


@pytest.mark.parametrize("over", [{}, {"tie_embeddings": False, "qkv_bias": True}])
@pytest.mark.parametrize("t", [1, 5, 20])
def test_model_is_the_same_in_both_layouts(over, t):
    """One seed, both layouts: the same weights (transposed) and the same logits, hidden and cache
    (T = 20: 40 rows > KERNEL_MAX_ROWS, the XLA path of "nk" too)."""
    kn, nk = _pair(**over)
    assert nk.layers[0].attn.wq[...].shape == kn.layers[0].attn.wq[...].shape[::-1]
    np.testing.assert_array_equal(nk.layers[1].mlp.w_down[...], kn.layers[1].mlp.w_down[...].T)
    a, b = _forward(kn, t), _forward(nk, t)
    for x, y in zip(jax.tree.leaves((a.logits, a.hidden, a.cache)), jax.tree.leaves((b.logits, b.hidden, b.cache))):
        np.testing.assert_allclose(x, y, rtol=2e-5, atol=2e-5)


def test_weights_load_into_either_layout():
    """`model_from_weights` takes the loaders' `[K, N]` weights for either layout; shape errors
    speak in that form."""
    kn, _ = _pair(tie_embeddings=False)
    weights = {".".join(map(str, p)): np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(kn))}
    nk = loader.model_from_weights(dataclasses.replace(kn.config, weight_layout="nk"), weights)
    np.testing.assert_array_equal(nk.lm_head[...], weights["lm_head"].T)
    a, b = _forward(kn, 3), _forward(nk, 3)
    np.testing.assert_allclose(a.logits, b.logits, rtol=2e-5, atol=2e-5)
    weights["layers.0.attn.wq"] = weights["layers.0.attn.wq"].T
    with pytest.raises(ValueError, match=r"layers.0.attn.wq: checkpoint shape \(32, 32\)|layers.0.attn.wq: checkpoint"):
        loader.model_from_weights(nk.config, {**weights, "layers.0.attn.wq": weights["layers.0.attn.wq"][:, :8]})


def test_lm_head_readers_see_one_head():
    """EAGLE's draft rows and the Medusa base head read an untied "nk" head as they read "kn"."""
    kn, nk = _pair(tie_embeddings=False)
    ids = jnp.array([5, 0, 63], jnp.int32)
    np.testing.assert_array_equal(eagle.lm_rows(nk, ids), eagle.lm_rows(kn, ids))
    np.testing.assert_array_equal(heads.base_head(nk), heads.base_head(kn))


@pytest.mark.parametrize("subset", [None, [7, 0, 63, 2]])
def test_medusa_reads_an_untied_nk_head(subset):
    """Medusa's shared LM head (full or a vocabulary subset) on an untied "nk" target proposes from
    the same logits as on "kn"."""
    from specjax.models.heads import HeadsConfig, MedusaHeads
    from specjax.methods.medusa.proposer import MedusaProposer

    kn, nk = _pair(tie_embeddings=False)
    hidden = jax.random.normal(jax.random.key(4), (2, kn.config.dim), jnp.float32)
    tokens = jnp.array([3, 9], jnp.int32)
    out = []
    for target in (kn, nk):
        med = MedusaHeads(HeadsConfig.for_model(target.config, num_heads=2), base=target, rngs=nnx.Rngs(1))
        med.w[...] = jax.random.normal(jax.random.key(5), med.w.shape) * 0.1
        proposer, params = MedusaProposer.from_heads(med, target, k=2, vocab_subset=subset)
        out.append(proposer.head_logits(params, hidden, tokens))
    assert out[0].shape == (2, 2, kn.config.vocab_size if subset is None else len(subset))
    np.testing.assert_allclose(out[0], out[1], rtol=2e-5, atol=2e-5)


def test_mesh_layout_follows_the_stored_axes():
    """A "nk" weight carries its logical axes in stored order, so tensor parallelism splits the same
    logical dimension (q heads / ffn columns; the row-parallel input of wo / w_down)."""
    if len(jax.devices()) < 2:
        pytest.skip("needs 2 (fake) devices")
    _, nk = _pair(num_kv_heads=2)
    mesh = sharding.make_mesh(data=1, model=2, devices=jax.devices()[:2])
    specs = sharding.param_specs(nnx.state(nk), mesh)
    a, m = specs["layers"][0]["attn"], specs["layers"][0]["mlp"]
    assert a["wq"] == P("model") and a["wo"] == P(None, "model")
    assert m["w_up"] == P("model") and m["w_down"] == P(None, "model")
    kn, _ = _pair(num_kv_heads=2)
    kspecs = sharding.param_specs(nnx.state(kn), mesh)["layers"][0]
    assert kspecs["attn"]["wq"] == P(None, "model") and kspecs["mlp"]["w_down"] == P("model")
