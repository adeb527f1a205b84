"""Continuous batching at chunk granularity, for the plain and the speculative loops alike.

Requests arrive (all at once, N closed-loop clients, or Poisson at a given rate) and occupy the
slots of one fixed-shape batch, which decodes in chunks of `chunk` target steps with the compiled
loops `Engine.generate` uses. At each chunk boundary the host reads the new tokens, retires finished
rows and refills their slots (a batch-1 prefill scattered into the batch state); the other rows
continue exactly as if alone, since a row's tokens depend only on its own prompt, key and position.

The scheduler decides none of this itself. `OptionSet` (`specjax.serving.options`) resolves the
options and builds the batch in flight (a `specjax.core.slots.BatchEngine`, every program compiled
in `prepare`, through `Engine.program`); `Intake` (`specjax.serving.intake`) checks each request at
`submit`; `Steering` (`specjax.serving.steering`) picks each chunk's option: a fixed spec, or auto's
`Controller` fed by the chunks and by the methods' host replays (`specjax.serving.replays`). The
scheduler keeps the queue, the slots, timing and packing. Every option shares the `DecodeState`; each speculative option keeps its own proposer state,
stale (never wrong) after another option's chunks. A constrained request takes a slot of the batch's
constraint pool (`constraint_pool=`) for as long as it runs.

Not thread-safe (slot operations donate the batch state): a server runs it in one engine thread and
sends it submits and cancels as messages (`specjax.serving.server`). A request that fails at
admission ends "failed" alone; after an error inside a chunk, `reset_batch` fails the running
requests and starts an empty batch. `history=` bounds the request list and the chunk log.

Example:
  >>> sched = Scheduler(eng, slots=4, spec="auto", opts=GenerateOptions(max_new_tokens=64))
  >>> for p in prompts:
  ...     sched.submit(p, task="qa")
  >>> done = sched.run()
  >>> done[0].tokens, done[0].ttft_s, done[0].counters.to_dict()
"""

from __future__ import annotations

import collections
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from specjax import memory, telemetry
from specjax.core.constraint import met as constraint_met
from specjax.core.slots import BatchEngine, RunningBatch
from specjax.core.state import DecodeState
from specjax.methods.config import SpecConfig
from specjax.serving.constraints import ConstraintLimits, PoolSlots
from specjax.serving.controller import ControllerConfig, CostModel, Plan
from specjax.serving.engine import Engine, GenerateOptions
from specjax.serving.intake import Intake
from specjax.serving.options import Built, OptionSet
from specjax.serving.steering import Steering
from specjax.serving.requests import (Request, RowSnapshot, SchedulerSnapshot, Status,  # noqa: F401 (re-exported)
                                      poisson_arrivals)
from specjax.telemetry import StopReason


def _views(owner: str, *names: str) -> tuple[property, ...]:
    """Read-only properties, one per name, that read `self.<owner>.<name>`."""
    return tuple(property(lambda self, n=n: getattr(getattr(self, owner), n)) for n in names)


class Scheduler:
    """Serves many requests through one fixed-shape batch of `slots` rows.

    Args:
      engine: the `Engine` (model, compile cache, proposers).
      slots: rows of the batch (the concurrency).
      spec, controller, ngram_table, with_plain, constraint_pool: the options (`OptionSet.resolve`).
      opts: generation options; max_new_tokens sizes the cache and bounds each request's, and its
        sampling values are each request's defaults (a temperature > 0 compiles the sampled programs).
      chunk: target steps per chunk; slots are refilled and the option may change between chunks.
      chat: wrap string prompts in the chat template.
      max_prompt_tokens: the longest prompt to accept; default: the longest one submitted before
        the first step (it fixes the cache length).
      batch_sizes: batch sizes a chunk may run at (slots always one). Running rows are kept packed at
        the front and each chunk runs on the smallest size that holds them, at that size's cost.
      history: keep only the last `history` requests and chunks (a server's bound; None: all).
      clock: seconds; `time.perf_counter` by default.
      costs: for "auto", an earlier scheduler's `costs` (same options, slots, sizes, machine).
      logit_bias, logprobs: the most logit_bias entries and top logprobs a request may bring (`Intake`).
      batch_engine: what builds the batch in flight (`specjax.core.slots.BatchEngine`; called as
        `RunningBatch` is, by `OptionSet.build`); a test may give a wrapper that fails on purpose.
    """

    def __init__(self, engine: Engine, *, slots: int, spec: SpecConfig | str = SpecConfig(),
                 controller: ControllerConfig | None = None, opts: GenerateOptions = GenerateOptions(),
                 chunk: int = 8, chat: bool = False, max_prompt_tokens: int | None = None,
                 ngram_table: int | None = None, batch_sizes: Sequence[int] | None = None, with_plain: bool = False,
                 history: int | None = None, clock: Callable[[], float] = time.perf_counter,
                 costs: dict[int, CostModel] | None = None, constraint_pool: ConstraintLimits | None = None,
                 logit_bias: int = 0, logprobs: int | None = None, batch_engine: Callable[..., BatchEngine] = RunningBatch):
        for name, v in (("slots (concurrency)", slots), ("chunk", chunk), ("history", 1 if history is None else history)):
            if int(v) != v or v < 1:
                raise ValueError(f"{name}={v}: must be an integer >= 1")
        opts.validate()
        self.engine, self.b, self.opts, self.chunk, self.chat = engine, int(slots), opts, int(chunk), chat
        bad = [x for x in (batch_sizes or ()) if int(x) != x or not 1 <= x <= self.b]
        if bad:
            raise ValueError(f"batch_sizes {list(batch_sizes)}: each must be an integer in [1, slots={self.b}]")
        self.sizes = tuple(sorted({int(x) for x in (batch_sizes or ())} | {self.b}))
        self.clock, self.max_prompt_tokens, self._batch_engine = clock, max_prompt_tokens, batch_engine
        self.option_set = o = OptionSet.resolve(engine, spec, controller=controller, ngram_table=ngram_table,
                                                with_plain=with_plain, constraint_pool=constraint_pool, slots=self.b)
        self.intake = Intake(engine, opts, o, slots=self.b, chat=chat, constraint_pool=constraint_pool,
                             logit_bias=logit_bias, logprobs=logprobs)
        self.steering = Steering(o, sizes=self.sizes, costs=costs)
        self._pool_slots = PoolSlots(self.b)  # which request holds which pool slot
        keep = lambda: [] if history is None else collections.deque(maxlen=int(history))
        self.requests: list[Request] = keep()
        self.chunk_log: list[telemetry.ChunkRecord] = keep()  # every chunk (or the last `history`): what ran, why
        self.live: dict[int, Request] = {}  # queued and running requests by id
        self.queue, self.slots, self._next_id, self._t0 = [], [None] * self.b, 0, None
        self.built: Built | None = None  # the options' decoders and the batch in flight (`batch`), from `prepare`
        self.batch: BatchEngine | None = None

    # ---- requests --------------------------------------------------------------------------
    def submit(self, prompt: str | Sequence[int], *, task: str | None = None, arrival: float | None = None,
               opt_out: bool = False, contribute: bool = True, max_new_tokens: int | None = None,
               seed: int | None = None, temperature: float | None = None, top_k: int | None = None,
               top_p: float | None = None, speculation: SpecConfig | None = None, tenant: int = 0,
               stop_ids: Sequence[int] = (), stream: int | None = None, prediction: str | Sequence[int] | None = None,
               response_format: dict | None = None, regex: str | None = None, choice: Sequence[str] | None = None,
               constraint: Any = None, logit_bias: dict | None = None, top_logprobs: int | None = None) -> int:
        """Queues a request; returns its id. Checks it now (`Intake.request` says what each field
        means; nothing compiles here but its constraint). It draws the random stream
        `fold_in(key(seed), id)`: its own, whatever batch it lands in."""
        fields = {k: v for k, v in locals().items() if k not in ("self", "prompt")}
        req = self.intake.request(self._next_id, prompt, bucket=None if self.batch is None else self.bucket, **fields)
        self._next_id += 1
        self.requests.append(req)
        self.live[req.id] = req
        self.queue.append(req)
        return req.id

    def cancel(self, rid: int) -> None:
        """Cancels a request: a queued one never runs; a running one frees its slot now. Not
        thread-safe: call it between steps, from the thread that steps (a server's engine thread)."""
        req = self.live.get(rid)
        if req is not None and req.status is Status.QUEUED:
            self.queue.remove(req)
        elif req is not None and req.status is Status.RUNNING:
            self.batch.release(req.slot)
            self.slots[req.slot] = None
            self._pack()
        else:  # finished, failed, cancelled or unknown
            return
        self._end(req, Status.CANCELLED, StopReason.CANCELLED, self.now())

    def fail(self, req: Request, error: str) -> None:
        """Ends one request with an error (its slot, if it had one, is already free)."""
        self._end(req, Status.FAILED, StopReason.ERROR, self.now())
        req.error = error

    def _finish(self, req: Request, t: float, forwards: int) -> None:
        stops = req.stop_ids or self.engine.stop_ids(self.opts)
        met = req.constraint is None or constraint_met(req.constraint, req.tokens, stops)
        self.slots[req.slot], req.target_forwards = None, forwards
        self._end(req, Status.FINISHED, telemetry.stop_reason(req.tokens, stops, req.max_new_tokens, met=met), t)

    def _end(self, req: Request, status: Status, reason: StopReason, t: float) -> None:
        """Every ending: the request leaves the live set, its observers and its constraint pool slot
        (its row, done, is never masked again); history keeps no tables or device buffers."""
        req.status, req.finished_s, req.stop_reason = status, t, reason
        self.live.pop(req.id, None)
        self.steering.end(req)
        self._pool_slots.free(req.id)
        req.constraint = req.inputs = None

    def reset_batch(self, error: str) -> list[Request]:
        """After an error inside a chunk (the device's, or the host's while it read it): fails every running
        request with `error` and starts a fresh, empty batch; queued ones stay. Returns the failed ones."""
        waiting = {r.id for r in self.queue}
        failed = [r for r in self.live.values() if r.id not in waiting]  # running, or mid-admission
        for r in failed:
            self.fail(r, error)
        self.slots = [None] * self.b
        self._pool_slots.clear()  # the fresh batch's pool is empty
        self.batch.reset()
        return failed

    def now(self) -> float:  # seconds since the clock started
        return 0.0 if self._t0 is None else self.clock() - self._t0

    def start_clock(self) -> None:
        """Starts the clock that `arrival` and every request time count from (the first `step`
        does it otherwise); a server calls it once, so that arrivals are given as they happen."""
        if self._t0 is None:
            self._t0 = self.clock()

    # ---- programs --------------------------------------------------------------------------
    def prepare(self) -> None:
        """Fixes the cache length, builds every option's decoder and the batch that compiles them
        (`OptionSet.build`), and calibrates auto's cost models (`Steering.calibrate`). The first `step`
        runs it if not called; call it first to keep compile time out of timings."""
        if self.batch is not None:
            return
        self.bucket = self.engine.bucket_for(self.max_prompt_tokens or max([len(r.ids) for r in self.requests] or [1]))
        self.built = self.option_set.build(self.engine, bucket=self.bucket, max_new_tokens=self.opts.max_new_tokens,
                                           sampling=self.opts.sampling, logprobs=self.logprobs, sizes=self.sizes,
                                           empty=self.intake.placeholders(max_new=1), batch=self._batch_engine)
        self.batch, self.decoders, self.cache_length = self.built.batch, self.built.decoders, self.built.cache_length
        for p in sorted({self.engine.bucket_for(len(r.ids)) for r in self.queue}):
            self.batch.compile_insert(self.intake.placeholder(p))
        self.steering.calibrate(lambda size: self.calibrate(size=size))

    # what the option set, the intake and the steering own (see each), read as the Scheduler's
    ccfg, specs, options, fixed, shared, table, prediction_cap = _views(
        "option_set", "ccfg", "specs", "options", "fixed", "shared", "table", "prediction_cap")
    logit_bias, logprobs, constraint_pool, check_logit_bias, check_constraint = _views(
        "intake", "logit_bias", "logprobs", "constraint_pool", "check_logit_bias", "check_constraint")
    replays, controller, cost, costs = _views("steering", "replays", "controller", "cost", "costs")  # `prepare`

    @property
    def state(self) -> DecodeState | None:
        """The batch's decode state (None before `prepare`)."""
        return None if self.batch is None else self.batch.state

    @property
    def compile_s(self) -> float:
        """Seconds this scheduler spent compiling."""
        return 0.0 if self.batch is None else self.batch.compile_s

    def warm(self) -> None:
        """Runs every compiled program once on placeholder rows, so that first-run costs (allocation,
        caches: ~0.9 s for an insert program here) stay out of timed runs and first requests; "auto"
        runs its loops while it calibrates."""
        if all(r is None for r in self.slots):
            self.batch.warm_inserts()
        for size in () if self.costs else self.sizes:
            self.calibrate(steps=1, repeats=1, size=size)

    def compile_buckets(self) -> None:
        """Compiles the insert program of every prompt bucket up to the scheduler's, so that no
        request compiles anything when it arrives (a server's warm-up)."""
        self.prepare()
        for p in (p for p in self.engine.buckets if p <= self.bucket):
            self.batch.compile_insert(self.intake.placeholder(p))

    def calibrate(self, steps: int = 4, repeats: int = 3, *, size: int | None = None) -> CostModel:
        """Seconds per target step of every option at batch size `size` (default: all slots), on this
        machine (`Built.calibrate`: forks of the running batch, the same programs)."""
        return self.built.calibrate(self.intake.placeholders(max_new=self.cache_length), steps=steps,
                                    repeats=repeats, size=size or self.b)

    # ---- the serving loop --------------------------------------------------------------------
    def run(self, *, on_chunk: Callable[["Scheduler"], None] | None = None) -> list[Request]:
        """Steps until every submitted request has finished or been cancelled; returns all of them."""
        self.prepare()
        while self.step():
            if on_chunk is not None:
                on_chunk(self)
        return self.requests

    def step(self) -> bool:
        """Admits arrived requests into free slots, then decodes one chunk; False when nothing is
        running and nothing is queued."""
        self.admit()
        active = [r for r in self.slots if r is not None]
        if not active:
            if not self.queue:
                return False
            wait = min(r.arrival for r in self.queue) - self.now()  # all queued ones are in the future
            time.sleep(max(0.0, wait))
            return True
        size = self.steering.size_for(r.slot for r in active)  # the rows are packed at the front
        self._decode_chunk(self.steering.plan(active, size=size), active, size)
        return True

    def admit(self, *, on_insert: Callable[[Request], None] | None = None) -> None:
        """Admits arrived requests into free slots: each gets its first token from its prefill.
        `step` does this before its chunk; a server calls it first, with `on_insert` called after
        each request's prefill (or failure), to stream every first token as soon as it exists."""
        self.prepare()
        self.start_clock()
        free = [i for i, r in enumerate(self.slots) if r is None]
        while free:
            now = self.now()
            ready = [r for r in self.queue if r.arrival is None or r.arrival <= now]
            if not ready:
                return
            req = ready[0]
            self.queue.remove(req)
            try:
                self._insert(free[0], req, now)
            except Exception as e:  # late bad input, or its prefill failed: this request alone
                if self.slots[free[0]] is req or any(x.is_deleted() for x in jax.tree.leaves(self.batch.state)):
                    raise  # it failed after taking the slot or the donated batch: see reset_batch
                self.fail(req, f"{type(e).__name__}: {e}")
            if req.status is Status.RUNNING:  # it took the slot (it may have failed before, or be done already)
                free.pop(0)
            if on_insert is not None:
                on_insert(req)

    def _insert(self, slot: int, req: Request, now: float) -> None:
        req.arrived_s = now if req.arrival is None else req.arrival
        inputs = req.inputs if req.inputs is not None else self.intake.inputs(req)
        if req.constraint is not None:  # a free pool slot, its tables uploaded there (no compile)
            req.pool_slot = self._pool_slots.take(req.id)
            self.batch.upload(req.pool_slot, req.constraint)
            inputs = inputs.replace(constraint=jnp.asarray([req.pool_slot], jnp.int32))
        active = [r for r in self.slots if r is not None]
        bare = self.steering.bare(active, req, size=self.steering.size_for([slot, *(r.slot for r in active)]))
        view = self.batch.insert(slot, inputs, bare=bare)
        req.inputs = None  # inserted: its arrays are the batch's now (history keeps no device buffers)
        t = self.now()
        req.status, req.slot = Status.RUNNING, slot
        req.commit(view, len(req.ids), t)  # its first token
        self.slots[slot] = req
        self.steering.start(req, bare=bare)
        if view.done[slot]:
            self._finish(req, t, 0)

    def _decode_chunk(self, plan: Plan, active: list[Request], size: int) -> None:
        o = plan.option
        t0, start = self.clock(), self.now()
        chunk = self.batch.run(self.built.keys[o], self.chunk, size=size)
        t, seconds = self.now(), self.clock() - t0
        self.steering.ran(o, seconds, chunk.steps)
        self.chunk_log.append(telemetry.ChunkRecord(
            start_s=start, seconds=seconds, option=o.label, reason=plan.reason, expected_gain=float(plan.gain),
            rows=len(active), tasks=dict(collections.Counter(str(r.task) for r in active)),
            queued=len(self.queue), batch_size=size, steps=chunk.steps))
        for req in active:
            i = req.slot
            req.commit(chunk.view, int(chunk.before[i]), t)
            req.chunks[o.label] = req.chunks.get(o.label, 0) + 1
            counters = chunk.counters(i)
            if counters.num_drafts:
                req.counters.merge(counters)
            self.steering.chunk(req, o, counters)
            if chunk.view.done[i]:
                self._finish(req, t, int(chunk.view.row_forwards[i]))
        self._pack()

    def _pack(self) -> None:
        """With several batch sizes: moves the last running rows into the free slots before them."""
        while len(self.sizes) > 1:
            free = [i for i, r in enumerate(self.slots) if r is None]
            busy = [i for i, r in enumerate(self.slots) if r is not None]
            if not free or not busy or free[0] > busy[-1]:
                return
            src, dst = busy[-1], free[0]
            self.batch.move(src, dst)
            req = self.slots[src]
            self.slots[dst], self.slots[src], req.slot = req, None, dst

    # ---- reporting ---------------------------------------------------------------------------
    def snapshot(self) -> SchedulerSnapshot:
        """What the scheduler holds now, read-only, callable from any thread (`SchedulerSnapshot.of`)."""
        return SchedulerSnapshot.of(self.slots, queued=len(self.queue), live=len(self.live), log=self.chunk_log)

    def request(self, rid: int) -> Request | None:
        """The record of request `rid` while it is queued or running (None after: see `requests`)."""
        return self.live.get(rid)

    def memory(self, *, measured: bool = True) -> memory.Report:
        """What this scheduler keeps (`specjax.memory.Report`): its arrays by part (`Built.device_parts`),
        the programs its engine has compiled and what compiling them added, and (`measured`) the process
        now. Call it from the thread that steps (the batch state is donated at every step), after `prepare`."""
        return memory.report(self.built.device_parts(self.engine.params), programs=self.engine.programs(),
                             program_rss_bytes=self.engine.compile_rss_bytes, measured=measured)
