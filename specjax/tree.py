"""Tree speculation: verify a static candidate tree in one target forward, accept a path.

The verify window is the row's pending token (the root, slot 0) followed by the N tree nodes
in the order their paths are listed (parents first). Node w sits at position
`lengths - 1 + depth(w)` and, through the window mask, attends only to the committed prefix and
its own ancestors, so its logits are exactly those a chain forward over its path would give.

Acceptance walks the tree from the root: draw x from the target at the current node (argmax
for greedy); if a child carries x, move to it and repeat; otherwise emit x. Children of a node
are distinct tokens (ranks of one head), so at most one child matches: this is SpecInfer's rule
for deterministic drafts, and the emitted tokens are distributed exactly as sampling from the
target one token at a time, because every emitted token is a draw from p at its prefix. Draws at
all nodes are taken up front (independent keys); only the visited nodes' draws are used.

After acceptance the accepted path's K/V, written at window slots, are moved to consecutive
cache slots `lengths .. lengths + n - 1`; their RoPE positions were already the final ones.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from specjax import sampling
from specjax.config import Tree
from specjax.models.kv_cache import KVCache
from specjax.models.llama import Llama, Output
from specjax.sampling import SamplingConfig, SamplingParams
from specjax.state import DecodeState, last_tokens


@dataclasses.dataclass(frozen=True)
class Topology:
    """Static arrays of a tree window (root at slot 0). W = N + 1 slots."""

    parent: np.ndarray  # [W] parent slot (the root is its own parent)
    depth: np.ndarray  # [W]
    ancestors: np.ndarray  # [W, W] bool: slot v is an ancestor of slot w, or w itself

    @property
    def max_depth(self) -> int:
        return int(self.depth.max())


@functools.lru_cache(maxsize=64)
def topology(tree: Tree) -> Topology:
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


def verify(target: Llama, state: DecodeState, nodes: Int[Array, "B N"], topo: Topology) -> Output:
    """One target forward over [pending token, tree nodes] with the tree attention mask."""
    window = jnp.concatenate([last_tokens(state)[:, None], nodes], axis=1)
    start = state.lengths - 1
    positions = start[:, None] + jnp.asarray(topo.depth)[None, :]
    mask = jnp.broadcast_to(jnp.asarray(topo.ancestors), (window.shape[0],) + topo.ancestors.shape)
    return target(window, positions, state.cache, start=start, window_mask=mask)


def _draws(config: SamplingConfig, keys: Array, logits: Float[Array, "B W V"],
           params: SamplingParams) -> Int[Array, "B W"]:
    """The target's token at every slot: argmax, or an independent draw per slot."""
    if config.method == "greedy":
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    slot_keys = jax.vmap(lambda k: jax.random.split(k, logits.shape[1]))(keys)  # [B, W]
    draw = lambda k, l: sampling.sample(config, k, l, params)
    return jax.vmap(draw, in_axes=(1, 1), out_axes=1)(slot_keys, logits)


def _typical_ok(logits, nodes, topo: Topology, params: SamplingParams, eps_delta):
    """LOSSY (Medusa typical acceptance): p(x) > min(eps, delta * exp(-H(p))) at the parent."""
    eps, delta = eps_delta
    p = sampling.probs(logits, params)  # [B, W, V]
    p_par = p[:, topo.parent[1:]]  # [B, N, V]
    p_x = jnp.take_along_axis(p_par, nodes[..., None], axis=-1)[..., 0]
    ent = -jnp.sum(jnp.where(p_par > 0, p_par * jnp.log(jnp.where(p_par > 0, p_par, 1.0)), 0.0), -1)
    return p_x > jnp.minimum(eps, delta * jnp.exp(-ent))


def accept(config: SamplingConfig, keys: Array, nodes: Int[Array, "B N"],
           logits: Float[Array, "B W V"], params: SamplingParams, topo: Topology,
           typical: tuple[float, float] | None = None):
    """Walks the tree; returns (accepted depth n [B], leaf slot [B], path slots [B, D+1], next token).

    `path[:, d]` is the slot of the accepted node at depth d (0 = root) for d <= n.
    """
    x = _draws(config, keys, logits, params)  # [B, W]
    ok = nodes == x[:, topo.parent[1:]]  # node's token is what the target drew at its parent
    if typical is not None and config.method == "sample":
        ok = _typical_ok(logits, nodes, topo, params, typical)
    ok = jnp.concatenate([jnp.ones_like(ok[:, :1]), ok], axis=1)  # the root is always kept
    anc = jnp.asarray(topo.ancestors)
    reached = ~jnp.any(anc[None] & ~ok[:, None, :], axis=-1)  # [B, W]: the whole path matches
    depth = jnp.asarray(topo.depth)
    leaf = jnp.argmax(jnp.where(reached, depth[None], -1), axis=1)  # deepest; ties: first listed
    n = depth[leaf]
    on_path = anc[leaf]  # [B, W]: ancestors of the leaf
    d = jnp.arange(topo.max_depth + 1)
    at_depth = on_path[:, None, :] & (depth[None, None, :] == d[None, :, None])  # [B, D+1, W]
    path = jnp.argmax(at_depth, axis=-1)  # slot of the path node at each depth (0 past the leaf)
    nxt = jnp.take_along_axis(x, leaf[:, None], axis=1)[:, 0]
    if typical is not None and config.method == "sample":
        nxt = sampling.sample(config, jax.vmap(lambda k: jax.random.fold_in(k, 7))(keys),
                              jnp.take_along_axis(logits, leaf[:, None, None], axis=1)[:, 0], params)
    return n, leaf, path, nxt


def compact(cache: KVCache, start: Int[Array, "B"], path: Int[Array, "B P"]) -> KVCache:
    """Moves the K/V at window slots `path[:, d]` to cache slot `start + d`, in every layer.

    Gathers P slots and writes P slots per row and layer; nothing cache-sized is copied.
    Slots past the accepted depth receive junk that is never attended (beyond the length).
    """
    src = start[:, None] + path  # absolute source slots [B, P]
    upd = lambda b, m, s: jax.lax.dynamic_update_slice(b, m, (s, 0, 0))

    def move(buf):
        moved = jnp.take_along_axis(buf, src[:, :, None, None], axis=1)  # [B, P, K, H]
        return jax.vmap(upd)(buf, moved, start)

    return KVCache(k=tuple(move(b) for b in cache.k), v=tuple(move(b) for b in cache.v))
