"""`specjax.core.tree`: a tree's static topology, the checks on its paths, the traced `Window` of a dynamic
tree, and the move of an accepted path's K/V to consecutive cache slots (`KVCache.compact`)."""

import jax.numpy as jnp
import numpy as np
import pytest

from specjax.core import tree as tree_lib
from specjax.models.kv_cache import KVCache

TREE = ((0,), (1,), (0, 0), (1, 0), (1, 1))  # slots 1..5; 3 under 1, 4 and 5 under 2


def test_topology_of_a_small_tree():
    topo = tree_lib.topology(TREE)
    assert topo.parent.tolist() == [0, 0, 0, 1, 2, 2]
    assert topo.depth.tolist() == [0, 1, 1, 2, 2, 2]
    assert (topo.width, topo.num_nodes, topo.max_depth, topo.is_chain) == (6, 5, 2, False)
    want = np.eye(6, dtype=bool)
    for w, ancestors in {1: [0], 2: [0], 3: [0, 1], 4: [0, 2], 5: [0, 2]}.items():
        want[w, ancestors] = True
    np.testing.assert_array_equal(topo.ancestors, want)  # a node sees its ancestors, never a sibling


def test_a_chain_is_the_causal_window():
    topo = tree_lib.chain_topology(3)
    assert tree_lib.chain(3) == ((0,), (0, 0), (0, 0, 0))
    assert topo.is_chain and (topo.width, topo.max_depth) == (4, 3)
    np.testing.assert_array_equal(topo.ancestors, np.tril(np.ones((4, 4), bool)))
    assert tree_lib.topology(tree_lib.TREES["chain4"]).is_chain


def test_window_from_parents_equals_the_static_topology():
    """The traced window a dynamic-tree proposer builds on device: the same depths and masks as the
    static topology of the same tree, per row."""
    small = tree_lib.topology(tree_lib.TREES["small"])
    other = tree_lib.topology(TREE + ((0, 0, 0),))
    parent = jnp.asarray(np.stack([small.parent, np.pad(other.parent, (0, small.width - other.width))]))
    win = tree_lib.Window.from_parents(parent, max_depth=small.max_depth)
    assert (win.width, win.num_nodes) == (small.width, small.num_nodes)
    np.testing.assert_array_equal(np.asarray(win.depth[0]), small.depth)
    np.testing.assert_array_equal(np.asarray(win.ancestors[0]), small.ancestors)
    n = other.width
    np.testing.assert_array_equal(np.asarray(win.depth[1, :n]), other.depth)
    np.testing.assert_array_equal(np.asarray(win.ancestors[1, :n, :n]), other.ancestors)


@pytest.mark.parametrize("tree, match", [
    ((), "empty"),
    (tree_lib.chain(tree_lib.MAX_TREE_NODES + 1), "at most"),
    (((0,), (-1,)), "ranks >= 0"),
    (((0,), ()), "non-empty"),
    (((0,), (1.5,)), "ranks >= 0"),
    (((0,), (0,)), "twice"),
    (((0, 0), (0,)), "parent"),
    (((0,), (1, 0)), "parent"),
])
def test_validate_tree_refuses_bad_paths(tree, match):
    with pytest.raises(ValueError, match=match):
        tree_lib.validate_tree(tree)


def test_validate_tree_accepts_the_shipped_trees():
    for tree in tree_lib.TREES.values():
        tree_lib.validate_tree(tree)


def _cache(b=2, s=16, layers=2, kv=2, h=3):
    """Every entry names its row, slot and layer: value = 1000 * row + slot + 0.01 * layer (v: negated)."""
    base = 1000.0 * np.arange(b)[:, None] + np.arange(s)[None, :]
    bufs = [np.broadcast_to((base + 0.01 * layer)[:, :, None, None], (b, s, kv, h)).astype(np.float32)
            for layer in range(layers)]
    return KVCache(k=tuple(jnp.asarray(x) for x in bufs), v=tuple(jnp.asarray(-x) for x in bufs), length=s)


def test_compact_moves_the_accepted_path_to_consecutive_slots():
    """Row 0's path runs through window slots 0, 2, 5 (from start 3), row 1's through 0, 1, 3 (from 6):
    their K/V land at start, start + 1, start + 2 in every layer, K and V alike; no other slot moves."""
    cache = _cache()
    start = jnp.asarray([3, 6])
    path = jnp.asarray([[0, 2, 5], [0, 1, 3]])
    moved = cache.compact(start, path)
    for layer in range(2):
        for bufs, sign in ((moved.k, 1), (moved.v, -1)):
            got = np.asarray(bufs[layer][:, :, 0, 0]) * sign
            want = np.asarray(cache.k[layer][:, :, 0, 0]).copy()
            for row, (s, p) in enumerate(zip([3, 6], [[0, 2, 5], [0, 1, 3]])):
                want[row, s: s + 3] = want[row, [s + d for d in p]]
            np.testing.assert_array_equal(got, want)
            assert np.asarray(bufs[layer]).shape == (2, 16, 2, 3)
    # spot checks of the rule itself: slot start + d holds what window slot path[d] held
    assert float(moved.k[0][0, 4, 0, 0]) == 5.0 and float(moved.k[0][0, 5, 0, 0]) == 8.0
    assert float(moved.k[1][1, 8, 0, 0]) == pytest.approx(1009.01) and float(moved.v[0][1, 7, 1, 2]) == -1007.0
