"""Telemetry in one typed shape: the device counters (`decoder.Stats`) become `SpecCounters` on the
host, for the Engine's results, the scheduler's requests, the JSON output and the load bench.

Speculation counters follow the shape vLLM exports, per request and aggregated, as JSON lines.

vLLM's spec-decode metrics count, per proposal step, one draft (`num_drafts`), K draft tokens
(`num_draft_tokens`), the drafts the target kept (`num_accepted_tokens`), and how often draft
position j was kept (`accepted_tokens_per_pos`). The derived numbers follow vLLM too:

    mean_acceptance_length = 1 + num_accepted_tokens / num_drafts   (tokens per target step)
    draft_acceptance_rate  = num_accepted_tokens / num_draft_tokens

A tree counts every node it verified as a drafted token, and its accepted depth per position.
A request whose chunks used different K (the adaptive controller) has `accepted_tokens_per_pos`
as long as its largest K; plain chunks add nothing.

Tokens per target forward (`tau`, bonus token included) and a row's stop reason are also decided
here, once.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import pathlib
from typing import Iterable, Sequence

import numpy as np


@dataclasses.dataclass
class SpecCounters:
    """vLLM-shaped speculation counters."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_tokens_per_pos: list[int] = dataclasses.field(default_factory=list)
    accept_hist: list[int] = dataclasses.field(default_factory=list)  # steps that kept exactly n
    # how often window node i was kept (a tree's nodes in its listed order; a chain's: per position);
    # merged index-wise, so it reads per node only over chunks of one window
    accepted_per_node: list[int] = dataclasses.field(default_factory=list)

    @classmethod
    def from_stats(cls, stats, row: int) -> "SpecCounters":
        """Row `row` of the device counters (`specjax.core.decoder.Stats`, host or device arrays)."""
        hist = np.asarray(stats.accept_hist)[row]
        if hist.size <= 1:  # the plain loop drafts nothing
            return cls()
        return cls(num_drafts=int(hist.sum()), num_draft_tokens=int(np.asarray(stats.drafted)[row]),
                   num_accepted_tokens=int(np.asarray(stats.accepted)[row]),
                   accepted_tokens_per_pos=np.asarray(stats.accepted_per_position)[row].tolist(),
                   accept_hist=hist.tolist(),
                   accepted_per_node=([] if stats.accepted_per_node is None
                                      else np.asarray(stats.accepted_per_node)[row].tolist()))

    def merge(self, other: "SpecCounters") -> "SpecCounters":
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        self.accepted_tokens_per_pos = _add(self.accepted_tokens_per_pos, other.accepted_tokens_per_pos)
        self.accept_hist = _add(self.accept_hist, other.accept_hist)
        self.accepted_per_node = _add(self.accepted_per_node, other.accepted_per_node)
        return self

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def draft_acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "mean_acceptance_length": self.mean_acceptance_length,
                "draft_acceptance_rate": self.draft_acceptance_rate}


@dataclasses.dataclass
class ChunkRecord:
    """One chunk of the scheduler: when, what ran and why (the adaptive controller's decision)."""

    start_s: float  # from the run's start
    seconds: float
    option: str  # the option's `SpecConfig.label`: "none", "ngram:4", "medusa-tree:3", ...
    reason: str  # why (`specjax.serving.controller.Reason`)
    expected_gain: float  # the controller's expected throughput over plain
    rows: int  # active rows
    tasks: dict[str, int]  # active rows per task class
    queued: int  # requests waiting for a slot
    batch_size: int = 0  # the batch size the chunk ran at (the slots, or a smaller size)
    steps: int = 0  # target forwards it ran

    @property
    def speculated(self) -> bool:
        return self.option != "none"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _add(a: Sequence[int], b: Sequence[int]) -> list[int]:
    n = max(len(a), len(b))
    return [(a[j] if j < len(a) else 0) + (b[j] if j < len(b) else 0) for j in range(n)]


def tau(new_tokens: int, target_forwards: int) -> float:
    """Tokens per target forward after the prefill's first token (the bonus token included)."""
    return (new_tokens - 1) / target_forwards if target_forwards else 1.0


class StopReason(enum.StrEnum):
    """Why a row or request ended. A `StrEnum`: it equals, prints and serialises as its value."""

    STOP_TOKEN = "stop_token"
    MAX_NEW_TOKENS = "max_new_tokens"
    CACHE_FULL = "cache_full"
    CONSTRAINT_UNMET = "constraint_unmet"  # at a stop token its constraint did not accept (a dead state)
    CANCELLED = "cancelled"  # a scheduler request cancelled by its client
    ERROR = "error"  # a scheduler request that failed


def stop_reason(tokens: Sequence[int], stop_ids, max_new_tokens: int | np.integer, *, met: bool = True) -> StopReason:
    """Why a finished row stopped: at a stop token (its constraint `met` there, or not), at its
    budget, or with its cache full."""
    if tokens and tokens[-1] in set(int(t) for t in stop_ids if t >= 0):
        return StopReason.STOP_TOKEN if met else StopReason.CONSTRAINT_UNMET
    if len(tokens) >= max_new_tokens:
        return StopReason.MAX_NEW_TOKENS
    return StopReason.CACHE_FULL


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
