"""Llama-family decoder (Llama, SmolLM2, Qwen2) as Flax NNX modules.

One forward serves prefill (T = prompt bucket), decode (T = 1) and speculative verify
(T = K + 1): it takes T new tokens per row at per-row positions, writes their K/V into the
position-indexed cache and returns `Output(logits, hidden, cache)`. No mode flags: the entry
points `hidden_states` and `logits` share the same blocks.

Dimension alphabet, the one meaning of each letter in `specjax`'s type hints and einsum strings
(tests/test_names.py fails on a type hint that uses another):
    B batch, T query length, S cache length, N query heads, G query heads per kv head, Kv kv heads,
    H head dim, D model dim, F ffw dim, V vocab, L layers, K draft length (a chain's drafts, a
    tree's nodes);
    W verify window: the pending token and the drafts (K + 1), P prompt bucket, E stop ids per row,
    A accept depth: most drafts one step can keep (a chain's K, a tree's depth), R a kept path's
    window slots (A + 1), M the Medusa heads, Vd a draft vocabulary (a subset of V), Df an EAGLE
    head's feature width (its taps side by side: a multiple of D), Z n-gram table slots, Ng n-gram
    key length, Kf followers an n-gram table keeps per key.
Einsum subscripts are single letters: kv heads (Kv) are written C there, the output side of a
square [D, D] weight O, and a vocabulary subset V; lowercase m, n, k are a plain matmul's rows,
columns and contraction (`specjax.models.linear`), outside the alphabet.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from specjax import sharding
from specjax.models import kv_cache, linear
from specjax.models.config import ModelConfig, RopeScaling
from specjax.models.kv_cache import KVCache


class Output(NamedTuple):
    logits: Float[Array, "B T V"]
    hidden: Float[Array, "B T D"]  # final-normed hidden state, what the LM head reads
    cache: KVCache
    taps: tuple = ()  # the residual stream entering each requested layer (`taps=`), [B, T, D] each


def _param(rngs: nnx.Rngs, shape, dtype, scale: float, axes: tuple[str, ...] | None = None, **meta) -> nnx.Param:
    """A random parameter with its logical axes (`specjax.sharding.RULES` maps them to the mesh; a
    parameter without them cannot be placed on a mesh)."""
    if axes is not None:
        meta["axes"] = axes
    return nnx.Param(jax.random.normal(rngs.params(), shape, dtype) * scale, **meta)


def _dense_param(rngs: nnx.Rngs, k: int, n: int, config: ModelConfig, scale: float, axes: tuple[str, str],
                 **meta) -> nnx.Param:
    """A random `K -> N` projection weight stored in `config.weight_layout` (`specjax.models.linear`):
    drawn as [K, N] either way, so both layouts of one seed hold the same model. `axes`: (K's, N's)."""
    w = jax.random.normal(rngs.params(), (k, n), config.weight_dtype) * scale
    layout = config.weight_layout
    return nnx.Param(linear.to_layout(w, layout), axes=linear.axes(*axes, layout), dense_layout=layout, **meta)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype):
        self.scale = nnx.Param(jnp.ones((dim,), dtype), axes=("embed",))
        self.eps = eps

    def __call__(self, x: Float[Array, "... D"]) -> Float[Array, "... D"]:
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        scale = self.scale[...].astype(jnp.float32).reshape((1,) * (x.ndim - 1) + (-1,))
        return (x32 * scale).astype(x.dtype)


def rope_inv_freq(config: ModelConfig) -> np.ndarray:
    """The [H / 2] float32 inverse frequencies of `config`'s RoPE, its `rope_scaling` applied.

    Every user of `rope` (the model, the EAGLE head, its training unroll) takes them from here.
    """
    return _inv_freq(float(config.rope_theta), config.head_dim, config.rope_scaling)


@functools.lru_cache(maxsize=64)
def _inv_freq(theta: float, h: int, scaling: RopeScaling | None) -> np.ndarray:
    # the base frequencies rounded once from float64 (numpy's float32 pow is 2 ulp off torch's and
    # XLA's); then float32, operation for operation as HF's `modeling_rope_utils`
    inv_freq = (1.0 / (theta ** (np.arange(0, h, 2) / h))).astype(np.float32)
    if scaling is None:
        out = inv_freq
    elif scaling.kind == "linear":
        out = inv_freq / np.float32(scaling.factor)
    elif scaling.kind == "rope_freqs":
        out = inv_freq / np.asarray(scaling.divisors, np.float32)
    else:  # llama3 (`_compute_llama3_parameters`)
        factor, low, high = scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor
        old_context = scaling.original_context
        low_freq_wavelen, high_freq_wavelen = old_context / low, old_context / high
        wavelen = (2 * math.pi / inv_freq).astype(np.float32)
        inv_freq_llama = np.where(wavelen > low_freq_wavelen, inv_freq / np.float32(factor), inv_freq)
        smooth = ((old_context / wavelen - low) / (high - low)).astype(np.float32)
        smoothed = (1 - smooth) * inv_freq_llama / np.float32(factor) + smooth * inv_freq_llama
        medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
        out = np.where(medium, smoothed, inv_freq_llama)
    out = np.asarray(out, np.float32)
    out.flags.writeable = False  # cached: shared by every caller
    return out


def rope(x: Float[Array, "B T ... H"], positions: Int[Array, "B T"], inv_freq: np.ndarray):
    """Rotary embedding, rotate-half layout (HF); GGUF's interleaved q/k are un-permuted at load.

    `inv_freq`: the [H / 2] inverse frequencies, `rope_inv_freq(config)`."""
    inv_freq = jnp.asarray(inv_freq, jnp.float32)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq[None, None, :]  # [B, T, H/2]
    angles = angles.reshape(angles.shape[:2] + (1,) * (x.ndim - 3) + angles.shape[2:])
    sin, cos = jnp.sin(angles), jnp.cos(angles)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


class Attention(nnx.Module):
    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        c, wd = config, config.weight_dtype
        self.config = config
        s = c.dim**-0.5
        kv = dict(kv_heads=c.num_kv_heads)  # head dims shard only when the kv heads divide tp
        self.wq = _dense_param(rngs, c.dim, c.num_heads * c.head_dim, c, s, ("embed", "q_heads"), **kv)
        self.wk = _dense_param(rngs, c.dim, c.num_kv_heads * c.head_dim, c, s, ("embed", "kv_heads"), **kv)
        self.wv = _dense_param(rngs, c.dim, c.num_kv_heads * c.head_dim, c, s, ("embed", "kv_heads"), **kv)
        self.wo = _dense_param(rngs, c.num_heads * c.head_dim, c.dim, c, (c.num_heads * c.head_dim) ** -0.5,
                               ("q_heads", "embed"), **kv)
        if c.qkv_bias:
            self.bq = nnx.Param(jnp.zeros((c.num_heads * c.head_dim,), wd), axes=("q_heads",), **kv)
            self.bk = nnx.Param(jnp.zeros((c.num_kv_heads * c.head_dim,), wd), axes=("kv_heads",), **kv)
            self.bv = nnx.Param(jnp.zeros((c.num_kv_heads * c.head_dim,), wd), axes=("kv_heads",), **kv)

    def _proj(self, x, name: str):
        return self._projs(x, name)[0]

    def _projs(self, x, *names: str) -> list:
        """The projections `names` of x, biased: several are one kernel call (`linear.dense_many`)."""
        dt = self.config.compute_dtype
        ws = [getattr(self, "w" + name)[...].astype(dt) for name in names]
        ys = list(linear.dense_many(x, ws, self.config.weight_layout))
        if self.config.qkv_bias:
            ys = [y if name == "o" else y + getattr(self, "b" + name)[...].astype(dt)[None, None, :]
                  for y, name in zip(ys, names)]
        return ys

    def __call__(
        self,
        x: Float[Array, "B T D"],
        positions: Int[Array, "B T"],
        start: Int[Array, "B"],
        mask: Bool[Array, "B T S"],
        k_buf: Float[Array, "B S Kv H"],
        v_buf: Float[Array, "B S Kv H"],
    ):
        c = self.config
        b, t, _ = x.shape
        q, k, v = self._projs(x, "q", "k", "v")
        q_BTCGH = q.reshape(b, t, c.num_kv_heads, c.groups, c.head_dim)
        k_BTCH = k.reshape(b, t, c.num_kv_heads, c.head_dim)
        v_BTCH = v.reshape(b, t, c.num_kv_heads, c.head_dim)
        inv_freq = rope_inv_freq(c)
        q_BTCGH = rope(q_BTCGH, positions, inv_freq)
        k_BTCH = rope(k_BTCH, positions, inv_freq)
        kv_axes = ("batch", "seq", "kv_heads", "head_dim")
        k_buf = sharding.constrain(kv_cache.write(k_buf, k_BTCH, start), kv_axes)
        v_buf = sharding.constrain(kv_cache.write(v_buf, v_BTCH, start), kv_axes)
        scores = jnp.einsum("BTCGH,BSCH->BTCGS", q_BTCGH, k_buf.astype(q_BTCGH.dtype))
        scores = scores.astype(jnp.float32) * c.head_dim**-0.5
        scores = jnp.where(mask[:, :, None, None, :], scores, -1e30)
        probs = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
        out = jnp.einsum("BTCGS,BSCH->BTCGH", probs, v_buf.astype(x.dtype))
        return self._proj(out.reshape(b, t, -1), "o"), k_buf, v_buf


class MLP(nnx.Module):
    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        c, wd = config, config.weight_dtype
        self.dtype = c.compute_dtype
        self.layout = c.weight_layout
        self.w_gate = _dense_param(rngs, c.dim, c.ffn_dim, c, c.dim**-0.5, ("embed", "ffn"))
        self.w_up = _dense_param(rngs, c.dim, c.ffn_dim, c, c.dim**-0.5, ("embed", "ffn"))
        self.w_down = _dense_param(rngs, c.ffn_dim, c.dim, c, c.ffn_dim**-0.5, ("ffn", "embed"))

    def __call__(self, x: Float[Array, "... D"]) -> Float[Array, "... D"]:
        dt = self.dtype
        gate, up = linear.dense_many(x, (self.w_gate[...].astype(dt), self.w_up[...].astype(dt)), self.layout)
        h = jax.nn.silu(gate) * up
        h = sharding.constrain(h, ("batch", None, "ffn"))
        return linear.dense(h, self.w_down[...].astype(dt), self.layout)


class Block(nnx.Module):
    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        wd = config.weight_dtype
        self.attn_norm = RMSNorm(config.dim, config.norm_eps, wd)
        self.attn = Attention(config, rngs)
        self.mlp_norm = RMSNorm(config.dim, config.norm_eps, wd)
        self.mlp = MLP(config, rngs)

    def __call__(self, x, positions, start, mask, k_buf, v_buf):
        h, k_buf, v_buf = self.attn(self.attn_norm(x), positions, start, mask, k_buf, v_buf)
        x = x + h
        return x + self.mlp(self.mlp_norm(x)), k_buf, v_buf


class Llama(nnx.Module):
    """Decoder-only transformer with a position-indexed KV cache."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        wd = config.weight_dtype
        self.embed = _param(rngs, (config.vocab_size, config.dim), wd, config.dim**-0.5, ("vocab", "embed"))
        self.layers = nnx.List([Block(config, rngs) for _ in range(config.num_layers)])
        self.norm = RMSNorm(config.dim, config.norm_eps, wd)
        if not config.tie_embeddings:
            self.lm_head = _dense_param(rngs, config.dim, config.vocab_size, config, config.dim**-0.5,
                                        ("embed", "vocab"))

    def hidden_states(
        self,
        tokens: Int[Array, "B T"],
        positions: Int[Array, "B T"],
        cache: KVCache,
        *,
        start: Int[Array, "B"] | None = None,
        window_mask: Bool[Array, "B T T"] | None = None,
    ) -> tuple[Float[Array, "B T D"], KVCache]:
        """Runs the blocks over T new tokens per row; returns final-normed hidden and cache.

        Args:
          tokens: new tokens of each row.
          positions: their absolute positions (RoPE); for a chain window `start + arange(T)`.
          cache: the cache; slots `start .. start+T-1` of each row are overwritten.
          start: first cache slot of the window per row; defaults to `positions[:, 0]`.
          window_mask: visibility inside the window (tree verify); causal when None.
        """
        hidden, cache, _ = self.features(tokens, positions, cache, start=start, window_mask=window_mask)
        return hidden, cache

    def features(self, tokens, positions, cache, *, start=None, window_mask=None, taps: tuple[int, ...] = ()):
        """`hidden_states`, and the residual stream entering each layer in `taps` (the features an
        EAGLE-3 head fuses): returns (hidden, cache, taps)."""
        if start is None:
            start = positions[:, 0]
        t = tokens.shape[1]
        mask = kv_cache.attention_mask(start, t, cache.length, window_mask)
        x = jnp.take(self.embed[...], tokens, axis=0, mode="clip").astype(self.config.compute_dtype)  # no NaN row
        x = sharding.constrain(x, ("batch", None, "embed"))
        ks, vs, tapped = [], [], {}
        for i, (layer, k_buf, v_buf) in enumerate(zip(self.layers, cache.k, cache.v)):
            if i in taps:
                tapped[i] = x
            x, k_buf, v_buf = layer(x, positions, start, mask, k_buf, v_buf)
            ks.append(k_buf)
            vs.append(v_buf)
        return self.norm(x), KVCache(k=tuple(ks), v=tuple(vs)), tuple(tapped[i] for i in taps)

    def logits(self, hidden: Float[Array, "... D"]) -> Float[Array, "... V"]:
        """LM head: the tied embedding (`[V, D]`, the "nk" layout) or an own projection."""
        dt = self.config.compute_dtype
        if self.config.tie_embeddings:
            out = linear.dense(hidden, self.embed[...].astype(dt), "nk")
        else:
            out = linear.dense(hidden, self.lm_head[...].astype(dt), self.config.weight_layout)
        return sharding.constrain(out, ("batch",) + (None,) * (out.ndim - 2) + ("vocab",))

    def __call__(self, tokens, positions, cache, *, start=None, window_mask=None,
                 taps: tuple[int, ...] = ()) -> Output:
        """Hidden states and logits; `taps` also returns the residual stream entering those layers
        (the features an EAGLE-3 head fuses)."""
        hidden, cache, tapped = self.features(tokens, positions, cache, start=start, window_mask=window_mask,
                                              taps=tuple(taps))
        return Output(self.logits(hidden), hidden, cache, tapped)
