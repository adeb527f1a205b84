"""Predicted outputs' own options (`SpecConfig.options` when `method="predict"`)."""

from __future__ import annotations

import dataclasses

METHOD = "predict"
MAX_PREDICTION = 1 << 14  # tokens: a prediction buffer is [B, cap] int32 in the loop carry


@dataclasses.dataclass(frozen=True, kw_only=True)
class PredictOptions:
    """Attributes:
      prediction_cap: tokens of a row's prediction buffer (static: one compiled program serves every
        prediction up to it). A longer prediction is refused at the boundary (`Engine.generate`,
        the server), never truncated.
      ngram_min, ngram_max: n-gram lengths tried, longest first, when the answer leaves the prediction
        and the cursor is found again (and in the row's own context when the prediction has no match).
    """

    prediction_cap: int = 1024
    ngram_min: int = 1
    ngram_max: int = 3

    def __post_init__(self):
        for name in ("prediction_cap", "ngram_min", "ngram_max"):
            v = getattr(self, name)
            if isinstance(v, bool) or int(v) != v:
                raise ValueError(f"{name}={v!r}: must be an integer")
        if not 1 <= self.prediction_cap <= MAX_PREDICTION:
            raise ValueError(f"prediction_cap={self.prediction_cap}: must be in [1, {MAX_PREDICTION}] tokens")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"ngram_min={self.ngram_min}, ngram_max={self.ngram_max}: need "
                             "1 <= ngram_min <= ngram_max")


def prediction_cap(specs) -> int | None:
    """The prediction buffer a host must give its rows for these `SpecConfig`s: the largest
    `prediction_cap` among the predict options, or None when none drafts from a prediction."""
    caps = [s.options.prediction_cap for s in specs if s.method == METHOD]
    return max(caps) if caps else None
