"""Medusa heads as a proposer: chain (each head's top-1) or a static candidate tree.

The proposer state is the target's final hidden state at the position whose LM-head output
chose the row's pending token (prefill: the last prompt token; later: the accepted leaf of the
verify window). Head m applied to it predicts the token m + 1 places after the pending one, i.e.
window depth m + 1 of the next verify. Drafts are deterministic (top-k ranks), so q is one-hot
and every lossless rule stays lossless.

Tree nodes are paths of ranks (see `specjax.core.tree.TREES`): node (r_1, ..., r_d) is head d-1's
rank-r_d token, placed after its parent (r_1, ..., r_{d-1}).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax.numpy as jnp
import numpy as np
from flax import nnx, struct
from jaxtyping import Array, Float, Int

from specjax import sharding
from specjax.core import tree as tree_lib
from specjax.core.tree import Tree, chain
from specjax.models.eagle import check_draft_ids
from specjax.models.heads import MedusaHeads
from specjax.models.transformer import Transformer
from specjax.core.state import DecodeState, last_tokens


@struct.dataclass
class MedusaParams(sharding.Logical):
    """The arrays a Medusa proposer reads.

    `lm_head` is the base LM head (`[V, D]` when tied or stored "nk", else `[D, V]`), or only its rows for a subset
    of frequent tokens (`[V', D]`, with `ids [V']` mapping back to the vocabulary; `ids` is None for
    the full vocabulary). Projecting onto the few thousand tokens that make up nearly all generated
    text cuts the heads' cost several-fold; a token outside the subset is simply never proposed,
    which verification tolerates. `embed` feeds `token_input` heads. `lm_axes` names the LM
    head's dimensions, so that on a mesh it is vocabulary-parallel either way round.
    """

    heads: Any  # the heads' nnx.State
    lm_head: Float[Array, "..."]
    ids: Int[Array, "Vd"] | None  # Vd: the subset size
    embed: Float[Array, "V D"]
    lm_axes: tuple[str, str] = struct.field(pytree_node=False, default=("vocab", "embed"))

    def logical_axes(self):
        return dict(heads=None, lm_head=self.lm_axes, ids=(), embed=("vocab", "embed"))


@dataclasses.dataclass(frozen=True, kw_only=True)
class MedusaProposer:
    """Static side of the Medusa proposer.

    Attributes:
      k: chain length, or the tree's depth; at most the number of heads.
      graphdef: the heads' `nnx.GraphDef`.
      tied: the base LM head weight is held as `[V, D]` rows: the embedding, or an own head stored
        in the "nk" layout (`specjax.models.linear`); else an own `[D, V]` head.
      tree: static candidate tree, or None for a chain of k.
    """

    k: int
    graphdef: Any
    tied: bool = True
    tree: Tree | None = None

    @classmethod
    def from_heads(cls, heads: MedusaHeads, target: Transformer, *, k: int | None = None, tree: Tree | None = None,
                   vocab_subset: Sequence[int] | None = None) -> tuple["MedusaProposer", MedusaParams]:
        """(proposer, params) for `heads` on `target`: a chain of `k` heads, or `tree`.

        Raises ValueError (before anything compiles) when the heads do not fit the target, k or the
        tree's depth exceeds the heads, or the tree's ranks exceed the tokens the heads can propose.
        """
        hc, tc = heads.config, target.config
        if hc.dim != tc.dim or hc.vocab_size != tc.vocab_size:
            raise ValueError(f"Medusa heads are for dim {hc.dim} / vocab {hc.vocab_size}, the model has dim "
                             f"{tc.dim} / vocab {tc.vocab_size}: train heads for this model")
        depth = max(len(p) for p in tree) if tree is not None else int(k or hc.num_heads)
        if depth > hc.num_heads:
            raise ValueError(f"medusa k={depth} (or tree depth) exceeds the {hc.num_heads} trained heads: "
                             f"use k <= {hc.num_heads}")
        ids = None
        if not hc.own_projection and vocab_subset is not None:
            ids = check_draft_ids(vocab_subset, tc.vocab_size, what="vocab_subset",
                                  fix=": give token ids of this model (the heads' tuned vocab.json)")
        if tree is not None:
            ranks = 1 + max(p[-1] for p in tree)
            limit = tc.vocab_size if ids is None else len(ids)
            if ranks > limit:
                raise ValueError(f"tree uses rank {ranks - 1}, beyond the {limit} tokens the heads can propose")
        weight, layout = target.lm_head_weight()
        tied = layout == "nk"  # the LM head stored as [V, D] rows
        if ids is not None:
            weight = weight[ids] if tied else weight[:, ids]
        graphdef, params = nnx.split(heads)
        proposer = cls(k=depth, graphdef=graphdef, tied=tied, tree=tree)
        return proposer, MedusaParams(heads=params, lm_head=weight,
                                      ids=None if ids is None else jnp.asarray(ids, jnp.int32),
                                      embed=target.embedding(),
                                      lm_axes=("vocab", "embed") if tied else ("embed", "vocab"))

    @property
    def paths(self) -> Tree:
        return self.tree if self.tree is not None else chain(self.k)

    @property
    def topology(self) -> tree_lib.Topology:
        """Its static window: the candidate tree, or a chain of k."""
        return tree_lib.topology(self.paths)

    @property
    def taps(self) -> tuple[int, ...]:
        return ()  # the heads read the target's final hidden state

    @property
    def shared(self) -> tuple:
        return ()  # no batch-shared state

    def init(self, params: MedusaParams, state: DecodeState, inputs, hidden: Float[Array, "B P D"]):
        """The hidden state at each row's last prompt token."""
        return jnp.take_along_axis(hidden, (inputs.prompt_lengths - 1)[:, None, None], axis=1)[:, 0]

    def head_logits(self, params: MedusaParams, hidden: Float[Array, "B D"],
                    tokens: Int[Array, "B"]) -> Float[Array, "B M V"]:
        """Logits of the first k heads at each row's hidden state (`tokens`: the pending token,
        read by heads trained with `token_input`)."""
        heads = nnx.merge(self.graphdef, params.heads)
        emb = jnp.take(params.embed, tokens, axis=0, mode="clip") if heads.config.token_input else None
        f = heads.features(hidden, emb)[:, : self.k]  # project only the heads this proposer uses
        if heads.config.own_projection:
            return jnp.einsum("BMD,MDV->BMV", f, heads.proj[...][: self.k].astype(f.dtype))
        w = params.lm_head.astype(f.dtype)
        return jnp.einsum("BMD,VD->BMV", f, w) if self.tied else jnp.einsum("BMD,DV->BMV", f, w)

    def propose(self, params: MedusaParams, hidden, state: DecodeState, sampling_config, keys):
        logits = self.head_logits(params, hidden, last_tokens(state))
        paths = self.paths
        _, top = sharding.top_k(logits, 1 + max(p[-1] for p in paths))  # [B, M, R]; no batch gather on a mesh
        if params.ids is not None:
            top = params.ids[top]  # subset index -> token id
        head = np.asarray([len(p) - 1 for p in paths])
        rank = np.asarray([p[-1] for p in paths])
        return top[:, head, rank].astype(jnp.int32), None, hidden

    def reconcile(self, params, hidden, state, verify, accepted):
        """Keeps the hidden state at the accepted leaf's window slot."""
        return jnp.take_along_axis(verify.hidden, accepted.leaf[:, None, None], axis=1)[:, 0]

