"""Prometheus metrics of the server, with the names the engines converged on.

Speculation counters follow vLLM's and llama-server's schema (`spec_decode_num_drafts`,
`spec_decode_num_draft_tokens`, `spec_decode_num_accepted_tokens`,
`spec_decode_num_accepted_tokens_per_pos{position}`; Prometheus adds `_total`), under the
`specjax:` prefix as vLLM uses `vllm:`. Besides them: acceptance per task class, chunks per option
(the fraction speculated), queue depth, running requests, TTFT / inter-token / end-to-end
histograms (from each request's arrival), requests by finish reason, per-tenant requests and
tokens (the first `tenants` tenants to finish a request keep their own series, the rest are summed
under "other", so a counter never moves between series), and memory as measured:
the process's resident set, the device's bytes in use where the backend reports them, what
loading the weights, the draft weights and the scheduler's caches and programs added to either,
and per part (weights, draft weights, caches, n-gram table) the bytes the runtime reports for
that part's device buffers (`Scheduler.memory_parts`: the allocation, padding included, not shape
times dtype size). The scheduler is read through its snapshot (`Scheduler.snapshot`).
"""

from __future__ import annotations

import re

import jax
import psutil
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

from specjax.serving.server.engine_thread import End, EngineThread, Job

_LATENCY = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.2, 0.4, 0.8, 1.6)
MAX_TASK_LABELS = 64  # more distinct task classes than this are counted as "other"
OTHER = "other"
_TASK = re.compile(r"^[A-Za-z0-9_.-]{1,32}$")


def device_bytes_in_use() -> int | None:
    """Bytes in use on the first local device, where the backend reports them (GPU, TPU)."""
    stats = jax.local_devices()[0].memory_stats()
    return None if not stats else int(stats.get("bytes_in_use", 0))


def memory_added(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in after if k in before}


def memory_now() -> dict[str, int]:
    """Measured memory now: the process's RSS and, where reported, the device's bytes in use."""
    out = {"process_rss": psutil.Process().memory_info().rss}
    dev = device_bytes_in_use()
    if dev is not None:
        out["device_in_use"] = dev
    return out


class Metrics:
    """The server's registry; `on_chunk` and `on_end` are the engine thread's hooks."""

    def __init__(self, *, startup_memory: dict[str, int] | None = None, tenants: int = 16):
        disable_created_metrics()  # no `_created` series beside every counter (vLLM's exporter does the same)
        self.registry = r = CollectorRegistry()
        p = "specjax:"
        self.drafts = Counter(p + "spec_decode_num_drafts", "Speculative steps (drafts verified)", registry=r)
        self.draft_tokens = Counter(p + "spec_decode_num_draft_tokens", "Draft tokens verified", registry=r)
        self.accepted = Counter(p + "spec_decode_num_accepted_tokens", "Draft tokens accepted", registry=r)
        self.per_pos = Counter(p + "spec_decode_num_accepted_tokens_per_pos",
                               "Draft tokens accepted at each draft position", ["position"], registry=r)
        self.task_draft_tokens = Counter(p + "spec_decode_num_draft_tokens_by_task",
                                         "Draft tokens verified, per task class", ["task"], registry=r)
        self.task_accepted = Counter(p + "spec_decode_num_accepted_tokens_by_task",
                                     "Draft tokens accepted, per task class", ["task"], registry=r)
        self.task_acceptance = Gauge(p + "spec_decode_acceptance_rate_by_task",
                                     "Accepted / drafted tokens so far, per task class", ["task"], registry=r)
        self.chunks = Counter(p + "chunks", "Decode chunks run, per option (none = plain)", ["option"], registry=r)
        self.speculated = Gauge(p + "chunks_speculated_fraction", "Fraction of chunks that speculated",
                                registry=r)
        self.waiting = Gauge(p + "num_requests_waiting", "Requests accepted, not yet in a slot (the queue depth)",
                             registry=r)
        self.running = Gauge(p + "num_requests_running", "Requests in a slot", registry=r)
        self.finished = Counter(p + "request_finished", "Requests ended, per finish reason",
                                ["finished_reason"], registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Arrival to first token", buckets=_LATENCY,
                              registry=r)
        self.itl = Histogram(p + "inter_token_latency_seconds", "Per-token gaps (a chunk's spread over its tokens)",
                             buckets=_ITL, registry=r)
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "Arrival to last token", buckets=_LATENCY,
                             registry=r)
        self.memory = Gauge(p + "memory_bytes", "Measured memory now (process_rss; device_in_use where the "
                                                "backend reports it)", ["kind"], registry=r)
        self.startup = Gauge(p + "memory_startup_bytes", "Measured at start-up: what each stage (weights, "
                                                         "draft_weights, caches_and_programs) added to each kind",
                             ["stage", "kind"], registry=r)
        self.parts = Gauge(p + "memory_device_buffer_bytes", "Bytes the runtime reports for each part's device "
                                                             "buffers (weights, draft_weights, caches, ngram_table)",
                           ["part"], registry=r)
        t = ["tenant"]
        self.tenant_requests = Counter(p + "tenant_requests", "Requests ended, per tenant and finish reason",
                                       ["tenant", "finished_reason"], registry=r)
        self.tenant_prompt_tokens = Counter(p + "tenant_prompt_tokens", "Prompt tokens, per tenant", t, registry=r)
        self.tenant_generation_tokens = Counter(p + "tenant_generation_tokens", "Generated tokens, per tenant", t,
                                                registry=r)
        self.tenant_draft_tokens = Counter(p + "tenant_spec_decode_num_draft_tokens",
                                           "Draft tokens verified, per tenant", t, registry=r)
        self.tenant_accepted = Counter(p + "tenant_spec_decode_num_accepted_tokens",
                                       "Draft tokens accepted, per tenant", t, registry=r)
        self.max_tenants = tenants
        self._tenants: set[str] = set()  # tenants with their own series
        for stage, kinds in (startup_memory or {}).items():
            self.record_startup(stage, kinds)
        for kind in ("process_rss", "device_in_use"):
            self.memory.labels(kind=kind).set_function(lambda k=kind: memory_now().get(k, float("nan")))
        self._last_chunk = None
        self._spec_chunks = 0
        self._all_chunks = 0
        self._tasks: dict[str, list[int]] = {}  # task -> [drafted, accepted]

    def watch(self, et: EngineThread) -> None:
        """Queue depth and running requests, read when scraped (not only after a chunk)."""
        self.waiting.set_function(lambda: et.waiting)
        self.running.set_function(lambda: et.running)

    def record_parts(self, parts: dict[str, int]) -> None:
        for part, v in parts.items():
            self.parts.labels(part=part).set(v)

    def record_startup(self, stage: str, added: dict[str, int]) -> None:
        """What a start-up stage added, per kind of `memory_now` (as measured before and after it)."""
        for kind, v in added.items():
            self.startup.labels(stage=stage, kind=kind).set(v)

    def task_label(self, task: str | None) -> str:
        t = "none" if task is None else str(task)
        if not _TASK.match(t):
            return "other"
        if t not in self._tasks and len(self._tasks) >= MAX_TASK_LABELS:
            return "other"
        return t

    def tenant_label(self, tenant: str) -> str:
        """`tenant`'s series: its own for the first `max_tenants` tenants seen, then "other"."""
        if tenant not in self._tenants and len(self._tenants) >= self.max_tenants:
            return OTHER
        self._tenants.add(tenant)
        return tenant

    def on_chunk(self, et: EngineThread) -> None:
        ch = et.sched.snapshot().last_chunk
        if ch is not None and ch is not self._last_chunk:  # a step runs one chunk at most
            self._last_chunk = ch
            self.chunks.labels(option=ch.option).inc()
            self._all_chunks += 1
            self._spec_chunks += ch.option != "none"
            self.speculated.set(self._spec_chunks / self._all_chunks)

    def on_end(self, job: Job, end: End) -> None:
        self.finished.labels(finished_reason=end.reason).inc()
        tenant = self.tenant_label(job.tenant)
        self.tenant_requests.labels(tenant=tenant, finished_reason=end.reason).inc()
        self.tenant_prompt_tokens.labels(tenant=tenant).inc(len(job.ids))
        req = end.request
        if req is None:
            return
        c = req.counters
        self.tenant_generation_tokens.labels(tenant=tenant).inc(len(req.tokens))
        self.tenant_draft_tokens.labels(tenant=tenant).inc(c.num_draft_tokens)
        self.tenant_accepted.labels(tenant=tenant).inc(c.num_accepted_tokens)
        if c.num_drafts:
            self.drafts.inc(c.num_drafts)
            self.draft_tokens.inc(c.num_draft_tokens)
            self.accepted.inc(c.num_accepted_tokens)
            for i, n in enumerate(c.accepted_tokens_per_pos):
                self.per_pos.labels(position=str(i)).inc(n)
            task = self.task_label(req.task)
            self.task_draft_tokens.labels(task=task).inc(c.num_draft_tokens)
            self.task_accepted.labels(task=task).inc(c.num_accepted_tokens)
            acc = self._tasks.setdefault(task, [0, 0])
            acc[0] += c.num_draft_tokens
            acc[1] += c.num_accepted_tokens
            self.task_acceptance.labels(task=task).set(acc[1] / acc[0] if acc[0] else 0.0)
        if req.emissions and req.arrived_s is not None:
            self.ttft.observe(max(0.0, req.ttft_s))
            for gap in req.itl_s:
                self.itl.observe(gap)
        if req.finished_s is not None and req.arrived_s is not None:
            self.e2e.observe(max(0.0, req.latency_s))
