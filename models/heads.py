"""Medusa-style draft heads on the target's final hidden state (Cai et al. 2024).

Head m (m = 0 .. M-1) reads the final-normed hidden state h_t that the base LM head reads at
position t and predicts the token at t + m + 2 (the base LM head itself predicts t + 1). Each head
is `L` residual SiLU blocks, `x <- x + silu(x W + b)`, then a vocabulary projection: the frozen
base LM head by default (the heads stay a few MB), or an own projection initialised from a copy
of it. W and b start at zero, so at init `silu(0) = 0` and every head predicts exactly what the
base LM head predicts. The M heads' parameters are stacked, so all of them run as one einsum.

Dimension letters: M heads, L blocks per head, E the block's output dim (= D); the rest as in
`specjax.models.config`.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol, runtime_checkable

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from specjax.models.transformer import Transformer


@dataclasses.dataclass(frozen=True, kw_only=True)
class HeadsConfig:
    """Shape of a set of Medusa heads. Hashable (static under jit) and saved in manifests.

    Attributes:
      num_heads: M; head m predicts the token m + 2 positions ahead.
      num_layers: residual SiLU blocks per head.
      dim: the target's hidden size D.
      vocab_size: the target's vocabulary V.
      own_projection: give each head its own [D, V] projection instead of sharing the frozen
        base LM head (M * D * V more parameters).
      token_input: also feed each head the embedding of the token at t + 1 (known when the
        heads run: it is the token the base LM head just chose), through a zero-initialised
        [D, D] map per head, as EAGLE and Hydra do. Plain Medusa heads see h_t only.
    """

    num_heads: int = 4
    num_layers: int = 1
    dim: int
    vocab_size: int
    own_projection: bool = False
    token_input: bool = False

    def __post_init__(self):
        for f in ("num_heads", "num_layers", "dim", "vocab_size"):
            v = getattr(self, f)
            if int(v) != v or v < 1:
                raise ValueError(f"HeadsConfig.{f}={v}: must be an integer >= 1")

    @classmethod
    def for_model(cls, model_config, **kw) -> "HeadsConfig":
        return cls(dim=model_config.dim, vocab_size=model_config.vocab_size, **kw)


@runtime_checkable
class HasLMHead(Protocol):
    """What own-projection heads are initialised from: a `Transformer`, or a stand-in that gives
    its LM head's shape (`heads_io.abstract_heads`)."""

    def lm_head_weight(self) -> tuple: ...


class MedusaHeads(nnx.Module):
    """M stacked Medusa heads. Call with the base model to get logits `[..., M, V]`.

    Example:
      >>> heads = MedusaHeads(HeadsConfig.for_model(model.config), base=model, rngs=nnx.Rngs(0))
      >>> logits = heads(out.hidden, model)  # [B, T, M, V]
    """

    def __init__(self, config: HeadsConfig, *, base: HasLMHead | None = None, rngs: nnx.Rngs | None = None):
        self.config = config
        m, l, d = config.num_heads, config.num_layers, config.dim
        self.w = nnx.Param(jnp.zeros((m, l, d, d), jnp.float32), axes=("draft_heads", "layers", "embed", "embed"))
        self.b = nnx.Param(jnp.zeros((m, l, d), jnp.float32), axes=("draft_heads", "layers", "embed"))
        if config.token_input:
            self.u = nnx.Param(jnp.zeros((m, d, d), jnp.float32), axes=("draft_heads", "embed", "embed"))
        if config.own_projection:
            if base is None:
                raise ValueError("own_projection heads are initialised from the base LM head: pass base=")
            w_DV = base_head(base).astype(jnp.float32)
            self.proj = nnx.Param(jnp.broadcast_to(w_DV, (m,) + w_DV.shape).copy(),
                                  axes=("draft_heads", "embed", "vocab"))

    def features(self, hidden: Float[Array, "... D"],
                 token_embed: Float[Array, "... D"] | None = None) -> Float[Array, "... M D"]:
        """The heads' residual blocks; what each head feeds to its vocabulary projection.

        `token_embed` (the embedding of the token at t + 1) is required iff `config.token_input`.
        """
        x = jnp.broadcast_to(hidden[..., None, :], hidden.shape[:-1] + (self.config.num_heads, hidden.shape[-1]))
        if self.config.token_input:
            if token_embed is None:
                raise ValueError("these heads take the next token as input (token_input=True): pass it")
            x = x + jnp.einsum("...D,MDO->...MO", token_embed.astype(x.dtype), self.u[...].astype(x.dtype))
        w = self.w[...].astype(hidden.dtype)
        b = self.b[...].astype(hidden.dtype)
        lead = (1,) * (x.ndim - 2)
        for i in range(self.config.num_layers):
            y = jnp.einsum("...MD,MDO->...MO", x, w[:, i]) + b[:, i].reshape(lead + b.shape[::2])
            x = x + jax.nn.silu(y)
        return x

    def __call__(self, hidden: Float[Array, "... D"], base: Transformer,
                 tokens: Int[Array, "..."] | None = None) -> Float[Array, "... M V"]:
        """Logits of every head; `tokens` (the token at t + 1) only for `token_input` heads."""
        emb = None
        if self.config.token_input and tokens is not None:
            emb = base.embedding(tokens)  # clipped: no NaN for any id
        f = self.features(hidden, emb)
        if self.config.own_projection:
            return jnp.einsum("...MD,MDV->...MV", f, self.proj[...].astype(f.dtype))
        return base.logits(f)


def base_head(base: HasLMHead) -> Float[Array, "D V"]:
    """The base model's LM head as a [D, V] matrix (the tied embedding, transposed)."""
    w, layout = base.lm_head_weight()
    return w.T if layout == "nk" else w
