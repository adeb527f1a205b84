"""Token recycling as a proposer: a static draft tree filled from the target's own past distributions.

The template is a static tree of ranks (`SpecConfig.tree`, as Medusa's: parents first): node
(r_1, ..., r_d) is the rank-r_d candidate after its parent's token. Level by level, each node's
candidates are one gather from the batch's recycling state (`matrix.RecycleSpec.rows`, keyed by its
parent's token and grandparent's), so drafting costs no model call. The window is verified by the
tree path of the Decoder.

Prompt lookup on the spine (`recycle_spine` = L > 0): where the row's own context, or the
cross-request n-gram table, holds a match of at least L tokens, the match's followers fill the
template's rank-0 chain (the spine), and the spine nodes' other children are the matrix's
candidates with the spine token taken out, so siblings stay distinct tokens.

The drafts are a function of committed text and of the shared state before this step, never of
this step's random draws: q is one-hot, greedy output equals plain decoding, and sampling is
lossless under the tree rule (`acceptance.SpecInfer`), which needs exactly that and distinct
siblings.
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Int

from specjax.core import ngram_table, tree
from specjax.core.ngram_table import TableConfig
from specjax.core.proposer import Stateless
from specjax.core.state import DecodeState, last_tokens
from specjax.methods.recycle.matrix import RecycleParams, RecycleSpec


@dataclasses.dataclass(frozen=True)
class Levels:
    """The template's static index arrays, one entry per depth: each level's window slots, their
    parents' slots, their ranks, and whether their parent is on the spine (the root included)."""

    slots: tuple[np.ndarray, ...]
    parents: tuple[np.ndarray, ...]
    ranks: tuple[np.ndarray, ...]
    on_spine: tuple[np.ndarray, ...]
    spine: int  # depth of the rank-0 chain

    @classmethod
    @functools.lru_cache(maxsize=64)
    def of(cls, template: tree.Tree) -> "Levels":
        topo = tree.topology(template)
        depth = np.asarray(topo.depth)
        spine = 0
        while (0,) * (spine + 1) in template:
            spine += 1
        spine_slots = {0} | {i + 1 for i, p in enumerate(template) if all(r == 0 for r in p)}
        out = ([], [], [], [])
        for d in range(1, int(depth.max()) + 1):
            slots = np.flatnonzero(depth == d)
            par = np.asarray(topo.parent)[slots]
            out[0].append(slots)
            out[1].append(par)
            out[2].append(np.asarray([template[s - 1][-1] for s in slots]))
            out[3].append(np.asarray([p in spine_slots for p in par]))
        return cls(*(tuple(x) for x in out), spine=spine)


def spine_merge(cand: Int[Array, "B N K"], spine_tok: Int[Array, "B"], use: Bool[Array, "B N"],
                ranks: np.ndarray) -> Int[Array, "B N"]:
    """The rank-`ranks[i]` child of node i: its candidates, or where `use` holds, the spine token
    first and the candidates after it with that token taken out (distinct either way)."""
    b, n, k = cand.shape
    r = jnp.asarray(ranks)[None, :]
    at = jnp.where(cand == spine_tok[:, None, None], jnp.arange(k), k).min(axis=-1)  # [B, N], k: absent
    shifted = jnp.where(r - 1 < at, r - 1, r)  # candidate index of rank r >= 1 once s is first
    merged = jnp.take_along_axis(cand, jnp.clip(shifted, 0, k - 1)[..., None], axis=-1)[..., 0]
    merged = jnp.where(r == 0, spine_tok[:, None], merged)
    plain = jnp.take_along_axis(cand, jnp.broadcast_to(r, (b, n))[..., None], axis=-1)[..., 0]
    return jnp.where(use, merged, plain)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RecycleProposer(Stateless):
    """Static side of the recycling proposer.

    Attributes:
      k: the template's depth.
      template: the draft tree (paths of ranks, parents first); its ranks are below `spec.k`.
      spec: the batch-shared state it reads (and the Decoder writes).
      spine: the shortest prompt-lookup match that fills the rank-0 chain (0: off).
      spine_max: the longest n-gram the spine looks up.
      table: the cross-request n-gram table the spine also reads, or None.
    """

    k: int
    template: tree.Tree
    spec: RecycleSpec
    spine: int = 2
    spine_max: int = 4
    table: TableConfig | None = None

    @property
    def paths(self) -> tree.Tree:
        return self.template

    @property
    def shared(self) -> tuple:
        return (self.spec,) + (() if self.table is None else (self.table,))

    def _spine(self, state: DecodeState, depth: int):
        """(tokens [B, depth], found [B]): the prompt-lookup match that fills the spine."""
        draft, found = ngram_table.match(state.tokens, state.lengths, depth, self.spine, self.spine_max)
        if self.table is not None:
            shared, hit = ngram_table.lookup(state.shared.parts[self.table.name], state.tokens, state.lengths,
                                             depth, state.tenant)
            draft = jnp.where((~found & hit)[:, None], shared, draft)
            found = found | hit
        return draft, found

    def propose(self, params: RecycleParams, pstate, state: DecodeState, sampling_config, keys):
        live = state.shared.parts[self.spec.name]
        lv = Levels.of(self.template)
        b = state.lengths.shape[0]
        tenant = jnp.zeros((b,), jnp.int32) if state.tenant is None else state.tenant.astype(jnp.int32)
        root = last_tokens(state)
        before = jnp.take_along_axis(state.tokens, jnp.maximum(state.lengths - 2, 0)[:, None], axis=1)[:, 0]
        toks = jnp.zeros((b, len(self.template) + 1), jnp.int32).at[:, 0].set(root)
        prevs = jnp.full_like(toks, -1).at[:, 0].set(jnp.where(state.lengths >= 2, before, -1))
        spine = self._spine(state, lv.spine) if self.spine and lv.spine else None
        for d, (slots, par, ranks, on_spine) in enumerate(zip(lv.slots, lv.parents, lv.ranks, lv.on_spine), 1):
            u, g = toks[:, par], prevs[:, par]
            cand = self.spec.rows(live, params, g, u, tenant)  # [B, n_d, K]
            if spine is not None and d <= lv.spine and on_spine.any():
                use = spine[1][:, None] & jnp.asarray(on_spine)[None, :]
                new = spine_merge(cand, spine[0][:, d - 1], use, ranks)
            else:
                new = jnp.take_along_axis(cand, jnp.broadcast_to(jnp.asarray(ranks), u.shape)[..., None], axis=-1)[..., 0]
            toks = toks.at[:, slots].set(new)
            prevs = prevs.at[:, slots].set(u)
        return toks[:, 1:], None, pstate
