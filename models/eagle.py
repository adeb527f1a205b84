"""EAGLE-style draft head: one decoder layer that predicts the target's next feature.

Entry t of the head reads `fc([feature_t, embed(x_{t+1})])` (the target's feature at position t and
the token after it), runs one Llama decoder layer with its own position-indexed KV cache, and
returns `out_t`, its prediction of the target's feature at position t + 1. The draft's logits are
the frozen, tied LM head applied to `norm(out_t)`, restricted to a frequency-ranked draft
vocabulary; they predict x_{t+2}. Drafting feeds the head its own predicted features: entry t + 1
reads `(out_t, x̂_{t+2})`, and so on (Li et al. 2024, EAGLE).

Which target features it reads is a config choice: the final-normed hidden state, what the LM head
reads (EAGLE-1), or the residual stream entering a few low/middle/high layers, fused by a linear
map (EAGLE-3's fusion). The head's own recurrent feature is always its `out`.

Training unrolls the head on its own predictions ("training-time test", EAGLE-3): step j feeds
entry t with step j-1's prediction for position t and lets it attend the real entries up to
t - j and its own chain of predictions, exactly the context it sees when drafting at depth j + 1
(`EagleHead.unroll`, tested against the cached drafting path).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from specjax.models.config import ModelConfig
from specjax.models.kv_cache import Access, KVCache
from specjax.models.layers.attention import Attention, Keys, attend
from specjax.models.layers.mlp import MLP
from specjax.models.layers.norms import RMSNorm
from specjax.models.transformer import Output, Transformer

FEATURES = ("final", "fused")


@dataclasses.dataclass(frozen=True, kw_only=True)
class EagleConfig:
    """Shape of an EAGLE head for one target (hashable: part of the proposer's static side).

    Attributes:
      features: "final" (the final-normed hidden state, EAGLE-1) or "fused" (the residual stream
        entering `feature_layers` of the target, concatenated and mapped to D, EAGLE-3).
      feature_layers: target layers whose input the "fused" head reads.
      draft_vocab: tokens the head may propose (the most frequent in the training data).
      layer: the decoder layer's shape (heads, kv heads, ffn) = the target's by default.
      input_norm: RMSNorm the feature and the token embedding separately (each with its own learned
        scale) before `fc`, and each fused tap before `fuse` (EAGLE-3, SpecForge). Off for heads saved
        before the flag existed, which load and behave as they did.
      rest_class: the head also scores "a token outside the draft vocabulary" (one more LM-head row,
        learned), so training can match the target's whole distribution: KL over the draft vocabulary
        plus the rest-of-vocabulary mass. Drafting never proposes it.
    """

    dim: int
    vocab_size: int
    layer: ModelConfig
    features: str = "final"
    feature_layers: tuple[int, ...] = ()
    draft_vocab: int = 16384
    dtype: str = "float32"
    input_norm: bool = False
    rest_class: bool = False

    def __post_init__(self):
        if self.features not in FEATURES:
            raise ValueError(f"features={self.features!r}: choose one of {FEATURES}")
        if self.features == "fused" and len(self.feature_layers) < 2:
            raise ValueError("features='fused' needs feature_layers (e.g. (2, 15, 27) for 30 layers)")
        if self.features == "final" and self.feature_layers:
            raise ValueError("feature_layers is for features='fused'")
        if not 0 < self.draft_vocab <= self.vocab_size:
            raise ValueError(f"draft_vocab={self.draft_vocab}: must lie in [1, {self.vocab_size}]")

    @classmethod
    def for_model(cls, target: ModelConfig, **kw) -> "EagleConfig":
        """A head shaped like one layer of `target`; "fused" defaults to layers 2, L/2 and L-3."""
        n = target.num_layers
        if kw.get("features") == "fused" and not kw.get("feature_layers"):
            kw["feature_layers"] = tuple(sorted({min(2, n - 1), n // 2, max(n - 3, 0)}))
        kw["feature_layers"] = tuple(int(i) for i in kw.get("feature_layers", ()))
        if any(not 0 <= i < n for i in kw["feature_layers"]) or len(set(kw["feature_layers"])) < len(kw["feature_layers"]):
            raise ValueError(f"feature_layers={kw['feature_layers']}: give distinct layers of the target's "
                             f"{n} (0..{n - 1})")
        kw.setdefault("draft_vocab", min(16384, target.vocab_size))
        layer = dataclasses.replace(target, name=f"{target.name}-eagle", num_layers=1, layer_kinds=())
        return cls(dim=target.dim, vocab_size=target.vocab_size, layer=layer, **kw)

    @property
    def num_features(self) -> int:
        """Target feature vectors per position the head reads."""
        return 1 if self.features == "final" else len(self.feature_layers)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["layer"] = dataclasses.asdict(self.layer)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "EagleConfig":
        d = dict(d)
        d["layer"] = ModelConfig(**d["layer"])
        d["feature_layers"] = tuple(d.get("feature_layers", ()))
        return cls(**d)


def target_features(target: Transformer, config: EagleConfig, tokens: Int[Array, "B T"],
                    positions: Int[Array, "B T"], cache: KVCache, *, start=None, window_mask=None):
    """The target's forward, also returning the features this head reads at every position.

    Returns (Output, features [B, T, Df]).
    """
    out = target(tokens, positions, cache, start=start, window_mask=window_mask, taps=config.feature_layers)
    return out, features_of(config, out)


def lm_rows(target: Transformer, ids: Int[Array, "Vd"]) -> Float[Array, "Vd D"]:
    """The target's LM head restricted to the draft vocabulary, as rows `[Vd, D]` (tied or not)."""
    return target.lm_head_rows(ids)


def check_draft_ids(ids, vocab_size: int, *, what: str = "draft_ids", fix: str = "") -> np.ndarray:
    """`ids` as a 1-D int32 array when every entry is a token id in [0, vocab_size); otherwise one
    ValueError naming `what` (say, the file they came from), the first bad id and the vocabulary."""
    arr = np.asarray(ids)
    if arr.ndim != 1 or arr.size == 0 or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{what} must be a non-empty list of integer token ids (got shape {arr.shape}, "
                         f"dtype {arr.dtype}){fix}")
    bad = arr[(arr < 0) | (arr >= vocab_size)]
    if bad.size:
        raise ValueError(f"{what} holds token id {int(bad[0])} outside the target's vocabulary of {vocab_size} "
                         f"(ids 0..{vocab_size - 1}){fix}")
    return arr.astype(np.int32)


def features_of(config: EagleConfig, out: Output) -> Float[Array, "B T Df"]:
    """The features an EAGLE head reads from a target forward's output (see `taps`)."""
    return out.hidden if config.features == "final" else jnp.concatenate(out.taps, axis=-1)


class EagleHead(nnx.Module):
    """One decoder layer over `fc([feature, token embedding])` (see the module docstring)."""

    def __init__(self, config: EagleConfig, *, rngs: nnx.Rngs):
        self.config = config
        c = config.layer
        d, wd = config.dim, c.weight_dtype
        if config.num_features > 1:
            f = config.num_features * d
            self.fuse = nnx.Param(jax.random.normal(rngs.params(), (f, d), wd) * f**-0.5, axes=("features", "embed"))
        self.fc = nnx.Param(jax.random.normal(rngs.params(), (2 * d, d), wd) * (2 * d) ** -0.5,
                            axes=("features", "embed"))
        if config.input_norm:
            self.feature_norm = RMSNorm(d, c.norm_eps, wd)
            self.embed_norm = RMSNorm(d, c.norm_eps, wd)
            if config.num_features > 1:  # one learned scale per tap, [F, D]
                self.tap_scale = nnx.Param(jnp.ones((config.num_features, d), wd), axes=(None, "embed"))
        if config.rest_class:
            self.rest = nnx.Param(jnp.zeros((d,), wd), axes=("embed",))
        self.attn_norm = RMSNorm(d, c.norm_eps, wd, offset=c.norm_offset)
        self.attn = Attention(c, rngs)
        self.mlp_norm = RMSNorm(d, c.norm_eps, wd, offset=c.norm_offset)
        self.mlp = MLP(c, rngs)
        self.norm = RMSNorm(d, c.norm_eps, wd, offset=c.norm_offset)

    # ---- inputs and outputs ----------------------------------------------------------------
    def lift(self, features: Float[Array, "... Df"]) -> Float[Array, "... D"]:
        """The target's features as the head's input feature (fused to D for "fused")."""
        dt = self.config.layer.compute_dtype
        if self.config.num_features == 1:
            return features.astype(dt)
        if self.config.input_norm:  # each tap to rms 1 times its own scale (their raw scales differ ~8x)
            f, d = self.config.num_features, self.config.dim
            x = features.astype(jnp.float32).reshape(features.shape[:-1] + (f, d))
            x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.config.layer.norm_eps)
            scale = self.tap_scale[...].astype(jnp.float32).reshape((1,) * (x.ndim - 2) + (f, d))
            features = (x * scale).reshape(features.shape)
        return features.astype(dt) @ self.fuse[...].astype(dt)

    def _input(self, feature, emb):
        dt = self.config.layer.compute_dtype
        if self.config.input_norm:
            feature, emb = self.feature_norm(feature), self.embed_norm(emb)
        return jnp.concatenate([feature.astype(dt), emb.astype(dt)], axis=-1) @ self.fc[...].astype(dt)

    def logits(self, out: Float[Array, "... D"], weight: Float[Array, "Vd D"]) -> Float[Array, "... Vd"]:
        """Draft logits over the draft vocabulary (`weight`: the LM head's rows for it), read from
        `norm(out)`: normalising keeps the logits' scale in the head's hands from the first step (with `out`
        read as it is, EAGLE-1's way, training CE on SmolLM2 stood at 11.8 after 30 steps, against
        7.7 with the norm; the two runs also differed in learning rate, 3e-3 and 2e-3)."""
        h = self.norm(out)
        return jnp.einsum("...D,VD->...V", h, weight.astype(h.dtype))

    def rest_logit(self, out: Float[Array, "... D"]) -> Float[Array, "..."]:
        """The logit of "a token outside the draft vocabulary" (`rest_class` heads), beside `logits`."""
        h = self.norm(out)
        return jnp.einsum("...D,D->...", h, self.rest[...].astype(h.dtype))

    def cache(self, batch: int, length: int) -> KVCache:
        return KVCache.zeros(self.config.layer, batch, length)

    # ---- drafting: entries written into the head's cache -----------------------------------
    def __call__(self, feature: Float[Array, "B T D"], emb: Float[Array, "B T D"],
                 positions: Int[Array, "B T"], start: Int[Array, "B"], cache: KVCache, *,
                 context: Bool[Array, "B T S"] | None = None,
                 window_mask: Bool[Array, "B T T"] | None = None) -> tuple[Float[Array, "B T D"], KVCache]:
        """T entries written at cache slots `start .. start+T-1` (RoPE at `positions`); each
        attends the cache's slots before `start` (or those `context` allows: a tree's scratch
        slots) and the new entries `window_mask` allows (causal by default). Returns their
        predicted next features and the cache."""
        x = self._input(feature, emb)
        access = Access.of(cache, self.config.layer, positions, start=start, window_mask=window_mask,
                           context=context)
        h, k, v = self.attn(self.attn_norm(x), access, cache.k[0], cache.v[0])
        x = x + h
        return x + self.mlp(self.mlp_norm(x)), cache.replace(k=(k,), v=(v,))

    # ---- training: the unrolled head ----------------------------------------------------------
    def unroll(self, feature: Float[Array, "B T D"], emb: Float[Array, "B T D"],
               steps: int) -> list[Float[Array, "B T D"]]:
        """The head run `steps` times over a sequence, each time on its own previous predictions.

        `feature[:, t]` is the target's (lifted) feature at position t, `emb[:, t]` the embedding
        of token t + 1. Step 0 is teacher-forced; step j feeds entry t with step j-1's prediction
        for position t (`out_{j-1}[t-1]`) and lets it attend step 0's keys at positions <= t - j
        and step i's key at position t - j + i (i = 1..j): at inference the entry at depth j + 1
        sees the committed context and its own draft ancestors, the same set. Returns each
        step's predictions of the feature at t + 1.
        """
        b, t, _ = feature.shape
        pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        keys, values, outs = [], [], []
        g = feature
        for j in range(steps):
            x = self._input(g, emb)
            q, k, v = self.attn.qkv(self.attn_norm(x), pos)
            keys.append(k)
            values.append(v)
            causal = jnp.arange(t)[None, :] <= jnp.arange(t)[:, None] - j  # [T, S]: s <= t - j
            blocks = [Keys(keys[0], values[0], jnp.broadcast_to(causal, (b, t, t)))]
            for i in range(1, j + 1):  # step i's key at position t - (j - i), one per query
                lag = j - i
                shift = lambda a: jnp.pad(a, ((0, 0), (lag, 0), (0, 0), (0, 0)))[:, :t]  # noqa: E731
                ok = jnp.broadcast_to(jnp.arange(t) >= lag, (b, t))
                blocks.append(Keys(shift(keys[i]), shift(values[i]), ok, aligned=True))
            att = attend(q, blocks, self.attn.scale).astype(x.dtype)
            x = x + self.attn.output(att)
            out = x + self.mlp(self.mlp_norm(x))
            outs.append(out)
            g = jnp.pad(out, ((0, 0), (1, 0), (0, 0)))[:, :t]  # entry t reads the prediction for t
        return outs
