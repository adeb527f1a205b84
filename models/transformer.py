"""The model interface every family implements: a decoder-only transformer over the shared layers.

`Transformer` holds what every family shares: the token embedding (scaled by `sqrt(D)` where the
config says so), the blocks, the final norm, the LM head (tied or not, worked out here only), the
cache it builds for itself (`init_cache`, a kind per layer) and the forward. A family subclasses it
with its block (`specjax.models.llama.Block`, `gemma3.Block`): the composition of the shared layers
in its order.

One forward serves prefill (T = prompt bucket), decode (T = 1) and speculative verify (T = K + 1):
it takes T new tokens per row at per-row positions, reads the cache for the committed context,
writes the new tokens' K/V and returns `Output(logits, hidden, cache)`. No mode flags: the entry
points `hidden_states` and `logits` share the same blocks. The core (`specjax.core`) calls only
this interface: `init_cache`, `features` / `__call__`, `logits`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from specjax import sharding
from specjax.models import linear, quant
from specjax.models.config import ModelConfig
from specjax.models.kv_cache import Access, KVCache
from specjax.models.layers import params
from specjax.models.layers.norms import RMSNorm


class Output(NamedTuple):
    logits: Float[Array, "B T V"]
    hidden: Float[Array, "B T D"]  # final-normed hidden state, what the LM head reads
    cache: KVCache
    taps: tuple = ()  # the residual stream entering each requested layer (`taps=`), [B, T, D] each


class Transformer(nnx.Module):
    """Decoder-only transformer with a position-indexed KV cache; `Block` is the family's."""

    Block: type[nnx.Module]  # called as Block(config, layer_index, rngs); (x, access, k, v) -> (x, k, v)

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        c, wd = config, config.weight_dtype
        self.embed = params.param(rngs, (c.vocab_size, c.dim), wd, c.dim**-0.5, ("vocab", "embed"))
        self.layers = nnx.List([type(self).Block(c, i, rngs) for i in range(c.num_layers)])
        self.norm = RMSNorm(c.dim, c.norm_eps, wd, offset=c.norm_offset)
        if not c.tie_embeddings:
            self.lm_head = params.dense(rngs, c.dim, c.vocab_size, c, c.dim**-0.5, ("embed", "vocab"))

    @property
    def num_params(self) -> int:
        """Parameters of this model (a packed weight's count of weights, not of its bytes)."""
        total = 0
        for _, v in nnx.to_flat_state(nnx.state(self, nnx.Param)):
            packed = v.get_metadata().get("packed")
            total += packed[1] * packed[2] if packed else math.prod(v.shape)
        return total

    # ---- the cache ---------------------------------------------------------------------------
    def init_cache(self, batch: int, length: int, *, window: int | None = None) -> KVCache:
        """An empty cache for `batch` rows of `length` positions, one buffer per layer by its kind.

        `window`: how far past the committed context writes may reach before the next commit (a
        decoder's verify window; a draft model's K + 1), and so the widest forward; the
        sliding-window layers then keep a ring of `sliding_window - 1 + window` entries instead of
        `length`. None: full buffers (any forward may write; a one-shot forward over a sequence).
        """
        return KVCache.zeros(self.config, batch, length, window=window)

    # ---- the embedding (its GGUF blocks kept packed, or a dense table) -----------------------
    def _packed_embed(self) -> quant.PackedWeight | None:
        """The embedding as a `quant.PackedWeight` `[V, D]` where the loader kept it packed, else None
        (multiplied in the config's `weights_arith` when it is the LM head)."""
        packed = self.embed.get_metadata().get("packed")
        return None if packed is None else quant.PackedWeight(self.embed[...], packed[0], tuple(packed[1:]),
                                                              self.config.weights_arith)

    def embedding(self, ids: Int[Array, "..."] | None = None) -> Float[Array, "... D"]:
        """The token embedding table `[V, D]` as stored values (a packed one dequantized to gguf's fp32,
        in the graph), or only the rows of `ids` (clipped into range: no NaN row for any id). What
        code outside the model reads instead of the `embed` parameter."""
        pw = self._packed_embed()
        if pw is None:
            w = self.embed[...]
            return w if ids is None else jnp.take(w, ids, axis=0, mode="clip")
        if ids is None:
            return pw.dequantize()
        rows = jnp.take(pw.blocks, ids.reshape(-1), axis=0, mode="clip")  # whole rows of blocks
        return quant.dequantize(rows, pw.qtype, (rows.shape[0], pw.shape[1])).reshape(*ids.shape, pw.shape[1])

    # ---- the forward -------------------------------------------------------------------------
    def embed_tokens(self, tokens: Int[Array, "B T"]) -> Float[Array, "B T D"]:
        """Token embeddings as the blocks read them (times `sqrt(D)` for `embed_scale` families)."""
        x = self.embedding(tokens)
        if self.config.embed_scale:  # in the weights' dtype, as HF's scaled embedding
            x = x * jnp.asarray(math.sqrt(self.config.dim), x.dtype)
        return x.astype(self.config.compute_dtype)

    def hidden_states(
        self,
        tokens: Int[Array, "B T"],
        positions: Int[Array, "B T"],
        cache: KVCache,
        *,
        start: Int[Array, "B"] | None = None,
        window_mask: Bool[Array, "B T T"] | None = None,
        kept: Int[Array, "B"] | None = None,
    ) -> tuple[Float[Array, "B T D"], KVCache]:
        """Runs the blocks over T new tokens per row; returns final-normed hidden and cache.

        Args:
          tokens: new tokens of each row.
          positions: their absolute positions (RoPE); for a chain window `start + arange(T)`.
          cache: the cache (`init_cache`); slots `start .. start+T-1` of each row are overwritten.
          start: first cache slot of the window per row; defaults to `positions[:, 0]`.
          window_mask: visibility inside the window (tree verify); causal when None.
          kept: how many of each row's tokens the cache keeps (a right-padded prompt's length: a
            sliding-window ring does not store the padding); None keeps all.
        """
        hidden, cache, _ = self.features(tokens, positions, cache, start=start, window_mask=window_mask, kept=kept)
        return hidden, cache

    def features(self, tokens: Int[Array, "B T"], positions: Int[Array, "B T"], cache: KVCache, *,
                 start: Int[Array, "B"] | None = None, window_mask: Bool[Array, "B T T"] | None = None,
                 kept: Int[Array, "B"] | None = None, taps: tuple[int, ...] = ()
                 ) -> tuple[Float[Array, "B T D"], KVCache, tuple[Float[Array, "B T D"], ...]]:
        """`hidden_states`, and the residual stream entering each layer in `taps` (the features an
        EAGLE-3 head fuses): returns (hidden, cache, taps)."""
        access = Access.of(cache, self.config, positions, start=start, window_mask=window_mask, kept=kept)
        x = sharding.constrain(self.embed_tokens(tokens), ("batch", None, "embed"))
        ks, vs, tapped = [], [], {}
        for i, (layer, k_buf, v_buf) in enumerate(zip(self.layers, cache.k, cache.v)):
            if i in taps:
                tapped[i] = x
            x, k_buf, v_buf = layer(x, access, k_buf, v_buf)
            ks.append(k_buf)
            vs.append(v_buf)
        cache = cache.replace(k=tuple(ks), v=tuple(vs), ring_slots=access.ring_slots_after())
        return self.norm(x), cache, tuple(tapped[i] for i in taps)

    # ---- the LM head -------------------------------------------------------------------------
    def lm_head_weight(self) -> tuple[Float[Array, "..."], str]:
        """The LM head as stored, and its layout: the tied embedding `[V, D]` ("nk", token rows), or
        the own projection in `config.weight_layout` ("kn" `[D, V]`, "nk" `[V, D]`)."""
        if self.config.tie_embeddings:
            return self.embedding(), "nk"
        layout = self.config.weight_layout
        return params.weight(self.lm_head, None, layout), layout

    def lm_head_rows(self, ids: Int[Array, "Vd"] | None = None) -> Float[Array, "V D"]:
        """The LM head as token rows `[V, D]` (tied or not), or only the rows of `ids`."""
        if self.config.tie_embeddings:
            return self.embedding(ids)
        w, layout = self.lm_head_weight()
        rows = linear.as_rows(w, layout)
        return rows if ids is None else jnp.take(rows, ids, axis=0, mode="clip")

    def logits(self, hidden: Float[Array, "... D"]) -> Float[Array, "... V"]:
        """LM head over final-normed hidden states. A packed head (the tied embedding, or an own
        projection) goes to `linear.dense` as stored, which multiplies it in the packed kernel where
        that applies (fp32 compute)."""
        cd = self.config.compute_dtype
        if self.config.tie_embeddings:
            pw, layout = self._packed_embed(), "nk"
            w = pw if pw is not None and jnp.dtype(cd) == jnp.float32 else self.embedding().astype(cd)
        else:
            layout = self.config.weight_layout
            w = params.weight(self.lm_head, cd, layout, keep_packed=True, arith=self.config.weights_arith)
        out = linear.dense(hidden, w, layout)
        return sharding.constrain(out, ("batch",) + (None,) * (out.ndim - 2) + ("vocab",))

    def __call__(self, tokens, positions, cache, *, start=None, window_mask=None, kept=None,
                 taps: tuple[int, ...] = ()) -> Output:
        """Hidden states and logits; `taps` also returns the residual stream entering those layers
        (the features an EAGLE-3 head fuses)."""
        hidden, cache, tapped = self.features(tokens, positions, cache, start=start, window_mask=window_mask,
                                              kept=kept, taps=tuple(taps))
        return Output(self.logits(hidden), hidden, cache, tapped)
