"""Verification windows as trees: the static topology, and the move of an accepted path's K/V.

A verify window is the row's pending token (the root, slot 0) followed by N drafted nodes in the
order their paths are listed (parents first). A chain of K drafts is the degenerate tree whose
node i's parent is node i - 1: its ancestor mask is the causal mask, and its accepted path is
already contiguous in the cache, so both the mask and the K/V move are skipped statically for it.

Node w sits at position `lengths - 1 + depth(w)` and, through the window mask, attends only to the
committed prefix and its own ancestors, so its logits are exactly those a chain forward over its
path would give. After acceptance the accepted path's K/V, written at window slots, are moved to
consecutive cache slots `lengths .. lengths + n - 1`; their RoPE positions were already the final
ones.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int

from specjax.config import Tree, chain
from specjax.models.kv_cache import KVCache


@dataclasses.dataclass(frozen=True, eq=False)
class Topology:
    """Static arrays of a window of W = N + 1 slots (root at slot 0)."""

    parent: np.ndarray  # [W] parent slot (the root is its own parent)
    depth: np.ndarray  # [W]
    ancestors: np.ndarray  # [W, W] bool: slot v is an ancestor of slot w, or w itself

    @property
    def width(self) -> int:
        """W: tokens the target sees per step."""
        return len(self.parent)

    @property
    def num_nodes(self) -> int:
        """N: drafted tokens verified per step."""
        return len(self.parent) - 1

    @property
    def max_depth(self) -> int:
        """D: the most drafts one step can accept."""
        return int(self.depth.max())

    @property
    def is_chain(self) -> bool:
        return bool(np.all(self.parent[1:] == np.arange(self.num_nodes)))


@functools.lru_cache(maxsize=128)
def topology(tree: Tree) -> Topology:
    """The topology of a tree given as paths of ranks, parents first (`()` is the empty window)."""
    slot = {(): 0}
    parent, depth = [0], [0]
    for i, path in enumerate(tree, start=1):
        slot[path] = i
        parent.append(slot[path[:-1]])
        depth.append(len(path))
    w = len(parent)
    anc = np.zeros((w, w), bool)
    for i in range(w):
        j = i
        anc[i, j] = True
        while j != 0:
            j = parent[j]
            anc[i, j] = True
    return Topology(np.asarray(parent), np.asarray(depth), anc)


def chain_topology(k: int) -> Topology:
    return topology(chain(k))


def compact(cache: KVCache, start: Int[Array, "B"], path: Int[Array, "B P"]) -> KVCache:
    """Moves the K/V at window slots `path[:, d]` to cache slot `start + d`, in every layer.

    Gathers P slots and writes P slots per row and layer; nothing cache-sized is copied.
    Slots past the accepted depth receive junk that is never attended (beyond the length).
    """
    src = start[:, None] + path  # absolute source slots [B, P]
    upd = lambda b, m, s: jax.lax.dynamic_update_slice(b, m, (s, 0, 0))

    def move(buf):
        moved = jnp.take_along_axis(buf, src[:, :, None, None], axis=1)  # [B, P, Kv, H]
        return jax.vmap(upd)(buf, moved, start)

    return KVCache(k=tuple(move(b) for b in cache.k), v=tuple(move(b) for b in cache.v))
