"""Auto against plain on the same prompts: the report `specjax generate --method auto` prints.

The command decodes the same prompts with auto and with the plain loop in turns (auto, plain, then
plain, auto, ...: each pair in the opposite order, so drift on a busy machine does not favour either),
compile excluded, and hands each repetition's timings here. One noisy pair of timings is not a
speedup: the report gives the median over the repetitions with its range, and says when the range
straddles 1. When auto decoded plain on every chunk, it ran the same loop as the baseline: any
difference is noise, so the report says so instead of printing a speedup. When the output repeats
itself (a small model looping over one line), prompt lookup drafts the loop back to it: the report
says how much of the output is repetition, so a speedup bought by a loop reads as one.

Pure host arithmetic, no JAX: `Report(...).text()` is tested with fixed timings.

Example:
  >>> r = Report(label="config", pairs=(Pair(auto_s=1.0, plain_s=2.1, auto_tokens=100, plain_tokens=100),
  ...                                   Pair(auto_s=1.1, plain_s=2.0, auto_tokens=100, plain_tokens=100)),
  ...            chunks={"ngram:8": 9, "none": 2}, tau=2.4)
  >>> round(r.median, 2)
  1.96
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Mapping, Sequence

PLAIN_LABEL = "none"  # the label of a plain chunk (`SpecConfig().label`)
REPEAT_SPAN = 8  # tokens: a span this long seen earlier in the output is repetition, not a shared name
REPEAT_NOTE = 0.25  # from this share of repeated tokens on, the report says the speedup comes from it


def repeated_share(outputs: Sequence[Sequence], n: int = REPEAT_SPAN) -> float:
    """The share of the outputs' tokens that lie in an `n`-token span their output already wrote.

    Each output (a sequence of token ids, or of words) is scanned on its own. A configuration file
    that names its service and paths again scores low (short repeats); a model that writes the same
    line six times scores about 5/6.

    >>> repeated_share([list("abcdefgh" * 6)])
    0.8333333333333334
    """
    covered = total = 0
    for tokens in outputs:
        seen, mark = set(), [False] * len(tokens)
        for i in range(len(tokens) - n + 1):
            span = tuple(tokens[i:i + n])
            if span in seen:
                mark[i:i + n] = [True] * n
            seen.add(span)
        covered, total = covered + sum(mark), total + len(tokens)
    return covered / max(1, total)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Pair:
    """One repetition: auto's and plain's seconds and new tokens on the same prompts."""

    auto_s: float
    plain_s: float
    auto_tokens: int
    plain_tokens: int

    def __post_init__(self):
        for name in ("auto_s", "plain_s"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"{name}={v}: a run's seconds must be finite and > 0")
        for name in ("auto_tokens", "plain_tokens"):
            v = getattr(self, name)
            if int(v) != v or v < 1:
                raise ValueError(f"{name}={v}: a run must have produced at least one token")

    @property
    def speedup(self) -> float:
        """Auto's tokens per second over plain's (the latency ratio when both made the same tokens)."""
        return (self.auto_tokens / self.auto_s) / (self.plain_tokens / self.plain_s)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Report:
    """Auto against plain on one selection of prompts (a task class, or the one prompt).

    Attributes:
      label: what was measured ("" for a single unlabelled prompt).
      pairs: one `Pair` per repetition.
      chunks: auto's chunks per option over every repetition ("none" for plain, "ngram:8", ...).
      tau: auto's tokens per target forward.
      identical: (auto runs whose tokens equal plain's, runs compared) under greedy decoding, else None.
      repeated: the share of auto's output that repeats spans it already wrote (`repeated_share`), or None.
    """

    label: str
    pairs: tuple[Pair, ...]
    chunks: Mapping[str, int]
    tau: float
    identical: tuple[int, int] | None = None
    repeated: float | None = None

    def __post_init__(self):
        if not self.pairs:
            raise ValueError("no repetitions to compare: give at least one Pair")
        if any(int(n) != n or n < 0 for n in self.chunks.values()):
            raise ValueError(f"chunks={dict(self.chunks)}: counts must be integers >= 0")
        if self.repeated is not None and not 0.0 <= self.repeated <= 1.0:
            raise ValueError(f"repeated={self.repeated}: a share must lie in [0, 1]")

    @property
    def speculated(self) -> bool:
        """Whether auto ran any speculative chunk."""
        return any(n > 0 for o, n in self.chunks.items() if o != PLAIN_LABEL)

    @property
    def speedups(self) -> list[float]:
        return [p.speedup for p in self.pairs]

    @property
    def median(self) -> float:
        return statistics.median(self.speedups)

    @property
    def low(self) -> float:
        return min(self.speedups)

    @property
    def high(self) -> float:
        return max(self.speedups)

    @property
    def claim(self) -> float | None:
        """The speedup claimed: the median, or None when auto never speculated."""
        return self.median if self.speculated else None

    def to_dict(self) -> dict:
        return dict(label=self.label, speedup_median=self.claim, speedup_min=self.low if self.speculated else None,
                    speedup_max=self.high if self.speculated else None, speedups=self.speedups,
                    auto_s=[p.auto_s for p in self.pairs], plain_s=[p.plain_s for p in self.pairs],
                    chunks=dict(self.chunks), tau=self.tau, speculated=self.speculated,
                    identical=None if self.identical is None else list(self.identical), repeated=self.repeated)

    def text(self) -> str:
        """One line: what auto ran, and its speedup with the spread (or why none is claimed)."""
        n = len(self.pairs)
        ran = ", ".join(f"{o} x{c}" for o, c in sorted(self.chunks.items()) if c)
        times = (f"plain {statistics.median(p.plain_s for p in self.pairs):.1f} s, "
                 f"auto {statistics.median(p.auto_s for p in self.pairs):.1f} s per run")
        runs = f"{n} interleaved run{'s' if n > 1 else ''} each, compile excluded"
        same = ("" if self.identical is None
                else f"; identical to plain {self.identical[0]}/{self.identical[1]}")
        head = f"{self.label}: " if self.label else ""
        if not self.speculated:
            return (f"[{head}auto decoded plain on every chunk ({ran}): no speculation, no speedup claimed "
                    f"({times}, {runs}){same}]")
        if n == 1:
            spread = "one run: no spread, rerun with --repeats 3 for one"
        else:
            spread = f"range {self.low:.2f}-{self.high:.2f}x"
            if self.low <= 1.0 <= self.high:
                spread += ", within run-to-run noise"
        line = (f"[{head}auto tau {self.tau:.2f} ({ran}); {self.median:.2f}x plain decoding, median of {n} "
                f"({spread}; {times}, {runs}){same}]")
        if self.repeated is not None and self.repeated >= REPEAT_NOTE:
            line += (f"\n[{head}{self.repeated:.0%} of the output repeats {REPEAT_SPAN}-token spans it already "
                     f"wrote: the speedup comes largely from the model repeating itself]")
        return line


def report(label: str, auto: Sequence[tuple[float, int]], plain: Sequence[tuple[float, int]],
           chunks: Mapping[str, int], *, tau: float, identical: tuple[int, int] | None = None,
           repeated: float | None = None) -> Report:
    """A `Report` from per-repetition (seconds, tokens) of auto and of plain, in repetition order."""
    if len(auto) != len(plain):
        raise ValueError(f"{len(auto)} auto runs against {len(plain)} plain runs: they must pair up")
    pairs = tuple(Pair(auto_s=a_s, plain_s=p_s, auto_tokens=a_n, plain_tokens=p_n)
                  for (a_s, a_n), (p_s, p_n) in zip(auto, plain))
    return Report(label=label, pairs=pairs, chunks=dict(chunks), tau=tau, identical=identical, repeated=repeated)
