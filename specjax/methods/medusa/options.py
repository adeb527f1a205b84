"""Medusa's own options (`SpecConfig.options` when `method="medusa"`)."""

from __future__ import annotations

import dataclasses

from specjax.core import tree as tree_lib

HEADS_TREE = "heads"  # tree="heads": the tree tuned for the loaded heads (tree.json beside them)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MedusaOptions:
    """Attributes:
      tree: a static candidate tree of per-head ranks (paths, parents first; or the name of one in
        `specjax.core.tree.TREES`), or "heads" for the tree tuned for the loaded heads (filled in
        by the record's `resolve`); None: a chain of the spec's k heads.
    """

    tree: tree_lib.Tree | str | None = None

    def __post_init__(self):
        if self.tree is not None and self.tree != HEADS_TREE:
            object.__setattr__(self, "tree", tree_lib.as_tree(self.tree))

    @property
    def depth(self) -> int | None:
        """The tree's depth (None: a chain, or the loaded heads' tree not yet resolved)."""
        return None if self.tree is None or self.tree == HEADS_TREE else max(len(p) for p in self.tree)
