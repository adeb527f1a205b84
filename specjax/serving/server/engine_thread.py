"""One engine thread owns the `Scheduler`; everything else talks to it through messages.

The scheduler is not thread-safe (`_release` donates the batch state), so only this thread touches
it. HTTP handlers (on the event loop) put `submit` and `cancel` commands on a thread-safe queue; the
engine thread applies them at chunk boundaries, steps the scheduler, and sends each request's new
tokens, then its end, to that request's asyncio queue with `loop.call_soon_threadsafe`.

Failure is contained: a request that fails at submission or admission ends with an error alone; an
error inside a chunk (the device's) fails the requests in flight with one message, the batch is
rebuilt empty (`Scheduler.reset_batch`) and the server keeps serving. The queue is bounded: past
`slots + max_queue` requests not yet ended, `submit` raises `QueueFull` (the HTTP layer answers
429). A request past its deadline is cancelled at the next chunk boundary and ends with "timeout".
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from typing import Any, Callable

from specjax.serving.scheduler import Request, Scheduler, Status

log = logging.getLogger("specjax.serving.server")

# the scheduler's stop reasons, as OpenAI's finish_reason
FINISH = {"stop_token": "stop", "max_new_tokens": "length", "cache_full": "length",
          "constraint_unmet": "constraint_unmet"}  # a constrained answer ended in a dead state

# An idle engine that receives a request keeps taking the requests that follow it within ADMIT_GAP_S
# of each other (at most ADMIT_WINDOW_S in all, while slots are free) before its first chunk, so a
# burst of clients is admitted and prefilled together instead of one per chunk. A lone request waits
# ADMIT_GAP_S once.
ADMIT_GAP_S = 0.002
ADMIT_WINDOW_S = 0.05


class QueueFull(Exception):
    """Too many requests in flight: the HTTP layer answers 429 with Retry-After."""


class NotAccepting(Exception):
    """The server is warming up or draining: the HTTP layer answers 503."""


@dataclasses.dataclass(frozen=True)
class End:
    """The last event of a request: why it ended (a finish_reason or "error"), the error message,
    and the scheduler's record of it (counters, times)."""

    reason: str
    error: str | None = None
    request: Request | None = None
    client_error: bool = False  # the request itself was bad (400), not the server (500)


@dataclasses.dataclass(eq=False)
class Job:
    """One request on its way through the engine thread.

    `events` receives (new token ids, their `TokenLogprob` records or None when the request asked for
    none) pairs, then one `End`. `submit` holds `Scheduler.submit`'s
    keyword arguments; `arrived` is `time.perf_counter()` when the HTTP request arrived, so that
    latency counts from arrival, queueing in the command queue included.
    """

    ids: list[int]
    submit: dict[str, Any]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    arrived: float = dataclasses.field(default_factory=time.perf_counter)
    deadline: float | None = None  # time.perf_counter() value
    rid: int | None = None
    request: Request | None = None
    sent: int = 0
    reason: str | None = None  # why it was cancelled: "cancelled" | "timeout" | "stop"
    ended: bool = False
    tenant: str = "anonymous"  # its tenant's label in the metrics

    def put(self, item) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, item)


class EngineThread:
    """Runs `sched` in its own thread.

    Args:
      sched: the scheduler (not yet prepared: the thread compiles and warms it up).
      max_queue: requests that may wait beyond the slots before `submit` raises `QueueFull`.
      on_chunk: called in the engine thread after every step (metrics).
      on_end: called in the engine thread when a job ends, with the job and its `End`.
      on_ready: called in the engine thread once compiled and warmed up, before accepting requests.
    """

    def __init__(self, sched: Scheduler, *, max_queue: int = 64,
                 on_chunk: Callable[["EngineThread"], None] | None = None,
                 on_end: Callable[[Job, End], None] | None = None,
                 on_ready: Callable[[], None] | None = None):
        if int(max_queue) != max_queue or max_queue < 0:
            raise ValueError(f"max_queue={max_queue}: must be an integer >= 0")
        self.sched, self.max_queue = sched, int(max_queue)
        self.slots = sched.snapshot().slots
        self.on_chunk, self.on_end, self.on_ready = on_chunk, on_end, on_ready
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self.pending = 0  # jobs submitted and not yet ended
        self.jobs: dict[int, Job] = {}  # by request id; the engine thread's own
        self.ready = threading.Event()  # compiled and warmed up
        self.accepting = False
        self._drained = False  # `drain` was called: never accept again
        self.startup_error: BaseException | None = None
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._main, name="specjax-engine", daemon=True)

    @property
    def capacity(self) -> int:
        return self.slots + self.max_queue

    @property
    def running(self) -> int:
        """Requests in a slot (read from any thread: the scheduler's snapshot)."""
        return self.sched.snapshot().running

    @property
    def waiting(self) -> int:
        """Requests accepted and not yet in a slot: in the command queue or the scheduler's queue."""
        return max(0, self.pending - len(self.jobs)) + self.sched.snapshot().queued

    # ---- any thread ---------------------------------------------------------------------------
    def start(self) -> None:
        self.thread.start()

    def submit(self, job: Job) -> None:
        """Hands a job to the engine; raises `QueueFull` or `NotAccepting` instead."""
        with self._lock:
            if not self.accepting:
                raise NotAccepting("the server is " + ("draining" if self.ready.is_set() else "warming up"))
            if self.pending >= self.capacity:
                raise QueueFull(f"{self.pending} requests in flight (slots {self.slots} + queue {self.max_queue})")
            self.pending += 1
        self._cmds.put(("submit", job))

    def cancel(self, job: Job, reason: str = "cancelled") -> None:
        """Cancels a job at the next chunk boundary (its slot is freed there); no-op once ended."""
        self._cmds.put(("cancel", job, reason))

    def drain(self) -> None:
        """Stops accepting new requests; those in flight continue."""
        with self._lock:
            self.accepting, self._drained = False, True

    def stop(self, timeout: float | None = None) -> None:
        """Drains, cancels what is still in flight after `timeout` seconds, and ends the thread."""
        self.drain()
        t_end = None if timeout is None else time.perf_counter() + timeout
        while self.pending and (t_end is None or time.perf_counter() < t_end) and self.thread.is_alive():
            time.sleep(0.02)
        self._stop.set()
        self._cmds.put(("stop",))  # cancels what is left
        self.thread.join(timeout=30)

    # ---- the engine thread --------------------------------------------------------------------
    def _main(self) -> None:
        s = self.sched
        try:
            s.prepare()
            s.compile_buckets()
            s.warm()
            s.start_clock()
            if self.on_ready is not None:
                self.on_ready()
        except BaseException as e:  # reported by /health and the CLI
            log.exception("engine start-up failed")
            self.startup_error = e
            return
        with self._lock:
            self.accepting = not self._drained  # a drain during the warm-up holds
        self.ready.set()
        while not (self._stop.is_set() and not self.jobs and self._cmds.empty()):
            idle = not s.snapshot().live
            self._commands(block=idle)
            self._expire()
            if s.snapshot().live:
                try:
                    s.admit(on_insert=lambda _: self._publish())  # each first token as soon as it exists
                    s.step()
                except Exception as e:  # a device (or host) error inside a chunk
                    msg = f"engine error while decoding: {type(e).__name__}: {e}"
                    log.exception("chunk failed; failing the requests in flight")
                    try:
                        s.reset_batch(msg)
                    except Exception as e2:  # the device cannot even build an empty batch: give up
                        log.exception("cannot rebuild the batch; the engine stops")
                        self.startup_error = e2
                        self.drain()
                        for job in list(self.jobs.values()):
                            self._end(job, End("error", f"{msg}; then {type(e2).__name__}: {e2}",
                                               request=job.request))
                        return
                if self.on_chunk is not None:
                    self.on_chunk(self)
            self._publish()

    def _commands(self, *, block: bool) -> None:
        try:
            cmd = self._cmds.get(timeout=0.05) if block else self._cmds.get_nowait()
        except queue.Empty:
            return
        t_end = time.perf_counter() + ADMIT_WINDOW_S
        while True:
            if cmd[0] == "submit":
                self._submit(cmd[1])
            elif cmd[0] == "cancel":
                job, reason = cmd[1], cmd[2]
                if job.rid is not None and not job.ended:
                    job.reason = job.reason or reason
                    self.sched.cancel(job.rid)
            elif cmd[0] == "stop":
                for job in list(self.jobs.values()):
                    job.reason = job.reason or "cancelled"
                    self.sched.cancel(job.rid)
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                left = t_end - time.perf_counter() if block else 0.0
                if left <= 0 or len(self.jobs) >= self.slots:
                    break
                try:
                    cmd = self._cmds.get(timeout=min(ADMIT_GAP_S, left))
                except queue.Empty:
                    break
        self._publish()

    def _submit(self, job: Job) -> None:
        s = self.sched
        if self._stop.is_set():  # submitted just before the drain ended: it never starts
            self._end(job, End("cancelled"))
            return
        arrival = max(0.0, s.now() - (time.perf_counter() - job.arrived))
        try:
            job.rid = s.submit(job.ids, arrival=arrival, **job.submit)
        except ValueError as e:
            self._end(job, End("error", str(e), client_error=True))
            return
        except Exception as e:
            self._end(job, End("error", f"{type(e).__name__}: {e}"))
            return
        job.request = s.request(job.rid)
        self.jobs[job.rid] = job

    def _expire(self) -> None:
        now = time.perf_counter()
        for job in list(self.jobs.values()):
            if job.deadline is not None and now >= job.deadline and not job.reason:
                job.reason = "timeout"
                self.sched.cancel(job.rid)

    def _publish(self) -> None:
        """Sends each job its new tokens, and its end once the scheduler is done with it."""
        for job in list(self.jobs.values()):
            req = job.request
            if len(req.tokens) > job.sent:
                job.put((list(req.tokens[job.sent:]),
                         None if req.top_logprobs is None else list(req.logprobs[job.sent:])))
                job.sent = len(req.tokens)
            if req.status is Status.FINISHED:
                self._end(job, End(FINISH.get(req.stop_reason, "stop"), request=req))
            elif req.status is Status.CANCELLED:
                self._end(job, End(job.reason or "cancelled", request=req))
            elif req.status is Status.FAILED:
                self._end(job, End("error", req.error, request=req))

    def _end(self, job: Job, end: End) -> None:
        job.ended = True
        if job.rid is not None:
            self.jobs.pop(job.rid, None)
        if self.on_end is not None:  # first: once a client has its answer, /metrics counts it
            try:
                self.on_end(job, end)
            except Exception:  # metrics must never stop the engine
                log.exception("on_end failed")
        with self._lock:
            self.pending -= 1
        job.put(end)
