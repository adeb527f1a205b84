"""Attention, written once: grouped-query heads, optional q/k norm and qkv bias, rope of the layer's
kind, the query scalar, and the cache read (before this forward's writes) and written by kind.

`attend` is the one scores -> mask -> softmax -> values computation; the model's layers and the EAGLE
head (drafting and its training unroll) all go through it.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from specjax import sharding
from specjax.models import cpu_attention, linear
from specjax.models.config import AttnKind, ModelConfig
from specjax.models.kv_cache import Access
from specjax.models.layers import params, rope
from specjax.models.layers.norms import RMSNorm

_NEG = -1e30  # a masked score: exp underflows to 0 in float32
_KV_AXES = ("batch", "seq", "kv_heads", "head_dim")


class Keys(NamedTuple):
    """Keys and values a block of queries attends, with which of them each query sees.

    `k`, `v`: `[B, S, Kv, H]` and `mask` `[B, T, S]`; or, `aligned`, one key per query:
    `[B, T, Kv, H]` and `mask` `[B, T]` (query t sees only key t; the EAGLE unroll's shifted steps).
    """

    k: Float[Array, "B S Kv H"]
    v: Float[Array, "B S Kv H"]
    mask: Bool[Array, "B T S"]
    aligned: bool = False


def attend(q: Float[Array, "B T Kv G H"], keys: Sequence[Keys], scale: float) -> Float[Array, "B T Kv G H"]:
    """Softmax attention of `q` over every block of `keys` at once (one softmax, in float32)."""
    scores = []
    for k in keys:
        if k.aligned:
            s = jnp.einsum("BTCGH,BTCH->BTCG", q, k.k.astype(q.dtype))[..., None]
            m = k.mask[:, :, None, None, None]
        else:
            s = jnp.einsum("BTCGH,BSCH->BTCGS", q, k.k.astype(q.dtype))
            m = k.mask[:, :, None, None, :]
        scores.append(jnp.where(m, s.astype(jnp.float32) * scale, _NEG))
    sizes = [s.shape[-1] for s in scores]
    probs = jax.nn.softmax(jnp.concatenate(scores, axis=-1), axis=-1).astype(q.dtype)
    out, at = None, 0
    for k, n in zip(keys, sizes):
        p = probs[..., at: at + n]
        at += n
        if k.aligned:
            o = p * k.v.astype(q.dtype)[:, :, :, None, :]
        else:
            o = jnp.einsum("BTCGS,BSCH->BTCGH", p, k.v.astype(q.dtype))
        out = o if out is None else out + o
    return out


class Attention(nnx.Module):
    """One attention layer of `kind`: its projections, norms and rope, and its cache traffic."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs, kind: AttnKind = AttnKind.GLOBAL):
        c, wd = config, config.weight_dtype
        self.config = config
        self.kind = AttnKind(kind)
        s = c.dim**-0.5
        kv = dict(kv_heads=c.num_kv_heads)  # head dims shard only when the kv heads divide tp
        self.wq = params.dense(rngs, c.dim, c.num_heads * c.head_dim, c, s, ("embed", "q_heads"), **kv)
        self.wk = params.dense(rngs, c.dim, c.num_kv_heads * c.head_dim, c, s, ("embed", "kv_heads"), **kv)
        self.wv = params.dense(rngs, c.dim, c.num_kv_heads * c.head_dim, c, s, ("embed", "kv_heads"), **kv)
        self.wo = params.dense(rngs, c.num_heads * c.head_dim, c.dim, c, (c.num_heads * c.head_dim) ** -0.5,
                               ("q_heads", "embed"), **kv)
        if c.qkv_bias:
            self.bq = nnx.Param(jnp.zeros((c.num_heads * c.head_dim,), wd), axes=("q_heads",), **kv)
            self.bk = nnx.Param(jnp.zeros((c.num_kv_heads * c.head_dim,), wd), axes=("kv_heads",), **kv)
            self.bv = nnx.Param(jnp.zeros((c.num_kv_heads * c.head_dim,), wd), axes=("kv_heads",), **kv)
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.norm_eps, wd, offset=c.norm_offset, axes=("head_dim",))
            self.k_norm = RMSNorm(c.head_dim, c.norm_eps, wd, offset=c.norm_offset, axes=("head_dim",))

    @property
    def scale(self) -> float:
        """What the scores are multiplied by: `query_pre_attn_scalar ** -0.5` (head_dim's by default)."""
        c = self.config
        return float(c.query_pre_attn_scalar or c.head_dim) ** -0.5

    def _projs(self, x, *names: str) -> list:
        """The projections `names` of x, biased: several are one kernel call (`linear.dense_many`)."""
        dt = self.config.compute_dtype
        ws = [params.weight(getattr(self, "w" + name), dt, self.config.weight_layout, keep_packed=True,
                            arith=self.config.weights_arith) for name in names]
        ys = list(linear.dense_many(x, ws, self.config.weight_layout))
        if self.config.qkv_bias:
            ys = [y if name == "o" else y + getattr(self, "b" + name)[...].astype(dt)[None, None, :]
                  for y, name in zip(ys, names)]
        return ys

    def qkv(self, x: Float[Array, "B T D"], positions: Int[Array, "B T"]):
        """Queries `[B, T, Kv, G, H]`, keys and values `[B, T, Kv, H]` of x: projected, q/k normed
        (`qk_norm`) and rotated by the rope of this layer's kind."""
        c = self.config
        b, t, _ = x.shape
        q, k, v = self._projs(x, "q", "k", "v")
        q_BTCGH = q.reshape(b, t, c.num_kv_heads, c.groups, c.head_dim)
        k_BTCH = k.reshape(b, t, c.num_kv_heads, c.head_dim)
        v_BTCH = v.reshape(b, t, c.num_kv_heads, c.head_dim)
        if c.qk_norm:
            q_BTCGH, k_BTCH = self.q_norm(q_BTCGH), self.k_norm(k_BTCH)
        inv_freq = rope.inv_freq(c, self.kind)
        return rope.rope(q_BTCGH, positions, inv_freq), rope.rope(k_BTCH, positions, inv_freq), v_BTCH

    def output(self, o: Float[Array, "B T Kv G H"]) -> Float[Array, "B T D"]:
        """The output projection of the heads' values."""
        b, t = o.shape[:2]
        return self._projs(o.reshape(b, t, -1), "o")[0]

    def __call__(self, x: Float[Array, "B T D"], access: Access, k_buf: Float[Array, "B S Kv H"],
                 v_buf: Float[Array, "B S Kv H"]):
        """Attends the cache (committed context, by `access`) and the T new tokens, then writes
        their keys and values; returns (output `[B, T, D]`, k_buf, v_buf)."""
        q, k, v = self.qkv(x, access.positions)
        ring = k_buf.shape[1] != access.length
        if cpu_attention.applies(q, k_buf, context=access.context):
            lo, hi = access.cache_bounds(self.kind)
            new_mask = access.new_mask(self.kind)
            if ring and not cpu_attention.fits(q, k_buf, access.sliding_window):  # reads, then writes
                out = cpu_attention.attend(q, k_buf, v_buf, new_mask, lo, hi, self.scale, ring, new=(k, v))
                k_buf, v_buf = access.write(k_buf, k, ring), access.write(v_buf, v, ring)
            else:  # writes, then reads
                k_buf, v_buf = access.write(k_buf, k, ring), access.write(v_buf, v, ring)
                out = cpu_attention.attend(q, k_buf, v_buf, new_mask, lo, hi, self.scale, ring)
            return self.output(out.astype(x.dtype)), k_buf, v_buf
        out = attend(q, (Keys(k_buf, v_buf, access.cache_mask(self.kind, ring)),
                         Keys(k, v, access.new_mask(self.kind))), self.scale)
        k_buf = sharding.constrain(access.write(k_buf, k, ring), _KV_AXES)
        v_buf = sharding.constrain(access.write(v_buf, v, ring), _KV_AXES)
        return self.output(out.astype(x.dtype)), k_buf, v_buf
