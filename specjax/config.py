"""Static decoding choices: which proposer, how many drafts. Hashable, jit-static."""

from __future__ import annotations

import dataclasses
from typing import Literal

MAX_K = 16  # verify windows beyond this cost more than they save on any model we target
METHODS = ("none", "ngram", "draft")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SpecConfig:
    """How to speculate.

    Attributes:
      method: "none" (plain loop), "ngram" (prompt lookup) or "draft" (a small draft model).
      k: drafted tokens per step; the target verifies k + 1 positions in one forward.
      ngram_min, ngram_max: n-gram lengths tried by prompt lookup, longest first.
    """

    method: Literal["none", "ngram", "draft"] = "none"
    k: int = 4
    ngram_min: int = 1
    ngram_max: int = 3

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"unknown method {self.method!r}: use one of {', '.join(METHODS)}")
        if self.method == "none":
            return
        if int(self.k) != self.k or not 1 <= self.k <= MAX_K:
            raise ValueError(f"k={self.k}: must be an integer in [1, {MAX_K}]")
        if self.method == "ngram" and not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(
                f"ngram_min={self.ngram_min}, ngram_max={self.ngram_max}: need "
                "1 <= ngram_min <= ngram_max")

    @property
    def window(self) -> int:
        """Tokens the target sees per step (and the cache headroom a step needs)."""
        return 1 if self.method == "none" else self.k + 1
