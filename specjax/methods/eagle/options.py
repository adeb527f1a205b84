"""EAGLE's own options (`SpecConfig.options` when `method="eagle"`)."""

from __future__ import annotations

import dataclasses

from specjax.core.tree import MAX_TREE_NODES


@dataclasses.dataclass(frozen=True, kw_only=True)
class EagleOptions:
    """Attributes:
      nodes: drafted nodes of the dynamic tree built each step (EAGLE-2), the spec's `k` its depth;
        0 drafts a chain of k.
      topk: for trees: children per expanded node and frontier width.
      draft_vocab: propose from the head's `draft_vocab` most frequent tokens (0 = its whole draft
        vocabulary); a smaller one makes each draft step cheaper.
    """

    nodes: int = 0
    topk: int = 4
    draft_vocab: int = 0

    def __post_init__(self):
        for name in ("nodes", "draft_vocab"):
            v = getattr(self, name)
            if isinstance(v, bool) or int(v) != v or v < 0:
                raise ValueError(f"{name}={v}: must be an integer >= 0 (0 = off)")
        if self.nodes > MAX_TREE_NODES:
            raise ValueError(f"nodes={self.nodes}: at most {MAX_TREE_NODES} tree nodes are supported")
        if isinstance(self.topk, bool) or int(self.topk) != self.topk or self.topk < 1:
            raise ValueError(f"topk={self.topk}: must be an integer >= 1")
