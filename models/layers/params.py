"""Random parameters with their logical axes, and projection weights in the config's layout."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.models import linear, quant
from specjax.models.config import ModelConfig


def param(rngs: nnx.Rngs, shape, dtype, scale: float, axes: tuple[str, ...] | None = None, **meta) -> nnx.Param:
    """A random parameter with its logical axes (`specjax.sharding.RULES` maps them to the mesh; a
    parameter without them cannot be placed on a mesh)."""
    if axes is not None:
        meta["axes"] = axes
    return nnx.Param(jax.random.normal(rngs.params(), shape, dtype) * scale, **meta)


def dense(rngs: nnx.Rngs, k: int, n: int, config: ModelConfig, scale: float, axes: tuple[str, str],
          **meta) -> nnx.Param:
    """A random `K -> N` projection weight stored in `config.weight_layout` (`specjax.models.linear`):
    drawn as [K, N] either way, so both layouts of one seed hold the same model. `axes`: (K's, N's)."""
    w = jax.random.normal(rngs.params(), (k, n), config.weight_dtype) * scale
    layout = config.weight_layout
    return nnx.Param(linear.to_layout(w, layout), axes=linear.axes(*axes, layout), dense_layout=layout, **meta)


def weight(p: nnx.Param, dtype, layout: str, *, keep_packed: bool = False, arith: str = "exact"):
    """A projection weight as `linear.dense` takes it, in `layout`, cast to `dtype` (None: as stored;
    fp32 for a packed one). A GGUF weight
    kept packed (metadata `packed=(qtype, N, K)`, its value the file's uint8 blocks, `quant.PackedWeight`)
    is dequantized here, in the graph, to gguf's fp32 values bit for bit; it is stored `[N, K]`.
    `keep_packed`: a packed weight comes back as a `quant.PackedWeight` instead (for fp32 `dtype`), for
    `linear.dense`, which multiplies it in the C++ kernel where it can, in `arith` (`quant.ARITHS`)."""
    packed = p.get_metadata().get("packed")
    if packed is None:
        w = p[...]
    else:
        qtype, n, k = packed
        if keep_packed and (dtype is None or jnp.dtype(dtype) == jnp.float32):
            return quant.PackedWeight(p[...], qtype, (n, k), arith)
        w = quant.dequantize(p[...], qtype, (n, k))
        w = w if linear.check_layout(layout) == "nk" else w.T
    return w if dtype is None else w.astype(dtype)
