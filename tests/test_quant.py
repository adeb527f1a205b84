"""Packed GGUF weights (`specjax.models.quant`): the in-graph dequantization is gguf's, bit for bit."""

from __future__ import annotations

import pathlib

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import padded_logits
from gguf import quants

from specjax.models import gguf_loader, linear, loader, quant
from specjax.serving.engine import Engine

# byte offsets of each type's fp16 scale fields: random bytes there could be inf/nan, which compare
# unequal to themselves; they are drawn as finite fp16 instead
_F16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
               "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def _random_blocks(qtype: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    block, nbytes = quant.BLOCKS[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, k // block, nbytes), dtype=np.uint8)
    for off in _F16_FIELDS[qtype]:
        raw[..., off:off + 2] = rng.normal(0, 0.05, size=(n, k // block)).astype(np.float16)[..., None].view(np.uint8)
    return raw.reshape(n, -1)


def _bits(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float32).view(np.uint32)


@pytest.mark.parametrize("qtype", quant.PACKED_TYPES)
def test_dequantize_is_gguf_bit_for_bit_on_random_blocks(qtype):
    block = quant.BLOCKS[qtype][0]
    n, k = 5, 3 * block
    raw = _random_blocks(qtype, n, k)
    ref = quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).reshape(n, k)
    got = jax.jit(lambda b: quant.dequantize(b, qtype, (n, k)))(raw)
    assert got.dtype == jnp.float32 and got.shape == (n, k)
    np.testing.assert_array_equal(_bits(got), _bits(ref))


def test_dequantize_differs_when_a_byte_changes():
    """Negative control: the comparison above sees a single changed quant."""
    raw = _random_blocks("Q4_K", 2, 256)
    ref = quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_K).reshape(2, 256)
    raw[1, 100] ^= 0x01
    assert not np.array_equal(_bits(quant.dequantize(raw, "Q4_K", (2, 256))), _bits(ref))


def _real_tensors(path, per_type: int = 2):
    reader = gguf_loader.open_reader(path)
    seen: dict[str, int] = {}
    for t in reader.tensors:
        name = t.tensor_type.name
        if len(t.shape) == 2 and name in quant.BLOCKS and seen.get(name, 0) < per_type:
            seen[name] = seen.get(name, 0) + 1
            yield t


def _check_real(path):
    types = set()
    for t in _real_tensors(path):
        w = quant.from_gguf_tensor(t)
        rows = min(w.shape[0], 256)  # a slice of rows keeps the test small; every block type is whole rows
        part = quant.PackedWeight(w.blocks[:rows], w.qtype, (rows, w.shape[1]))
        ref = quants.dequantize(np.asarray(t.data)[:rows], t.tensor_type).reshape(rows, w.shape[1])
        np.testing.assert_array_equal(_bits(jax.jit(lambda p: p.dequantize())(part)), _bits(ref), err_msg=t.name)
        assert w.nbytes == np.asarray(t.data).nbytes
        types.add(w.qtype)
    return types


def test_real_smollm2_tensors(smollm2_path):
    assert _check_real(smollm2_path) == {"Q4_1", "Q8_0"}


def test_real_gemma3_tensors(gemma3_path):
    assert _check_real(gemma3_path) == {"Q8_0", "Q5_0", "Q4_K", "Q6_K"}


def test_unsupported_type_refused_by_name():
    with pytest.raises(quant.UnsupportedBlockType, match="Q2_K.*Q4_0"):
        quant.check_type("Q2_K")
    with pytest.raises(ValueError, match="not a whole number of 256"):
        quant.check_type("Q6_K", 300)


def test_packed_weight_checks_its_blocks():
    with pytest.raises(ValueError, match=r"uint8 \(4, 68\)"):
        quant.PackedWeight(jnp.zeros((4, 60), jnp.uint8), "Q8_0", (4, 64))


def test_packed_weight_is_a_pytree_with_static_type():
    w = quant.PackedWeight(jnp.asarray(_random_blocks("Q8_0", 3, 64)), "Q8_0", (3, 64))
    leaves, tree = jax.tree.flatten(w)
    assert len(leaves) == 1 and leaves[0].dtype == jnp.uint8
    assert jax.tree.unflatten(tree, leaves).qtype == "Q8_0"


# ---- the loader's weights="packed" ----------------------------------------------------------------


def test_loader_refuses_unknown_weights_mode(smollm2_path):
    with pytest.raises(ValueError, match="weights='int3'.*'packed'"):
        loader.load(str(smollm2_path), weights="int3")


@pytest.fixture(scope="module")
def smollm2_packed(smollm2_path):
    return loader.load(str(smollm2_path), weights="packed")


@pytest.fixture(scope="module")
def smollm2_fp32(smollm2_path):
    return loader.load(str(smollm2_path), weights="dequantized")


def test_default_weights_are_packed_on_cpu_with_the_kernel(monkeypatch):
    if jax.default_backend() == "cpu" and linear.packed_kernel_available():
        assert loader.default_weights() == "packed"
    assert loader.default_weights("bfloat16", backend="cpu") == "dequantized"
    assert loader.default_weights(backend="gpu") == "dequantized"
    monkeypatch.setenv("SPECJAX_DENSE_KERNEL", "0")  # no kernel: the in-graph dequantization would run
    assert loader.default_weights(backend="cpu") == "dequantized"  # every step; fp32 at load is faster


def test_smollm2_packed_holds_blocks_and_counts_their_bytes(smollm2_packed, smollm2_fp32):
    wq, embed = smollm2_packed.model.layers[0].attn.wq, smollm2_packed.model.embed
    assert wq[...].dtype == jnp.uint8 and wq.get_metadata()["packed"][0] == "Q4_1"
    assert embed[...].dtype == jnp.uint8 and embed.get_metadata()["packed"] == ("Q8_0", 49152, 576)
    # the Q4_1 projections (106.2M weights) stay 5 bits a weight, the Q8_0 tied embedding (28.3M) 8.5
    saved = loader.weight_bytes(smollm2_fp32.model) - loader.weight_bytes(smollm2_packed.model)
    assert saved == pytest.approx(106.2e6 * (4 - 20 / 32) + 49152 * 576 * (4 - 34 / 32), rel=0.01)


def test_smollm2_packed_embedding_reads_gguf_rows(smollm2_packed, smollm2_fp32):
    """The packed embedding's rows (the lookup, the tied LM head's rows, the whole table) are the
    dequantized load's, bit for bit; out-of-range ids clip as the dense table's do."""
    packed, dense = smollm2_packed.model, smollm2_fp32.model
    ids = jnp.asarray([[0, 5, 49151], [17, 1000, 60000]], jnp.int32)
    np.testing.assert_array_equal(_bits(packed.embed_tokens(ids)), _bits(dense.embed_tokens(ids)))
    np.testing.assert_array_equal(_bits(packed.lm_head_rows(ids[0])), _bits(dense.lm_head_rows(ids[0])))
    np.testing.assert_array_equal(_bits(packed.embedding()), _bits(dense.embed[...]))
    w, layout = packed.lm_head_weight()
    assert layout == "nk" and w.dtype == jnp.float32 and w.shape == (49152, 576)


def test_smollm2_packed_logits_and_greedy_equal_dequantized(smollm2_packed, smollm2_fp32):
    ids = smollm2_fp32.tokenizer.encode("The capital of France is")
    a, b = padded_logits(smollm2_packed.model, [ids]), padded_logits(smollm2_fp32.model, [ids])
    np.testing.assert_array_equal(_bits(a), _bits(b))
    (ours,) = Engine(smollm2_packed.model, smollm2_packed.tokenizer).generate([ids], max_new_tokens=16, stop_ids=())
    (ref,) = Engine(smollm2_fp32.model, smollm2_fp32.tokenizer).generate([ids], max_new_tokens=16, stop_ids=())
    assert len(ref.tokens) == 16 and ours.tokens == ref.tokens


def test_gemma3_packed_logits_equal_dequantized(gemma3_path):
    ids = [2, 818, 5279, 529, 7001, 563]
    packed = loader.load(str(gemma3_path), weights="packed")
    assert {p.get_metadata()["packed"][0] for p in (packed.model.layers[0].attn.wq, packed.model.layers[0].mlp.w_down,
                                                   packed.model.layers[1].mlp.w_down)} >= {"Q5_0"}
    a = padded_logits(packed.model, [ids])
    del packed
    b = padded_logits(loader.load(str(gemma3_path), weights="dequantized").model, [ids])
    np.testing.assert_array_equal(_bits(a), _bits(b))


# ---- the packed CPU kernel (qdense_nk.cc) -----------------------------------------------------------


@pytest.fixture(scope="module")
def packed_kernel():
    if jax.default_backend() != "cpu" or not linear.packed_kernel_available():
        pytest.skip(f"the packed CPU kernel is not available here ({linear.packed_kernel_status()})")


@pytest.mark.parametrize("qtype", quant.PACKED_TYPES)
def test_kernel_rebuilds_gguf_weights_exactly(packed_kernel, qtype):
    """One-hot rows of x read single weights out of the product: exactly gguf's values."""
    block = quant.BLOCKS[qtype][0]
    n, k = 11, 2 * block
    raw = _random_blocks(qtype, n, k, seed=3)
    ref = quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).reshape(n, k)
    cols = [np.asarray(linear.qdense_nk_kernel(jnp.eye(k, dtype=jnp.float32)[c:c + 32], jnp.asarray(raw), qtype,
                                               (n, k))) for c in range(0, k, 32)]
    # values, not bits: a one-hot sum turns a -0.0 weight into +0.0
    np.testing.assert_array_equal(np.concatenate(cols).T, ref)


@pytest.mark.parametrize("qtype", quant.PACKED_TYPES)
def test_kernel_product_is_dense_nk_on_the_dequantized_weight(packed_kernel, qtype):
    """Bit for bit dense_nk's product (same sums in the same order) for 1..33 rows and a ragged N; within
    summation tolerance of an fp32 matmul; each row the same alone as in the window."""
    block = quant.BLOCKS[qtype][0]
    rng = np.random.default_rng(7)
    for n, k in [(13, 2 * block), (40, 3 * block)]:
        raw = jnp.asarray(_random_blocks(qtype, n, k, seed=n))
        w = quant.dequantize(raw, qtype, (n, k))
        for m in (1, 2, 3, 5, 9, 17, 33):
            x = jnp.asarray(rng.normal(size=(m, k)).astype(np.float32))
            got = np.asarray(linear.qdense_nk_kernel(x, raw, qtype, (n, k)))
            np.testing.assert_array_equal(_bits(got), _bits(linear.dense_nk_kernel(x, w)))
            ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
            np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * float(np.abs(ref).max()))
            r = m // 2
            alone = np.asarray(linear.qdense_nk_kernel(x[r:r + 1], raw, qtype, (n, k)))
            np.testing.assert_array_equal(_bits(alone[0]), _bits(got[r]))


@pytest.mark.parametrize("flags", [("-mno-avx512f",), ("-mno-avx",)], ids=["avx2", "no-avx"])
def test_other_isa_builds_equal_their_dense_kernel(packed_kernel, flags):
    """Built for a smaller ISA (without AVX-512: the 8-lane tile and the scalar dequantization, scratch
    path for every row count; without AVX: the 16-lane tile split by the compiler), the packed kernel
    still gives its own build's dense_nk on the dequantized weight bit for bit, at every row count, and
    a row the same alone as in a window."""
    target = linear.register_packed_variant("specjax_qdense_nk_" + flags[0][5:].replace("-", "_"), flags)
    rng = np.random.default_rng(11)
    for qtype in quant.PACKED_TYPES:
        block = quant.BLOCKS[qtype][0]
        n, k = 19, 3 * block
        raw = jnp.asarray(_random_blocks(qtype, n, k, seed=5))
        w = quant.dequantize(raw, qtype, (n, k))
        for m in (1, 3, 4, 9):
            x = jnp.asarray(rng.normal(size=(m, k)).astype(np.float32))
            got = linear.qdense_nk_kernel(x, raw, qtype, (n, k), target=target)
            with linear.kernel_target(target + "_dense", multi=True):
                ref = linear.dense_nk_kernel(x, w)
            np.testing.assert_array_equal(_bits(got), _bits(ref), err_msg=f"{qtype}, {m} rows")
            alone = linear.qdense_nk_kernel(x[m - 1:], raw, qtype, (n, k), target=target)
            np.testing.assert_array_equal(_bits(alone[0]), _bits(got[m - 1]), err_msg=f"{qtype}, {m} rows")
            np.testing.assert_allclose(got, np.asarray(x, np.float64) @ np.asarray(w, np.float64).T,
                                       rtol=1e-4, atol=1e-4 * float(np.abs(np.asarray(got)).max()))


def test_kernel_refuses_mismatched_blocks(packed_kernel):
    with pytest.raises(ValueError, match="Q3_K is not one of"):
        linear.qdense_nk_kernel(jnp.zeros((1, 256)), jnp.zeros((2, 110), jnp.uint8), "Q3_K", (2, 256))


def test_dense_of_a_packed_weight_without_the_kernel_dequantizes(monkeypatch):
    raw = jnp.asarray(_random_blocks("Q5_0", 9, 64))
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 3, 64)).astype(np.float32))
    w = quant.PackedWeight(raw, "Q5_0", (9, 64))
    monkeypatch.setenv("SPECJAX_DENSE_KERNEL", "0")
    for layout in linear.LAYOUTS:
        ref = x @ w.dequantize().T
        np.testing.assert_allclose(linear.dense(x, w, layout), ref, rtol=1e-6, atol=1e-6)


def test_smollm2_packed_greedy_kernel_equals_in_graph_fallback(smollm2_packed, monkeypatch):
    """Greedy tokens: the packed kernel (1-row steps) == the dequantized load; the in-graph fallback
    (kernels off) picks the same top-1 at every position of a prompt."""
    ids = smollm2_packed.tokenizer.encode("Speculative decoding is a way to")
    kernel = padded_logits(smollm2_packed.model, [ids])
    monkeypatch.setenv("SPECJAX_DENSE_KERNEL", "0")
    fallback = padded_logits(smollm2_packed.model, [ids], length=len(ids) + 1)[:, :len(ids)]  # a new trace
    np.testing.assert_array_equal(kernel.argmax(-1), fallback.argmax(-1))
    np.testing.assert_allclose(kernel, fallback, rtol=1e-3, atol=1e-3)
