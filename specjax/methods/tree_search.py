"""Choosing a Medusa candidate tree from measured head accuracies and verify costs.

With `acc[m, r]` the probability that head m's rank-r token is the right one (given that the
path before it was right), a node (r_1, ..., r_d) is accepted with probability
prod_i acc[i-1, r_i] (heads treated as independent, as Medusa does), and the expected tokens
per target forward are tau = 1 + sum over nodes of that probability. A node's probability never
exceeds its parent's, so adding nodes greedily by probability gives the best tree of each size.
The size is then chosen for speed: tau / cost(window), with the cost of a verify window
measured on the machine (`specjax.bench.offline.window_costs`), relative to a plain step.
"""

from __future__ import annotations

import heapq

import numpy as np

from specjax.core.tree import Tree


def path_probability(path: tuple[int, ...], acc: np.ndarray) -> float:
    return float(np.prod([acc[i, r] for i, r in enumerate(path)]))


def expected_tau(tree: Tree, acc: np.ndarray) -> float:
    """Expected tokens per target forward (bonus included) of `tree` under `acc`."""
    return 1.0 + sum(path_probability(p, acc) for p in tree)


def best_tree(acc: np.ndarray, num_nodes: int) -> Tree:
    """The tree of `num_nodes` nodes with the largest expected tau (parents listed first).

    Args:
      acc: [M, R] accuracy of head m's rank-r candidate.
      num_nodes: nodes in the tree (the verify window is one more).
    """
    acc = np.asarray(acc, np.float64)
    m, r = acc.shape
    heap = [(-acc[0, j], (j,)) for j in range(r)]
    heapq.heapify(heap)
    tree: list[tuple[int, ...]] = []
    while heap and len(tree) < num_nodes:  # children enter the heap only after their parent
        neg, path = heapq.heappop(heap)
        tree.append(path)
        if len(path) < m:
            for j in range(r):
                heapq.heappush(heap, (neg * acc[len(path), j], path + (j,)))
    return tuple(tree)


def choose_tree(acc: np.ndarray, costs: dict[int, float], max_nodes: int = 32) -> tuple[Tree, float]:
    """The tree maximising expected speed tau / cost(window) over sizes 1 .. max_nodes.

    Args:
      acc: [M, R] head accuracies by rank.
      costs: measured cost of a step by verify window size (a plain step at window 1 is the
        unit); sizes in between are interpolated linearly.
    Returns:
      (tree, expected speedup over plain).
    """
    sizes = np.array(sorted(costs))
    vals = np.array([costs[s] for s in sizes])
    best, best_speed = None, 0.0
    for n in range(1, max_nodes + 1):
        tree = best_tree(acc, n)
        cost = float(np.interp(n + 1, sizes, vals))
        speed = expected_tau(tree, acc) / cost
        if speed > best_speed:
            best, best_speed = tree, speed
    return best, best_speed


def subtree(paths: Tree, p, n: int) -> Tree:
    """The `n` nodes of `paths` most often accepted (`p[i]`: how often node i was kept per step),
    listed in `paths`' order. A node is kept only with its parent, so its rate never exceeds its
    parent's and the nodes chosen form a tree (ties go to the shallower node)."""
    order = sorted(range(len(paths)), key=lambda i: (-p[i], len(paths[i]), i))
    keep = sorted(order[:n])
    return tuple(paths[i] for i in keep)


def choose_subtree(paths: Tree, p, costs: dict[int, float], sizes) -> tuple[Tree, float, dict[int, dict]]:
    """Of the best subtree of each size in `sizes` (`subtree`), the one with the best expected speed
    tau / cost(window), tau = 1 + the kept rates of its nodes (measured, not modelled: a node's
    drafts do not depend on the other nodes of the tree). Returns (tree, its speed, every size's
    tau and speed)."""
    grid = np.array(sorted(costs))
    vals = np.array([costs[s] for s in grid])
    rate = dict(zip(paths, p))
    table, best, best_speed = {}, None, 0.0
    for n in sizes:
        tree = subtree(paths, p, n)
        tau = 1.0 + sum(rate[x] for x in tree)
        speed = tau / float(np.interp(n + 1, grid, vals))
        table[n] = dict(tau=round(tau, 4), speed=round(speed, 4))
        if speed > best_speed:
            best, best_speed = tree, speed
    return best, best_speed, table
