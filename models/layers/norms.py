"""RMSNorm, in either form: `x * w` (Llama, Qwen) or `x * (1 + w)` (Gemma: `offset=1`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float


class RMSNorm(nnx.Module):
    """`x / rms(x) * (offset + scale)` over the last axis, in float32 (as HF's, both forms).

    `scale` starts at `1 - offset` (the identity); a checkpoint stores it as the family does (Gemma's
    zero-centred, Llama's around one).
    """

    def __init__(self, dim: int, eps: float, dtype, *, offset: float = 0.0, axes: tuple[str] = ("embed",)):
        self.scale = nnx.Param(jnp.full((dim,), 1.0 - offset, dtype), axes=axes)
        self.eps = eps
        self.offset = float(offset)

    def __call__(self, x: Float[Array, "... D"]) -> Float[Array, "... D"]:
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        scale = self.scale[...].astype(jnp.float32).reshape((1,) * (x.ndim - 1) + (-1,))
        if self.offset:
            scale = self.offset + scale
        return (x32 * scale).astype(x.dtype)
