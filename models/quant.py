"""GGUF weights kept as the file stores them: quantized blocks, dequantized inside the graph.

A `PackedWeight` holds one GGUF tensor's blocks as a `uint8[N, K // block * bytes]` device array
(one row of blocks per output row, the `[N, K]` order HF and GGUF store projections in) with its
block type and logical shape as static metadata, so a jitted step sees fixed shapes and the bytes a
step streams are the file's bytes, not fp32's.

`dequantize` rebuilds the fp32 `[N, K]` weight in jnp with the fp32 operations `gguf.quants` does,
in the same order, so the result is bit for bit `gguf.quants.dequantize` of the same tensor
(tests/test_quant.py checks each block type on random blocks and on the shipped files' tensors).
Each format rounds at most once per value (a product, or a product and one add), which is why the
order is all there is to match.

Block types (`BLOCKS`): bytes per block of `block` weights, as in ggml-common.h.

Arithmetic (`ARITHS`, a model's `ModelConfig.weights_arith`): "exact" multiplies gguf's fp32 weights
by the fp32 activations (HF's numbers). "q8" is llama.cpp's: the activations of every product (prefill,
decoding, verify windows, trees) are rounded to int8 per 32 (`q8_activations`) and each block's dot is
an integer one, scaled once (`q8_product`; the CPU kernel computes the same in its own summation order).
It is not HF-identical; a row still computes the same alone as in a window, so plain decoding and
speculation share it. It covers the 32-weight types (`Q8_TYPES`); K-quant weights stay exact.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

# type name -> (weights per block, bytes per block)
BLOCKS = {
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q5_0": (32, 22),
    "Q5_1": (32, 24),
    "Q8_0": (32, 34),
    "Q4_K": (256, 144),
    "Q5_K": (256, 176),
    "Q6_K": (256, 210),
}
PACKED_TYPES = tuple(BLOCKS)
ARITHS = ("exact", "q8")
Q8_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")  # what "q8" arithmetic covers


def check_arith(arith: str) -> str:
    if arith not in ARITHS:
        raise ValueError(f"weights_arith={arith!r}: use 'exact' (gguf's fp32 weights times fp32 activations, "
                         "HF's numbers) or 'q8' (llama.cpp's: int8 activations per 32, integer dots)")
    return arith


class UnsupportedBlockType(ValueError):
    """A GGUF block type `PackedWeight` does not read (the loader then dequantizes at load, or refuses)."""


def check_type(qtype: str, k: int | None = None) -> tuple[int, int]:
    """(weights, bytes) per block of `qtype`; raises naming the type and the supported ones."""
    if qtype not in BLOCKS:
        raise UnsupportedBlockType(f"GGUF block type {qtype} cannot be kept packed; packed types: "
                                   f"{', '.join(PACKED_TYPES)} (load with weights='dequantized' to read it as fp32)")
    block, nbytes = BLOCKS[qtype]
    if k is not None and k % block:
        raise ValueError(f"a {qtype} row of {k} weights is not a whole number of {block}-weight blocks")
    return block, nbytes


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedWeight:
    """One GGUF tensor as stored: `blocks` uint8 `[N, K // block * bytes]`; `qtype`, `shape` static.

    `shape` is the logical `(N, K)`: N output rows of K weights each. `arith`: how `linear.dense`
    multiplies it (`ARITHS`)."""

    blocks: jax.Array
    qtype: str = dataclasses.field(metadata=dict(static=True))
    shape: tuple[int, int] = dataclasses.field(metadata=dict(static=True))
    arith: str = dataclasses.field(default="exact", metadata=dict(static=True))

    def __post_init__(self):
        n, k = self.shape
        block, nbytes = check_type(self.qtype, k)
        want = (n, k // block * nbytes)
        check_arith(self.arith)
        if tuple(self.blocks.shape) != want or self.blocks.dtype != np.uint8:
            raise ValueError(f"PackedWeight {self.qtype} {self.shape}: blocks must be uint8 {want}; got "
                             f"{self.blocks.dtype} {tuple(self.blocks.shape)}")

    @property
    def nbytes(self) -> int:
        """Bytes stored (what a step streams), not the fp32 weight's."""
        return int(self.blocks.size)

    def dequantize(self) -> jax.Array:
        """The fp32 `[N, K]` weight, bit for bit gguf's."""
        return dequantize(self.blocks, self.qtype, self.shape)


def from_gguf_tensor(tensor) -> PackedWeight:
    """A `gguf.GGUFReader` tensor (2-D, a packed type) as a `PackedWeight` on the default device."""
    qtype = tensor.tensor_type.name
    k, n = (int(d) for d in tensor.shape)  # GGUF lists the fastest-varying dimension first
    check_type(qtype, k)
    data = np.asarray(tensor.data, dtype=np.uint8).reshape(n, -1)
    return PackedWeight(jnp.asarray(data), qtype, (n, k))


# ---- in-graph dequantization (gguf.quants' fp32 ops, in its order) ---------------------------------


def _f16(b):
    """fp16 stored little-endian in the last axis' two bytes, as fp32."""
    return jax.lax.bitcast_convert_type(b, jnp.float16).astype(jnp.float32)


def _nibbles(qs):
    """`[..., L]` bytes -> `[..., 2L]`: the L low nibbles, then the L high ones (ggml's order)."""
    return jnp.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits(qh_bytes, count: int):
    """`count` bits of a little-endian uint32, bit i at position i."""
    qh = jax.lax.bitcast_convert_type(qh_bytes, jnp.uint32)
    shifts = jnp.arange(count, dtype=jnp.uint32).reshape((1,) * qh.ndim + (count,))
    return ((qh[..., None] >> shifts) & 1).astype(jnp.uint8)


def _scale_min_k4(scales):
    """Q4_K/Q5_K's eight 6-bit scales and mins from 12 bytes (`gguf.quants.Q4_K.get_scale_min`)."""
    d, m, m_d = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = jnp.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = jnp.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _q4_0(b):
    d = _f16(b[..., 0:2])
    q = _nibbles(b[..., 2:18]).astype(jnp.int8) - jnp.int8(8)
    return d[..., None] * q.astype(jnp.float32)


def _q4_1(b):
    d, m = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    q = _nibbles(b[..., 4:20]).astype(jnp.float32)
    return d[..., None] * q + m[..., None]


def _q5_0(b):
    d = _f16(b[..., 0:2])
    q = _nibbles(b[..., 6:22]) | (_high_bits(b[..., 2:6], 32) << 4)
    return d[..., None] * (q.astype(jnp.int8) - jnp.int8(16)).astype(jnp.float32)


def _q5_1(b):
    d, m = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    q = (_nibbles(b[..., 8:24]) | (_high_bits(b[..., 4:8], 32) << 4)).astype(jnp.float32)
    return d[..., None] * q + m[..., None]


def _q8_0(b):
    d = _f16(b[..., 0:2])
    x = jax.lax.bitcast_convert_type(b[..., 2:34], jnp.int8).astype(jnp.float32)
    return x * d[..., None]


def _k_quant(b, with_high: bool):
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    sc, mn = _scale_min_k4(b[..., 4:16])
    d = (d[..., None] * sc.astype(jnp.float32))[..., None]  # [..., 8, 1]
    dm = (dmin[..., None] * mn.astype(jnp.float32))[..., None]
    lead = b.shape[:-1]
    qs = b[..., 48:176] if with_high else b[..., 16:144]
    ql = _nibbles(qs.reshape(*lead, 4, 1, 32)).reshape(*lead, 8, 32)  # per 32 bytes: 32 low, 32 high nibbles
    if with_high:
        qh = b[..., 16:48].reshape(*lead, 1, 32)
        qh = (qh >> jnp.arange(8, dtype=jnp.uint8).reshape((1,) * len(lead) + (8, 1))) & 1  # [..., 8, 32]
        ql = ql | (qh << 4)
    return (d * ql.astype(jnp.float32) - dm).reshape(*lead, 256)


def _q4_k(b):
    return _k_quant(b, with_high=False)


def _q5_k(b):
    return _k_quant(b, with_high=True)


def _q6_k(b):
    lead = b.shape[:-1]
    scales = jax.lax.bitcast_convert_type(b[..., 192:208], jnp.int8).astype(jnp.float32)
    d = (_f16(b[..., 208:210])[..., None] * scales).reshape(*lead, 16, 1)
    ql = _nibbles(b[..., 0:128].reshape(*lead, 2, 1, 64)).reshape(*lead, 8, 32)
    qh = b[..., 128:192].reshape(*lead, 2, 1, 32)
    shifts = jnp.array([0, 2, 4, 6], dtype=jnp.uint8).reshape((1,) * (len(lead) + 1) + (4, 1))
    qh = ((qh >> shifts) & 3).reshape(*lead, 8, 32)
    q = (ql | (qh << 4)).astype(jnp.int8) - jnp.int8(32)
    return (d * q.reshape(*lead, 16, 16).astype(jnp.float32)).reshape(*lead, 256)


_DEQUANT = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0,
            "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}


def dequantize(blocks, qtype: str, shape: tuple[int, int]) -> jax.Array:
    """fp32 `[N, K]` from `uint8[N, K // block * bytes]` blocks of `qtype` (jnp; jit-able)."""
    n, k = shape
    block, nbytes = check_type(qtype, k)
    b = jnp.asarray(blocks).reshape(n, k // block, nbytes)
    return _DEQUANT[qtype](b).reshape(n, k)


# ---- "q8" arithmetic, in the graph (the kernel's fallback, and its test oracle) -------------------


def q8_activations(x):
    """`x[M, K]` rounded to int8 per block of 32, as the kernel does: d = amax / 127, q = round(x * (1 / d))
    (half to even). Returns q int32 `[M, K // 32, 32]`, d fp32 `[M, K // 32]`."""
    m, k = x.shape
    xb = x.reshape(m, k // 32, 32)
    d = jnp.max(jnp.abs(xb), axis=-1) / jnp.float32(127)
    inv = jnp.where(d != 0, jnp.float32(1) / jnp.where(d != 0, d, 1), 0)
    return jnp.round(xb * inv[..., None]).astype(jnp.int32), d


def _q8_weights(blocks, qtype: str, shape: tuple[int, int]):
    """A 32-weight type's blocks as signed integers `[N, G, 32]`, scales `[N, G]`, minima `[N, G]` or None."""
    n, k = shape
    b = jnp.asarray(blocks).reshape(n, k // 32, BLOCKS[qtype][1])
    d = _f16(b[..., 0:2])
    if qtype == "Q8_0":
        return jax.lax.bitcast_convert_type(b[..., 2:34], jnp.int8).astype(jnp.int32), d, None
    if qtype == "Q4_0":
        return _nibbles(b[..., 2:18]).astype(jnp.int32) - 8, d, None
    if qtype == "Q4_1":
        return _nibbles(b[..., 4:20]).astype(jnp.int32), d, _f16(b[..., 2:4])
    if qtype == "Q5_0":
        q = _nibbles(b[..., 6:22]) | (_high_bits(b[..., 2:6], 32) << 4)
        return q.astype(jnp.int32) - 16, d, None
    q = _nibbles(b[..., 8:24]) | (_high_bits(b[..., 4:8], 32) << 4)  # Q5_1
    return q.astype(jnp.int32), d, _f16(b[..., 2:4])


def q8_product(x, w: PackedWeight):
    """`x[M, K] @ W.T` in "q8" arithmetic (`w.qtype` in `Q8_TYPES`): per block, dw * dx * the integer dot,
    plus m * dx * sum(q) for the types with a minimum. The kernel's values up to fp32 summation order."""
    if w.qtype not in Q8_TYPES:
        raise ValueError(f"q8 arithmetic covers {', '.join(Q8_TYPES)}; {w.qtype} is multiplied exactly")
    q, dx = q8_activations(x)
    u, dw, mw = _q8_weights(w.blocks, w.qtype, w.shape)
    mw = jnp.zeros_like(dw) if mw is None else mw
    xs = dx * q.sum(-1).astype(jnp.float32)

    def block(y, g):  # one block of every row and output at a time: memory M x N, not M x N x blocks
        qg, ug, dxg, dwg, mwg, xsg = g
        isum = jnp.einsum("mk,nk->mn", qg, ug, preferred_element_type=jnp.int32).astype(jnp.float32)
        return y + isum * (dxg[:, None] * dwg[None, :]) + xsg[:, None] * mwg[None, :], None

    lead = lambda a: jnp.moveaxis(a, 1, 0)
    y0 = jnp.zeros((x.shape[0], w.shape[0]), jnp.float32)
    return jax.lax.scan(block, y0, (lead(q), lead(u), dx.T, dw.T, mw.T, xs.T))[0]
