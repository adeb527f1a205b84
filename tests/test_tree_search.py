"""Tree search: greedy trees maximise expected tau; the size trades tau against verify cost."""

import itertools

import numpy as np

from specjax.methods.config import validate_tree
from specjax.methods.tree_search import best_tree, choose_tree, expected_tau

ACC = np.array([[0.6, 0.15, 0.05], [0.4, 0.1, 0.05], [0.3, 0.1, 0.02]])


def all_trees(acc, n):
    """Every valid tree of n nodes over acc's heads and ranks (brute force, small only)."""
    m, r = acc.shape
    paths = [p for d in range(1, m + 1) for p in itertools.product(range(r), repeat=d)]
    for combo in itertools.combinations(paths, n):
        s = set(combo)
        if all(len(p) == 1 or p[:-1] in s for p in combo):
            yield tuple(sorted(combo, key=len))


def test_expected_tau_of_a_chain():
    assert abs(expected_tau(((0,), (0, 0)), ACC) - (1 + 0.6 + 0.6 * 0.4)) < 1e-12


def test_best_tree_is_optimal_for_its_size():
    for n in (1, 2, 3, 4, 5):
        tree = best_tree(ACC, n)
        validate_tree(tree)
        assert len(tree) == n
        best = max(expected_tau(t, ACC) for t in all_trees(ACC, n))
        assert abs(expected_tau(tree, ACC) - best) < 1e-12


def test_choose_tree_trades_tau_against_cost():
    flat = {1: 1.0, 64: 1.0}  # verifying more is free: take the biggest tree
    tree, speed = choose_tree(ACC, flat, max_nodes=12)
    assert len(tree) == 12 and speed == expected_tau(tree, ACC)
    steep = {1: 1.0, 2: 1.1, 3: 3.0, 64: 100.0}  # beyond one draft verification gets expensive
    tree, speed = choose_tree(ACC, steep, max_nodes=12)
    assert tree == ((0,),) and abs(speed - 1.6 / 1.1) < 1e-12


def test_subtree_of_measured_rates_is_the_best_tree_of_each_size():
    """Per-node rates measured on a wide template (a child is never kept more often than its parent):
    `subtree` keeps the n most kept nodes, a valid tree in the template's order, and its tau is
    the best over every subtree of that size; `choose_subtree` trades it against the window cost."""
    from specjax.methods.tree_search import choose_subtree, subtree

    wide = ((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (1, 0, 0))
    rate = [0.6, 0.2, 0.1, 0.45, 0.1, 0.15, 0.3, 0.05, 0.1]
    kept = dict(zip(wide, rate))
    for n in range(1, len(wide) + 1):
        tree = subtree(wide, rate, n)
        validate_tree(tree)
        assert len(tree) == n and list(tree) == [p for p in wide if p in tree]
        closed = [c for c in itertools.combinations(wide, n) if all(len(p) == 1 or p[:-1] in c for p in c)]
        assert abs(sum(kept[p] for p in tree) - max(sum(kept[p] for p in c) for c in closed)) < 1e-12
    tree, speed, table = choose_subtree(wide, rate, {1: 1.0, 10: 1.0}, [2, 4, 9])
    assert len(tree) == 9 and table[9]["tau"] == round(1 + sum(rate), 4)
    tree, speed, _ = choose_subtree(wide, rate, {1: 1.0, 3: 1.0, 5: 2.0, 10: 10.0}, [2, 4, 9])
    assert tree == ((0,), (0, 0)) and abs(speed - 2.05) < 1e-12
