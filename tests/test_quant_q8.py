"""The "q8" arithmetic (`weights_arith="q8"`, llama.cpp's): int8 activations per 32, integer dots.

Its contract: the kernel computes `quant.q8_product`'s values up to fp32 summation order; both equal an
independent numpy oracle of the definition; the error against the exact product stays within the
activation rounding's bound; a row is the same alone as in a window (so plain decoding and speculation
share the arithmetic); and a model loaded in q8 decodes the same greedy tokens plain and speculatively.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import padded_logits
from test_quant import _bits, _random_blocks, packed_kernel  # noqa: F401 (a fixture)

from specjax.methods.config import SpecConfig
from specjax.models import linear, loader, quant
from specjax.serving.engine import Engine


def _oracle(x: np.ndarray, raw: np.ndarray, qtype: str, n: int, k: int) -> np.ndarray:
    """The definition in numpy, float64 outside the integer dot: x rounded per 32 (d = amax / 127, half
    to even), the weights' integers and scales read from the blocks by hand."""
    m, g = x.shape[0], k // 32
    xb = x.reshape(m, g, 32).astype(np.float32)
    d = (np.abs(xb).max(-1) / np.float32(127)).astype(np.float32)
    inv = np.where(d != 0, np.float32(1) / np.where(d != 0, d, 1), 0).astype(np.float32)
    q = np.rint(xb * inv[..., None]).astype(np.int64)
    b = raw.reshape(n, g, quant.BLOCKS[qtype][1])
    dw = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float64)
    mw = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64) if qtype in ("Q4_1", "Q5_1") else None
    if qtype == "Q8_0":
        u = b[..., 2:34].view(np.int8).astype(np.int64)
    else:
        qs = b[..., {"Q4_0": 2, "Q4_1": 4, "Q5_0": 6, "Q5_1": 8}[qtype]:][..., :16]
        u = np.concatenate([qs & 15, qs >> 4], -1).astype(np.int64)
        if qtype in ("Q5_0", "Q5_1"):
            qh = b[..., 2:6] if qtype == "Q5_0" else b[..., 4:8]
            bits = np.unpackbits(qh, axis=-1, bitorder="little").astype(np.int64)  # bit j of the uint32
            u |= bits << 4
        u -= {"Q4_0": 8, "Q5_0": 16}.get(qtype, 0)
    isum = np.einsum("mgj,ngj->mng", q, u).astype(np.float64)
    y = np.einsum("mng,mg,ng->mn", isum, d.astype(np.float64), dw)
    if mw is not None:
        y += np.einsum("mg,ng->mn", d.astype(np.float64) * q.sum(-1), mw)
    return y


def _x(rng, m: int, k: int) -> np.ndarray:
    x = rng.normal(size=(m, k)).astype(np.float32)
    x[0, :32] = 0.0  # an all-zero block: d = 0
    return x


def _close(got, ref, err_msg=""):
    ref = np.asarray(ref, np.float64)
    np.testing.assert_allclose(got, ref, rtol=2e-6, atol=2e-6 * float(np.abs(ref).max()), err_msg=err_msg)


def test_in_graph_q8_product_is_the_definition():
    rng = np.random.default_rng(1)
    for qtype in quant.Q8_TYPES:
        n, k = 7, 96
        raw = _random_blocks(qtype, n, k, seed=2)
        x = _x(rng, 5, k)
        got = np.asarray(quant.q8_product(jnp.asarray(x), quant.PackedWeight(jnp.asarray(raw), qtype, (n, k), "q8")))
        _close(got, _oracle(x, raw, qtype, n, k), qtype)


def test_q8_product_refuses_a_k_quant():
    w = quant.PackedWeight(jnp.asarray(_random_blocks("Q4_K", 2, 256)), "Q4_K", (2, 256), "q8")
    with pytest.raises(ValueError, match="q8 arithmetic covers Q4_0.*Q4_K is multiplied exactly"):
        quant.q8_product(jnp.zeros((1, 256)), w)


def test_packed_weight_refuses_an_unknown_arith():
    with pytest.raises(ValueError, match="weights_arith='int4': use 'exact'.*or 'q8'"):
        quant.PackedWeight(jnp.zeros((1, 20), jnp.uint8), "Q4_1", (1, 32), "int4")


def _bound(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """|y_q8 - y_exact| <= sum over blocks of amax_b(x) / 254 * ||w_b||_1 (each x off by <= half a step)."""
    m, k = x.shape
    amax = np.abs(x.reshape(m, k // 32, 32)).max(-1).astype(np.float64)
    wl1 = np.abs(w.reshape(w.shape[0], k // 32, 32)).sum(-1).astype(np.float64)
    return amax @ wl1.T / 254


@pytest.mark.parametrize("qtype", quant.Q8_TYPES)
def test_kernel_q8_is_the_definition_and_a_row_is_itself_in_a_window(packed_kernel, qtype):
    """1..33 rows, ragged N: the oracle's values; within the rounding bound of the exact product but
    not equal to it (the mode is in force); each row bit for bit the same alone as in the window."""
    rng = np.random.default_rng(5)
    for n, k in [(13, 64), (37, 96)]:
        raw = _random_blocks(qtype, n, k, seed=n)
        w = np.asarray(quant.dequantize(jnp.asarray(raw), qtype, (n, k)))
        for m in (1, 2, 3, 4, 5, 9, 17, 33):
            x = _x(rng, m, k)
            got = np.asarray(linear.qdense_nk_kernel(jnp.asarray(x), jnp.asarray(raw), qtype, (n, k), arith="q8"))
            _close(got, _oracle(x, raw, qtype, n, k), f"{qtype}, {m} rows")
            exact = x.astype(np.float64) @ w.T.astype(np.float64)
            assert (np.abs(got - exact) <= _bound(x, w) * (1 + 1e-5) + 1e-5).all()
            assert not np.allclose(got, exact, rtol=1e-5, atol=1e-5)
            for r in {0, m // 2, m - 1}:
                alone = np.asarray(linear.qdense_nk_kernel(jnp.asarray(x[r:r + 1]), jnp.asarray(raw), qtype, (n, k),
                                                           arith="q8"))
                np.testing.assert_array_equal(_bits(alone[0]), _bits(got[r]), err_msg=f"{qtype}, row {r} of {m}")


def test_kernel_q8_leaves_k_quants_exact(packed_kernel):
    raw = jnp.asarray(_random_blocks("Q6_K", 9, 256))
    x = jnp.asarray(np.random.default_rng(0).normal(size=(3, 256)).astype(np.float32))
    np.testing.assert_array_equal(_bits(linear.qdense_nk_kernel(x, raw, "Q6_K", (9, 256), arith="q8")),
                                  _bits(linear.qdense_nk_kernel(x, raw, "Q6_K", (9, 256))))


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_q8_model_multiplies_k_quants_in_the_kernel_at_every_row_count(packed_kernel, qtype):
    """In a q8 model the K-quant weights (exact arithmetic) go to the kernel at any row count, as the q8
    types do: past the kernel's 33 rows XLA's dot would round a row differently with the rows beside
    it (a prefill of two prompts against one), and q8's 8-bit activations downstream turn that ulp
    into another token. A row of a 40-row product is bit for bit the row alone."""
    rng = np.random.default_rng(3)
    n, k = 24, 512
    w = quant.PackedWeight(jnp.asarray(_random_blocks(qtype, n, k, seed=2)), qtype, (n, k), "q8")
    x = jnp.asarray(rng.normal(size=(40, k)).astype(np.float32))
    got = np.asarray(jax.jit(lambda x: linear.dense(x, w, "nk"))(x))
    assert "qdense" in jax.jit(lambda x: linear.dense(x, w, "nk")).lower(x).as_text()  # the kernel's custom call
    for r in (0, 17, 39):
        np.testing.assert_array_equal(_bits(np.asarray(linear.dense(x[r:r + 1], w, "nk"))[0]), _bits(got[r]))
    np.testing.assert_array_equal(_bits(got), _bits(np.asarray(linear.qdense_nk_kernel(x, w.blocks, qtype, (n, k)))))


def test_avx2_and_scalar_builds_agree_bit_for_bit(packed_kernel):
    """The AVX2 path (maddubs; the sign trick for Q8_0) and the scalar one (a build without AVX) sum the
    same integers in the same lanes: the same bits, and the oracle's values."""
    avx2 = linear.register_packed_variant("specjax_qdense_nk_q8_avx2", ("-mno-avx512f",))
    scalar = linear.register_packed_variant("specjax_qdense_nk_q8_scalar", ("-mno-avx",))
    rng = np.random.default_rng(3)
    for qtype in quant.Q8_TYPES:
        n, k = 11, 96
        raw = _random_blocks(qtype, n, k, seed=4)
        for m in (1, 4, 6):
            x = _x(rng, m, k)
            a = np.asarray(linear.qdense_nk_kernel(jnp.asarray(x), jnp.asarray(raw), qtype, (n, k), avx2, "q8"))
            s = np.asarray(linear.qdense_nk_kernel(jnp.asarray(x), jnp.asarray(raw), qtype, (n, k), scalar, "q8"))
            np.testing.assert_array_equal(_bits(a), _bits(s), err_msg=f"{qtype}, {m} rows")
            _close(a, _oracle(x, raw, qtype, n, k), qtype)


@pytest.mark.parametrize("arith", quant.ARITHS)
def test_packed_weights_of_one_type_are_one_call_bit_for_bit(packed_kernel, arith):
    """`dense_many` over packed q/k/v- and gate/up-like weights (one block type, ragged N) is one kernel
    call (x quantized once in q8, one split over the threads) and gives each product's bits alone, for
    1..33 rows; weights of different types are a call each (the same values)."""
    rng = np.random.default_rng(7)
    k = 96
    ws = [quant.PackedWeight(jnp.asarray(_random_blocks("Q4_1", n, k, seed=n)), "Q4_1", (n, k), arith)
          for n in (40, 13, 13)]
    for m in (1, 2, 5, 9, 33):
        x = jnp.asarray(_x(rng, m, k)).reshape(1, m, k)
        many = linear.dense_many(x, ws, "nk")
        for y, w in zip(many, ws):
            np.testing.assert_array_equal(_bits(y), _bits(linear.dense(x, w, "nk")), err_msg=f"{arith}, {m} rows")
    calls = str(jax.make_jaxpr(lambda x: linear.dense_many(x, ws, "nk"))(x)).count("ffi_call")
    assert calls == 1, calls
    mixed = ws[:1] + [quant.PackedWeight(jnp.asarray(_random_blocks("Q8_0", 13, k, seed=1)), "Q8_0", (13, k), arith)]
    assert str(jax.make_jaxpr(lambda x: linear.dense_many(x, mixed, "nk"))(x)).count("ffi_call") == 2
    for y, w in zip(linear.dense_many(x, mixed, "nk"), mixed):
        np.testing.assert_array_equal(_bits(y), _bits(linear.dense(x, w, "nk")))


def test_dense_in_q8_without_the_kernel_computes_it_in_the_graph(monkeypatch):
    raw = _random_blocks("Q4_1", 9, 64)
    w = quant.PackedWeight(jnp.asarray(raw), "Q4_1", (9, 64), "q8")
    x = np.random.default_rng(0).normal(size=(2, 3, 64)).astype(np.float32)
    monkeypatch.setenv("SPECJAX_DENSE_KERNEL", "0")
    ref = _oracle(x.reshape(6, 64), raw, "Q4_1", 9, 64).reshape(2, 3, 9)
    for layout in linear.LAYOUTS:
        _close(np.asarray(linear.dense(jnp.asarray(x), w, layout)), ref)


def test_loader_refuses_q8_without_packed_weights(smollm2_path):
    with pytest.raises(ValueError, match="weights_arith='q8' multiplies GGUF weights kept packed.*loaded dequantized"):
        loader.load(str(smollm2_path), weights="dequantized", weights_arith="q8")


def test_smollm2_q8_speculation_equals_its_plain_loop_and_stays_near_exact(smollm2_path):
    """Loaded in q8: n-gram lookup's greedy tokens equal the q8 plain loop's; next-token logits of a short
    prompt (one q8 forward) keep the exact load's top-1 except at near ties."""
    lm = loader.load(str(smollm2_path), weights="packed", weights_arith="q8")
    assert lm.config.weights_arith == "q8"
    ids = lm.tokenizer.encode("List three colors: red, green, blue. List three colors again: red,")
    eng = Engine(lm.model, lm.tokenizer)
    # a prompt over 64 tokens: its prefill bucket (128) is wider than a verify window, and plain's and
    # n-gram's programs allocate caches of different lengths; the prefill must not depend on it
    config = ("server:\n  port: 8080\n  host: 0.0.0.0\n  workers: 4\nlogging:\n  level: info\n  "
              "format: json\ncache:\n  size: 512\n  ttl: 60\n") * 2
    long_ids = lm.tokenizer.encode(f"Repeat this file exactly:\n{config}\nThe file:\n")
    assert len(long_ids) > 64
    plain = [eng.generate([p], max_new_tokens=24, stop_ids=())[0] for p in (ids, long_ids)]
    (spec,) = eng.generate([long_ids], max_new_tokens=24, stop_ids=(), spec=SpecConfig(method="ngram", k=4))
    assert len(plain[1].tokens) == 24 and spec.tokens == plain[1].tokens and spec.tau > 1
    # both at once with 16 drafts: a verify window of 2 x 17 rows, past the 33 the exact kernel takes
    both = eng.generate([ids, long_ids], max_new_tokens=24, stop_ids=(), spec=SpecConfig(method="ngram", k=16))
    assert [r.tokens for r in both] == [r.tokens for r in plain]
    assert max(r.tau for r in both) > 1
    q8 = padded_logits(lm.model, [ids])
    exact = padded_logits(loader.load(str(smollm2_path), weights="packed").model, [ids])
    assert not np.array_equal(q8, exact)  # the mode is in force
    # q8 changes a top-1 only where the exact model nearly ties: the token it picks instead is within a
    # small logit margin of the exact top-1 there
    top_e, top_q = exact.argmax(-1)[0], q8.argmax(-1)[0]
    assert (top_e == top_q).mean() >= 0.85
    gap = exact[0, np.arange(len(ids)), top_e] - exact[0, np.arange(len(ids)), top_q]
    assert gap.max() < 0.25, gap.max()


def test_gemma3_q8_window_rows_are_the_single_steps_bits(gemma3_path):
    """Gemma 3 in q8, its sliding layers' caches rings: a prompt's prefill gives the same bits into the
    plain loop's ring (W entries) as into a verify window's (W + 4), and a 5-token verify window's
    logits are, row for row, the bits of five one-token steps, so speculation equals the q8 plain loop.
    What made it so: the attention kernel reads rings (XLA's attention over one reduced a row
    differently beside others and by the ring's length), and the blocks' residual adds are their own
    call (`cpu_attention.residual`: XLA:CPU fused a post-norm's product into the add, or recomputed
    the residual stream inside later fusions, for some window widths and not others)."""
    from flax import nnx

    lm = loader.load(str(gemma3_path), weights="packed", weights_arith="q8")
    model, t = lm.model, 5
    graphdef, params = nnx.split(model)
    fwd = jax.jit(lambda p, tok, pos, cache, start, kept: nnx.merge(graphdef, p)(tok, pos, cache, start=start,
                                                                                   kept=kept))
    ids = lm.tokenizer.encode("Write a YAML file for a web server: port 8080, two workers, json logs.")
    n = len(ids)
    prompt = jnp.asarray([ids + [0] * (64 - n)], jnp.int32)
    prefill = lambda cache: fwd(params, prompt, jnp.arange(64)[None], cache, jnp.array([0]), jnp.array([n]))
    plain = prefill(model.init_cache(1, model.config.sliding_window + 128, window=1))
    out = prefill(model.init_cache(1, model.config.sliding_window + 128, window=t))
    assert plain.cache.ring == model.config.sliding_window and out.cache.ring == model.config.sliding_window + t - 1
    np.testing.assert_array_equal(_bits(np.asarray(out.logits)[0, :n]), _bits(np.asarray(plain.logits)[0, :n]))
    cache = out.cache
    pos = n + jnp.arange(t)[None]
    window = np.asarray(fwd(params, jnp.asarray([[300, 301, 302, 303, 304]]), pos, cache, jnp.array([n]),
                            None).logits)[0]
    for i in range(t):
        out = fwd(params, jnp.asarray([[300 + i]]), pos[:, i:i + 1], cache, jnp.array([n + i]), None)
        cache = out.cache
        np.testing.assert_array_equal(_bits(np.asarray(out.logits)[0, 0]), _bits(window[i]), err_msg=f"row {i}")
