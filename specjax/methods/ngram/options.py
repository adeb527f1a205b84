"""Prompt lookup's own options (`SpecConfig.options` when `method="ngram"`)."""

from __future__ import annotations

import dataclasses

SERVING_TABLE = 1 << 16  # a long-running host's n-gram table: 65536 n-grams, 2.9 MB at width 8 and n <= 3


@dataclasses.dataclass(frozen=True, kw_only=True)
class NgramOptions:
    """Attributes:
      ngram_min, ngram_max: n-gram lengths tried, longest first.
      ngram_table: slots of a cross-request n-gram table in the batch-shared state
        (`specjax.core.ngram_table`; 0 = off), consulted when a row's own context has no match. The
        Engine starts each batch with an empty table; the Scheduler keeps one across requests
        (`SERVING_TABLE` unless given).
    """

    ngram_min: int = 1
    ngram_max: int = 3
    ngram_table: int = 0

    def __post_init__(self):
        for name in ("ngram_min", "ngram_max", "ngram_table"):
            v = getattr(self, name)
            if isinstance(v, bool) or int(v) != v:
                raise ValueError(f"{name}={v}: must be an integer")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"ngram_min={self.ngram_min}, ngram_max={self.ngram_max}: need "
                             "1 <= ngram_min <= ngram_max")
        if self.ngram_table < 0:
            raise ValueError(f"ngram_table={self.ngram_table}: give the table's slots (>= 1), or 0 for none")
