"""RMSNorm, in either form: `x * w` (Llama, Qwen) or `x * (1 + w)` (Gemma: `offset=1`).

Its mean of squares is summed in one fixed order (`row_sum`), so a row normalizes to the same bits
whatever the rows beside it: XLA:CPU's own reduction over the last axis changes its summation order
with the number of rows (from 8 rows of 576 on), and a verify window or a batch of 8+ rows would
then differ from the decode step in the last bit, which q8 arithmetic (`specjax.models.quant`) turns
into a different int8 step.
"""

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
        x32 = x32 * jax.lax.rsqrt(row_sum(x32 * x32)[..., None] / x32.shape[-1] + self.eps)
        scale = self.scale[...].astype(jnp.float32).reshape((1,) * (x.ndim - 1) + (-1,))
        if self.offset:
            scale = self.offset + scale
        return (x32 * scale).astype(x.dtype)


def row_sum(x: Float[Array, "... D"]) -> Float[Array, "..."]:
    """The sum over the last axis by a fixed pairwise tree of elementwise adds (first half plus second
    half, an odd last element onto the first), so each row's bits do not depend on the leading shape."""
    while x.shape[-1] > 1:
        n, h = x.shape[-1], x.shape[-1] // 2
        y = x[..., :h] + x[..., h:2 * h]
        if n % 2:
            y = jnp.concatenate([y[..., :1] + x[..., 2 * h:], y[..., 1:]], axis=-1)
        x = y
    return x[..., 0]
