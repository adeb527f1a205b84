"""Rotary position embedding: the inverse frequencies of each attention kind, and the rotation.

Global layers use `rope_theta` with `rope_scaling`; local (sliding-window) layers use
`rope_local_theta` unscaled when the config gives one (Gemma 3: 10k local, 1M global), else the
global rope (Mistral's sliding layers).
"""

from __future__ import annotations

import functools
import math

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from specjax.models.config import AttnKind, ModelConfig, RopeKind, RopeScaling


def inv_freq(config: ModelConfig, kind: AttnKind = AttnKind.GLOBAL) -> np.ndarray:
    """The [H / 2] float32 inverse frequencies of `kind`'s layers, their scaling applied.

    Every user of `rope` (the model, the EAGLE head, its training unroll) takes them from here.
    """
    if kind == AttnKind.LOCAL and config.rope_local_theta is not None:
        return _inv_freq(float(config.rope_local_theta), config.head_dim, None)
    return _inv_freq(float(config.rope_theta), config.head_dim, config.rope_scaling)


@functools.lru_cache(maxsize=64)
def _inv_freq(theta: float, h: int, scaling: RopeScaling | None) -> np.ndarray:
    # the base frequencies rounded once from float64 (numpy's float32 pow is 2 ulp off torch's and
    # XLA's); then float32, operation for operation as HF's `modeling_rope_utils`
    base = (1.0 / (theta ** (np.arange(0, h, 2) / h))).astype(np.float32)
    out = base if scaling is None else _scaled(base, scaling)
    out = np.asarray(out, np.float32)
    out.flags.writeable = False  # cached: shared by every caller
    return out


def _scaled(inv_freq: np.ndarray, scaling: RopeScaling) -> np.ndarray:
    match scaling.kind:
        case RopeKind.LINEAR:
            return inv_freq / np.float32(scaling.factor)
        case RopeKind.ROPE_FREQS:
            return inv_freq / np.asarray(scaling.divisors, np.float32)
        case RopeKind.LLAMA3:  # HF's `_compute_llama3_parameters`
            factor, low, high = scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor
            old_context = scaling.original_context
            low_freq_wavelen, high_freq_wavelen = old_context / low, old_context / high
            wavelen = (2 * math.pi / inv_freq).astype(np.float32)
            inv_freq_llama = np.where(wavelen > low_freq_wavelen, inv_freq / np.float32(factor), inv_freq)
            smooth = ((old_context / wavelen - low) / (high - low)).astype(np.float32)
            smoothed = (1 - smooth) * inv_freq_llama / np.float32(factor) + smooth * inv_freq_llama
            medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
            return np.where(medium, smoothed, inv_freq_llama)
        case _:
            raise ValueError(f"rope scaling {scaling.kind!r} has no frequencies here; supported: "
                             f"{', '.join(repr(k.value) for k in RopeKind)}")


def rope(x: Float[Array, "B T ... H"], positions: Int[Array, "B T"], inv_freq: np.ndarray):
    """Rotary embedding, rotate-half layout (HF); GGUF's interleaved q/k are un-permuted at load.

    `inv_freq`: the [H / 2] inverse frequencies, `inv_freq(config, kind)`."""
    inv_freq = jnp.asarray(inv_freq, jnp.float32)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq[None, None, :]  # [B, T, H/2]
    angles = angles.reshape(angles.shape[:2] + (1,) * (x.ndim - 3) + angles.shape[2:])
    sin, cos = jnp.sin(angles), jnp.cos(angles)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
