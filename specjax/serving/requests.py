"""A request's life in the scheduler: its status, what it asked for, and what it got and when.

`Request` is the host record the scheduler (`specjax.serving.scheduler`) and the server keep per request:
the prompt ids and sampling values (validated once, into its batch-of-one `Inputs`, at submit), then
its tokens, emission times, stop reason, target forwards and speculation counters.
`poisson_arrivals` gives open-loop arrival times for load runs. `SchedulerSnapshot` is the
read-only view of a scheduler's requests that hosts (the server, its metrics) read instead of its
internals (`Scheduler.snapshot`).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import numpy as np

from specjax import telemetry
from specjax.methods.config import SpecConfig
from specjax.core.decoder import Inputs
from specjax.core.logprobs import TokenLogprob, entries
from specjax.methods.predict.usage import prediction_usage
from specjax.telemetry import SpecCounters, StopReason


def poisson_arrivals(n: int, rate: float, *, seed: int = 0) -> list[float]:
    """Arrival times (seconds from the start) of `n` requests of a Poisson process of `rate`/s."""
    if not rate > 0:
        raise ValueError(f"arrival rate {rate}: must be > 0 requests per second")
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=n)
    return np.cumsum(gaps).tolist()


class Status(enum.StrEnum):
    """Where a request is: queued, then running in a slot, then finished, cancelled or failed."""

    QUEUED = "queued"
    RUNNING = "running"
    FINISHED = "finished"
    CANCELLED = "cancelled"
    FAILED = "failed"


@dataclasses.dataclass(eq=False)
class Request:
    """One request and, once run, what it got and when (times in seconds from the run's start)."""

    id: int
    ids: list[int]
    max_new_tokens: int
    task: str | None = None
    arrival: float | None = None  # None: as soon as a slot is free (a closed-loop client)
    opt_out: bool = False
    contribute: bool = True  # its text may enter the cross-request n-gram table
    seed: int = 0
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    speculation: SpecConfig | None = None  # the one option it may speculate with (None: any)
    tenant: int = 0  # scope of the cross-request n-gram table it reads and writes
    stream: int | None = None  # its random stream's row index (None: its id)
    stop_ids: tuple[int, ...] = ()  # its stop tokens
    prediction: list[int] | None = None  # its predicted output (token ids), for method predict and the usage
    constraint: Any = None  # its constraint's tables (`specjax.constrain.TokenTables`) until it ends; None: free
    pool_slot: int = 0  # the constraint pool slot it holds while running (0: none, a free row)
    logit_bias: dict[int, float] | None = None  # token id -> what it adds to the target's logits (None: none)
    top_logprobs: int | None = None  # alternatives per token it asked for with its logprobs (None: no logprobs)
    status: Status = Status.QUEUED
    error: str | None = None  # why it failed
    slot: int | None = None
    tokens: list[int] = dataclasses.field(default_factory=list)
    arrived_s: float | None = None
    emissions: list[tuple[float, int]] = dataclasses.field(default_factory=list)  # (time, tokens)
    finished_s: float | None = None
    stop_reason: StopReason | None = None
    target_forwards: int = 0
    counters: SpecCounters = dataclasses.field(default_factory=SpecCounters)
    chunks: dict[str, int] = dataclasses.field(default_factory=dict)  # chunks run per option
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)  # per token, when it asked for them
    inputs: Inputs | None = dataclasses.field(default=None, repr=False)  # its batch of one (Inputs.create)

    def commit(self, view, start: int, t: float) -> None:
        """Appends what its row of the host view `view` holds from column `start` on, emitted at `t`:
        the tokens and, when it asked, their log-probabilities."""
        stop = int(view.lengths[self.slot])
        new = view.tokens[self.slot, start:stop].tolist()
        if new:
            self.tokens += new
            self.emissions.append((t, len(new)))
        if new and self.top_logprobs is not None:
            got = entries(view.logprobs, self.slot, int(start), stop)
            self.logprobs += [e._replace(top=e.top[:self.top_logprobs]) for e in got]

    @property
    def ttft_s(self) -> float:
        """Arrival to first token (nan for a request cancelled before it ran)."""
        return self.emissions[0][0] - self.arrived_s if self.emissions else float("nan")

    @property
    def latency_s(self) -> float:
        """Arrival to last token, or to the cancellation."""
        if self.finished_s is None or self.arrived_s is None:
            return float("nan")
        return self.finished_s - self.arrived_s

    @property
    def itl_s(self) -> list[float]:
        """Per-token inter-token latencies: a chunk's gap spread evenly over the tokens it brought."""
        out = []
        for (t0, _), (t1, n) in zip(self.emissions, self.emissions[1:]):
            out += [(t1 - t0) / n] * n
        return out

    @property
    def tau(self) -> float:
        """Tokens per target forward after the first token."""
        return telemetry.tau(len(self.tokens), self.target_forwards)

    @property
    def prediction_tokens(self) -> tuple[int, int] | None:
        """(accepted, rejected) tokens of its prediction in its tokens so far (None: it gave none)."""
        return None if self.prediction is None else prediction_usage(self.prediction, self.tokens)


@dataclasses.dataclass(frozen=True)
class RowSnapshot:
    """The request in one slot of the batch, as a snapshot saw it."""

    slot: int
    request: int  # its id
    status: Status
    tokens: int  # generated so far
    task: str | None
    tenant: int


@dataclasses.dataclass(frozen=True)
class SchedulerSnapshot:
    """A scheduler's requests at one moment (`Scheduler.snapshot`), safe to keep and read anywhere.

    Attributes:
      slots: rows of the batch.
      queued: requests submitted and not yet in a slot (the queue depth).
      live: requests queued or running.
      rows: per slot, its request or None (a free slot).
      last_chunk: the last chunk run (what ran, why, for whom), or None.
    """

    slots: int
    queued: int
    live: int
    rows: tuple[RowSnapshot | None, ...]
    last_chunk: telemetry.ChunkRecord | None = None

    @classmethod
    def of(cls, slots, *, queued: int, live: int, log) -> "SchedulerSnapshot":
        """The snapshot of a scheduler's `slots` (a request or None per slot) and its chunk log. It
        copies the slot list and reads each length in one step, so every value is one the scheduler
        had (a server's event loop reads it while the engine thread steps), though two values may be
        a chunk boundary apart."""
        rows = tuple(None if r is None else RowSnapshot(slot=i, request=r.id, status=r.status, tokens=len(r.tokens),
                                                        task=r.task, tenant=r.tenant)
                     for i, r in enumerate(list(slots)))
        return cls(slots=len(rows), queued=queued, live=live, rows=rows, last_chunk=log[-1] if log else None)

    @property
    def running(self) -> int:
        """Requests in a slot."""
        return sum(r is not None for r in self.rows)

    @property
    def idle(self) -> bool:
        """Nothing queued, nothing running."""
        return self.live == 0 and self.queued == 0 and self.running == 0


def _placeholder_request() -> Request:
    """A one-token request done at its insert that writes nothing to the n-gram table: the shapes an
    insert program is compiled for, and what warm-up runs it on."""
    return Request(id=-1, ids=[0], max_new_tokens=1, contribute=False)
