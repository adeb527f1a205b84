"""The forced method's own options (`SpecConfig.options` when `method="forced"`)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, kw_only=True)
class ForcedOptions:
    """Attributes:
      ngram_min, ngram_max: prompt lookup's n-gram lengths, where the constraint forces nothing.
    """

    ngram_min: int = 1
    ngram_max: int = 3

    def __post_init__(self):
        for name in ("ngram_min", "ngram_max"):
            v = getattr(self, name)
            if isinstance(v, bool) or int(v) != v:
                raise ValueError(f"{name}={v}: must be an integer")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"ngram_min={self.ngram_min}, ngram_max={self.ngram_max}: need 1 <= ngram_min <= ngram_max")
