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
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int

from flax import struct


MAX_TREE_NODES = 64

Tree = tuple[tuple[int, ...], ...]

# Static candidate trees for Medusa heads, as paths of top-k ranks (Medusa's `medusa_choices`):
# (0,) is head 0's top-1, (0, 1) is head 1's top-2 after head 0's top-1, and so on.
TREES: dict[str, Tree] = {
    "chain4": ((0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)),
    "small": ((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 0, 0, 0)),
    "medium": ((0,), (1,), (2,), (3,), (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0),
               (0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0), (0, 0, 0, 0), (0, 0, 0, 1)),
}


def parse_tree(text: str | None) -> Tree | str | None:
    """A `--tree` flag: a name (kept as is, resolved by the method's options) or paths as JSON."""
    if text is not None and text.lstrip().startswith("["):
        import json

        return tuple(tuple(p) for p in json.loads(text))
    return text


def chain(k: int) -> Tree:
    return tuple((0,) * i for i in range(1, k + 1))


def as_tree(tree: str | Sequence) -> Tree:
    """A tree given by name (one of `TREES`) or as paths, as a checked `Tree` of int tuples."""
    if isinstance(tree, str):
        if tree not in TREES:
            raise ValueError(f"unknown tree {tree!r}: use one of {', '.join(TREES)} or a tuple of paths")
        return TREES[tree]
    out = tuple(tuple(int(r) for r in p) for p in tree)
    validate_tree(out)
    return out


def validate_tree(tree: Sequence) -> None:  # a Tree, checked here
    if not tree:
        raise ValueError("tree is empty: give at least one path, e.g. ((0,),)")
    if len(tree) > MAX_TREE_NODES:
        raise ValueError(f"tree has {len(tree)} nodes: at most {MAX_TREE_NODES} are supported")
    seen = set()
    for path in tree:
        if not path or any(int(r) != r or r < 0 for r in path):
            raise ValueError(f"tree path {path!r}: must be a non-empty tuple of ranks >= 0")
        if path in seen:
            raise ValueError(f"tree path {path!r} appears twice")
        if len(path) > 1 and path[:-1] not in seen:
            raise ValueError(f"tree path {path!r} comes before (or without) its parent {path[:-1]!r}; "
                             "list parents first")
        seen.add(path)


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


@dataclasses.dataclass(frozen=True)
class DynamicTopology:
    """The static side of a window whose tree a proposer builds on device each step (EAGLE-2's
    dynamic tree): only its node budget N and its deepest level are fixed; the parents, depths and
    ancestor masks of each row arrive with the drafts as a `Window`."""

    num_nodes: int
    max_depth: int
    is_chain: bool = False

    @property
    def width(self) -> int:
        return self.num_nodes + 1


@struct.dataclass
class Window:
    """A traced topology, one tree per row (same fields as `Topology`, with a leading batch axis).

    Slot 0 is the root (the pending token); a node's parent precedes it.
    """

    parent: Int[Array, "B W"]
    depth: Int[Array, "B W"]
    ancestors: Array  # [B, W, W] bool
    max_depth: int = struct.field(pytree_node=False)

    @classmethod
    def from_parents(cls, parent: Int[Array, "B W"], max_depth: int) -> "Window":
        """Depths and ancestor masks from parent slots (the root, slot 0, is its own parent)."""
        b, w = parent.shape
        eye = jnp.broadcast_to(jnp.eye(w, dtype=bool), (b, w, w))
        anc, cur, depth = eye, jnp.broadcast_to(jnp.arange(w), (b, w)), jnp.zeros((b, w), jnp.int32)
        for _ in range(max_depth):  # walk every slot up one level at a time
            up = jnp.take_along_axis(parent, cur, axis=1)
            depth = depth + (cur != 0).astype(jnp.int32)
            anc = anc | jax.nn.one_hot(up, w, dtype=bool)
            cur = up
        return cls(parent=parent, depth=depth, ancestors=anc, max_depth=max_depth)

    @property
    def width(self) -> int:
        return self.parent.shape[1]

    @property
    def num_nodes(self) -> int:
        return self.parent.shape[1] - 1

    is_chain = False


@struct.dataclass
class DraftTree:
    """What a dynamic-tree proposer drafts: the nodes' tokens `[B, K]` and the tree they form."""

    tokens: Int[Array, "B K"]
    window: Window


def drafted(drafts: "Array | DraftTree", topo: "AnyTopology") -> "tuple[Array, AnyTopology]":
    """A proposer's drafts as (tokens [B, K], the topology they are verified on): a `DraftTree`
    carries its own traced trees; plain tokens are laid out on the decoder's static `topo`."""
    if isinstance(drafts, DraftTree):
        return drafts.tokens, drafts.window
    return drafts, topo


# What a step verifies against: a static tree (or chain), a dynamic tree's static bounds, or the
# traced per-row trees a dynamic-tree proposer drafted.
AnyTopology = Topology | DynamicTopology | Window


def at_parents(x: Array, topo: "Topology | Window") -> Array:
    """`x[:, parent(w)]` for every drafted node w: the value at each node's parent slot."""
    if isinstance(topo, Window):
        idx = topo.parent[:, 1:].reshape(topo.parent.shape[:1] + (-1,) + (1,) * (x.ndim - 2))
        return jnp.take_along_axis(x, idx, axis=1)
    return x[:, topo.parent[1:]]


def batched(topo: "Topology | Window", batch: int) -> tuple[Array, Array]:
    """(depth [B, W], ancestors [B, W, W]) of a static or traced topology."""
    depth, anc = jnp.asarray(topo.depth), jnp.asarray(topo.ancestors)
    return (jnp.broadcast_to(depth, (batch,) + depth.shape[-1:]),
            jnp.broadcast_to(anc, (batch,) + anc.shape[-2:]))


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

