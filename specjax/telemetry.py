"""Speculation counters in the shape vLLM exports, per request and aggregated, as JSON lines.

vLLM's spec-decode metrics count, per proposal step, one draft (`num_drafts`), K draft tokens
(`num_draft_tokens`), the drafts the target kept (`num_accepted_tokens`), and how often draft
position j was kept (`accepted_tokens_per_pos`). The derived numbers follow vLLM too:

    mean_acceptance_length = 1 + num_accepted_tokens / num_drafts   (tokens per target step)
    draft_acceptance_rate  = num_accepted_tokens / num_draft_tokens

A request whose chunks used different K (the adaptive controller) has `accepted_tokens_per_pos`
as long as its largest K; plain chunks add nothing.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Iterable, Sequence


@dataclasses.dataclass
class SpecCounters:
    """vLLM-shaped speculation counters."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_tokens_per_pos: list[int] = dataclasses.field(default_factory=list)

    def add(self, *, k: int, accepted_per_position: Sequence[int], steps: int) -> None:
        """Adds `steps` proposal steps of K drafts whose per-position acceptance counts are given."""
        if k <= 0 or steps <= 0:
            return
        app = [int(x) for x in accepted_per_position]
        self.num_drafts += int(steps)
        self.num_draft_tokens += int(steps) * k
        self.num_accepted_tokens += sum(app)
        self._add_pos(app)

    def merge(self, other: "SpecCounters") -> "SpecCounters":
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        self._add_pos(other.accepted_tokens_per_pos)
        return self

    def _add_pos(self, app: Sequence[int]) -> None:
        if len(app) > len(self.accepted_tokens_per_pos):
            self.accepted_tokens_per_pos += [0] * (len(app) - len(self.accepted_tokens_per_pos))
        for j, a in enumerate(app):
            self.accepted_tokens_per_pos[j] += int(a)

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def draft_acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "mean_acceptance_length": self.mean_acceptance_length,
                "draft_acceptance_rate": self.draft_acceptance_rate}


def from_extra(extra: dict) -> SpecCounters:
    """Counters of one `engine.Result` (its `extra` telemetry dict)."""
    c = SpecCounters()
    k = int(extra.get("k", 0))
    if k and "accept_hist" in extra:
        c.add(k=k, accepted_per_position=extra["accepted_per_position"],
              steps=sum(extra["accept_hist"]))
    return c


def aggregate(counters: Iterable[SpecCounters]) -> SpecCounters:
    total = SpecCounters()
    for c in counters:
        total.merge(c)
    return total


def records(requests: Iterable[dict], **labels) -> list[dict]:
    """JSON-lines records: one per request (`kind: "request"`), then one aggregate per task class
    and one over all (`kind: "aggregate"`, task "all").

    Args:
      requests: dicts with `id`, `task` and `counters` (a `SpecCounters`); other keys are copied.
      **labels: fields added to every record (method, concurrency, ...).
    """
    requests = list(requests)
    out = []
    for r in requests:
        extra = {k: v for k, v in r.items() if k != "counters"}
        out.append({"kind": "request", **labels, **extra, **r["counters"].to_dict()})
    tasks = sorted({str(r.get("task")) for r in requests})
    for t in ["all"] + (tasks if len(tasks) > 1 or tasks != ["None"] else []):
        sel = [r["counters"] for r in requests if t == "all" or str(r.get("task")) == t]
        out.append({"kind": "aggregate", **labels, "task": t, "requests": len(sel),
                    **aggregate(sel).to_dict()})
    return out


def write_jsonl(path: str | pathlib.Path, rows: Iterable[dict], *, append: bool = False) -> None:
    with open(path, "a" if append else "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
