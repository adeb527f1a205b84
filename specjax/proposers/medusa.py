"""Medusa heads as a proposer: chain (each head's top-1) or a static candidate tree.

The proposer state is the target's final hidden state at the position whose LM-head output
chose the row's pending token (prefill: the last prompt token; later: the last accepted
position of the verify window). Head m applied to it predicts the token m + 1 places after
the pending one, i.e. window slot m + 1 of the next verify. Drafts are deterministic (top-k
ranks), so q is one-hot and the usual acceptance rules stay lossless.

Tree nodes are paths of ranks (see `specjax.config.TREES`): node (r_1, ..., r_d) is head
d-1's rank-r_d token, placed after its parent (r_1, ..., r_{d-1}).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from specjax.config import Tree
from specjax.state import DecodeState, last_tokens


@dataclasses.dataclass(frozen=True, kw_only=True)
class MedusaProposer:
    """Static side of the Medusa proposer.

    `params` = (heads params, LM head weight, token ids, embedding): the weight is the base LM head
    (`[V, D]` when tied, else `[D, V]`), or only its rows for a subset of frequent tokens
    (`[V', D]`, with `ids [V']` mapping back to the vocabulary; `ids` is None for the full
    vocabulary); the embedding feeds `token_input` heads. Projecting onto the few thousand tokens
    that make up nearly all generated text cuts the heads' cost several-fold; a draft outside the subset is simply never proposed,
    which verification tolerates (drafts may be anything, acceptance stays exact).

    Attributes:
      k: chain length, or the tree's depth; at most the number of heads.
      graphdef: the heads' `nnx.GraphDef`.
      tied: the base LM head weight is the embedding `[V, D]` (else an own `[D, V]` head).
      tree: static candidate tree, or None for a chain.
      typical: (epsilon, delta) of Medusa's LOSSY typical acceptance, or None (lossless).
    """

    k: int
    graphdef: Any
    tied: bool = True
    tree: Tree | None = None
    typical: tuple[float, float] | None = None

    def init(self, params, state: DecodeState, prompts, hidden: Float[Array, "B D"]):
        return hidden

    def head_logits(self, params, hidden: Float[Array, "B D"],
                    tokens: Int[Array, "B"]) -> Float[Array, "B M V"]:
        """Logits of the first k heads at each row's hidden state (`tokens`: the pending token,
        read by heads trained with `token_input`)."""
        heads_params, w, _, embed = params
        heads = nnx.merge(self.graphdef, heads_params)
        emb = jnp.take(embed, tokens, axis=0) if heads.config.token_input else None
        f = heads.features(hidden, emb)[:, : self.k]  # project only the heads this proposer uses
        if heads.config.own_projection:
            return jnp.einsum("BMD,MDV->BMV", f, heads.proj[...][: self.k].astype(f.dtype))
        w = w.astype(f.dtype)
        return jnp.einsum("BMD,VD->BMV", f, w) if self.tied else jnp.einsum("BMD,DV->BMV", f, w)

    def propose(self, params, hidden, state: DecodeState, sampling_config, keys):
        logits = self.head_logits(params, hidden, last_tokens(state))
        ranks = 1 if self.tree is None else 1 + max(p[-1] for p in self.tree)
        _, top = jax.lax.top_k(logits, ranks)  # [B, M, R]
        if params[2] is not None:
            top = params[2][top]  # subset index -> token id
        if self.tree is None:
            return top[..., 0].astype(jnp.int32), None, hidden
        head = jnp.asarray([len(p) - 1 for p in self.tree])
        rank = jnp.asarray([p[-1] for p in self.tree])
        return top[:, head, rank].astype(jnp.int32), None, hidden

    def reconcile(self, params, hidden, state, verify_hidden: Float[Array, "B W D"],
                  last: Int[Array, "B"]):
        """Keeps the hidden state at window slot `last`: the last accepted position (for a
        chain this is the number of accepted drafts; for a tree, the accepted leaf's slot)."""
        return jnp.take_along_axis(verify_hidden, last[:, None, None], axis=1)[:, 0]
