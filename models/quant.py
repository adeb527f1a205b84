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

    `shape` is the logical `(N, K)`: N output rows of K weights each."""

    blocks: jax.Array
    qtype: str = dataclasses.field(metadata=dict(static=True))
    shape: tuple[int, int] = dataclasses.field(metadata=dict(static=True))

    def __post_init__(self):
        n, k = self.shape
        block, nbytes = check_type(self.qtype, k)
        want = (n, k // block * nbytes)
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
