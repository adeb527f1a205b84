"""Position-indexed KV cache: an explicit pytree carried through the decode loop.

Slot `s` of a row holds the key/value of the token at absolute position `s`. A forward over a
window of T tokens writes slots `start .. start+T-1` of each row at that row's own offset; the
attention mask is built from positions, so entries past a row's committed length are never
attended, and a rejected speculative suffix is simply overwritten by the next step. There is
no batch-wide write index and nothing to roll back.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, Bool, Float, Int

from specjax import sharding
from specjax.models.config import ModelConfig


@struct.dataclass
class KVCache(sharding.Logical):
    """Per-layer key and value buffers, each `[B, S, Kv, H]`."""

    k: tuple[Float[Array, "B S Kv H"], ...]
    v: tuple[Float[Array, "B S Kv H"], ...]

    def logical_axes(self):
        return dict(k=("batch", "seq", "kv_heads", "head_dim"), v=("batch", "seq", "kv_heads", "head_dim"))

    @classmethod
    def zeros(cls, config: ModelConfig, batch: int, length: int) -> "KVCache":
        shape = (batch, length, config.num_kv_heads, config.head_dim)
        dtype = config.compute_dtype
        return cls(
            k=tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers)),
            v=tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers)),
        )

    @property
    def length(self) -> int:
        """Static number of slots S."""
        return self.k[0].shape[1]

    @property
    def nbytes(self) -> int:
        return sum(x.size * x.dtype.itemsize for x in self.k + self.v)


def write(
    buf: Float[Array, "B S Kv H"], new: Float[Array, "B T Kv H"], start: Int[Array, "B"]
) -> Float[Array, "B S Kv H"]:
    """Writes `new` into slots `start[b] .. start[b]+T-1` of each row.

    Callers guarantee `start + T <= S` (the loop stops when the cache is full);
    `dynamic_update_slice` would otherwise clamp the offset.
    """
    update = lambda b, n, s: jax.lax.dynamic_update_slice(b, n, (s, 0, 0))
    return jax.vmap(update)(buf, new.astype(buf.dtype), start)


def attention_mask(
    start: Int[Array, "B"],
    num_queries: int,
    length: int,
    window_mask: Bool[Array, "B T T"] | None = None,
) -> Bool[Array, "B T S"]:
    """Which cache slots each query of the window may attend.

    Every slot before the row's window start is committed context. Inside the window the
    default is causal (query t sees window slots 0..t); a tree verify passes `window_mask`
    so each candidate sees only its ancestors. Slots after the window are never visible,
    which is why stale entries from rejected drafts need no clearing.
    """
    rel = jnp.arange(length)[None, None, :] - start[:, None, None]  # [B, 1, S]
    t = jnp.arange(num_queries)[None, :, None]
    if window_mask is None:
        return rel <= t
    in_window = (rel >= 0) & (rel < num_queries)
    idx = jnp.clip(rel, 0, num_queries - 1)
    idx = jnp.broadcast_to(idx, (start.shape[0], num_queries, length))
    allowed = jnp.take_along_axis(window_mask, idx, axis=2)
    return (rel < 0) | (in_window & allowed)
