"""Token recycling's own options (`SpecConfig.options` when `method="recycle"`)."""

from __future__ import annotations

import dataclasses

from specjax.core import tree as tree_lib

MAX_CANDIDATES = 32  # a row of the matrix: more candidates than a template of 64 nodes can use
WARM_DEFAULT, WARM_COLD = "default", "cold"


@dataclasses.dataclass(frozen=True, kw_only=True)
class RecycleOptions:
    """Attributes:
      tree: the draft template, a static tree of ranks in the matrix's rows (paths, parents first,
        or the name of one in `specjax.core.tree.TREES`); None: a chain of the spec's k.
      recycle_k: candidates kept per token (the matrix is `[V, recycle_k]`), 1..32; a template's
        ranks must be below it.
      recycle_order: 2 also keeps a second-order table keyed by the last two tokens (read first,
        the first-order row when it has no entry); 1: the matrix alone.
      recycle_table: slots of the second-order table.
      recycle_tenants: scopes kept side by side: tenant t writes and reads matrix `t % tenants`,
        and only rows it wrote itself (other tenants' rows fall back to the warm start).
      recycle_spine: prompt lookup on the spine: a match of at least this many tokens in the row's
        context (or the cross-request n-gram table) fills the template's rank-0 chain; 0 = off.
      recycle_spine_max: the longest n-gram the spine looks up.
      recycle_ngram_table: slots of a cross-request n-gram table the spine also reads (0 = none;
        a long-running host turns it on).
      recycle_warm: the matrix the drafts fall back on where the live one has no row of the row's
        tenant: "default" (the asset loaded into the Engine, else the one shipped for the model,
        else none), "cold" (none), or a directory written by `specjax warm-recycle`.
    """

    tree: tree_lib.Tree | str | None = None
    recycle_k: int = 8
    recycle_order: int = 2
    recycle_table: int = 1 << 16
    recycle_tenants: int = 1
    recycle_spine: int = 2
    recycle_spine_max: int = 4
    recycle_ngram_table: int = 0
    recycle_warm: str = WARM_DEFAULT

    def __post_init__(self):
        if self.tree is not None:
            if self.tree == "heads":
                raise ValueError("tree='heads' is the tree tuned for Medusa heads: recycle takes a named tree "
                                 f"({', '.join(tree_lib.TREES)}) or paths")
            object.__setattr__(self, "tree", tree_lib.as_tree(self.tree))
        for name in ("recycle_k", "recycle_order", "recycle_table", "recycle_tenants", "recycle_spine",
                     "recycle_spine_max", "recycle_ngram_table"):
            v = getattr(self, name)
            if isinstance(v, bool) or int(v) != v:
                raise ValueError(f"{name}={v!r}: must be an integer")
        if not 1 <= self.recycle_k <= MAX_CANDIDATES:
            raise ValueError(f"recycle_k={self.recycle_k}: the matrix keeps 1..{MAX_CANDIDATES} candidates per token")
        if self.recycle_order not in (1, 2):
            raise ValueError(f"recycle_order={self.recycle_order}: give 1 (the matrix) or 2 (and the second-order table)")
        if self.recycle_table < 1 or self.recycle_tenants < 1:
            raise ValueError(f"recycle_table={self.recycle_table}, recycle_tenants={self.recycle_tenants}: must be >= 1")
        if self.recycle_spine < 0 or self.recycle_spine_max < max(self.recycle_spine, 1):
            raise ValueError(f"recycle_spine={self.recycle_spine}, recycle_spine_max={self.recycle_spine_max}: "
                             "need 0 <= spine <= spine_max (0: no prompt lookup on the spine)")
        if self.recycle_ngram_table < 0:
            raise ValueError(f"recycle_ngram_table={self.recycle_ngram_table}: give the table's slots, or 0 for none")
        if not isinstance(self.recycle_warm, str) or not self.recycle_warm:
            raise ValueError(f"recycle_warm={self.recycle_warm!r}: give 'default', 'cold' or a directory")
        if self.tree is not None and max(p[-1] for p in self.tree) >= self.recycle_k:
            top = max(p[-1] for p in self.tree)
            raise ValueError(f"recycle template uses rank {top}, beyond the matrix's recycle_k={self.recycle_k} "
                             f"candidates per token: give recycle_k >= {top + 1} or a narrower tree")

    @property
    def depth(self) -> int | None:
        """The template's depth (None: a chain of the spec's k)."""
        return None if self.tree is None else max(len(p) for p in self.tree)
