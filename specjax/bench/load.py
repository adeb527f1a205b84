"""`specjax bench` under load: methods x concurrency levels, per task class.

For each concurrency level N and each method, every prompt goes through a `Scheduler` with N slots:
N closed-loop clients (each sends its next request when the last one finished), or Poisson arrivals
at `--rate` requests/s. Methods run one after another at each level, all on the same prompts, in an
order that mixes task classes, so every batch holds several. Compile time and the auto controller's
start-up calibration happen before the clock starts.

Reported per (method, concurrency, task class, and "all"):
- tau: tokens per target forward after each request's first token;
- throughput_tok_s: tokens of the selection over the run's makespan;
- request_tok_s: tokens over the summed request latencies (arrival to last token), the rate one
  client sees; speedup_vs_none compares throughput for "all" and request_tok_s per task class
  (per-task throughput is not defined when the classes share batches);
- ttft_p50_s, itl_p50_s, itl_p99_s: time to first token (from arrival) and per-token inter-token
  latency (a chunk's gap spread over the tokens it brought);
- memory: the run's `specjax.memory.Report` at its end (`memory`: the arrays by part, each
  `<part>_bytes` and their sum `arrays_bytes`; the compiled programs and what compiling them
  added; the resident set and what it holds beyond both), and peak_mem_bytes, measured
  (`specjax.memory.peak`): the device's peak bytes in use where the backend reports it
  (peak_mem_source "device", since the process started), else the process's peak resident set
  during the run, compiling and calibrating included (CPU, "rss");
- greedy_identical: every request's tokens equal those of `none` at the same concurrency.
"""

from __future__ import annotations

import dataclasses
import gc
import pathlib
import statistics
import sys
from typing import Sequence

import numpy as np

from specjax import memory
from specjax.methods.config import SpecConfig
from specjax.serving.controller import ControllerConfig
from specjax.methods import registry

LOAD_METHODS = ("none", *registry.RECORDS, "auto")
DEFAULT_CONCURRENCY = (1, 4, 16)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoadPlan:
    """What to run; validated on construction, before any model is loaded."""

    methods: tuple[str, ...]
    concurrency: tuple[int, ...] = DEFAULT_CONCURRENCY
    rate: float | None = None  # Poisson arrivals per second; None: N closed-loop clients
    chunk: int = 8
    repeats: int = 1
    auto: ControllerConfig = ControllerConfig()
    surge: tuple[tuple[float, float], ...] | None = None  # (requests/s, seconds) phases
    batch_sizes: tuple[int, ...] | None = None  # sizes a chunk may run at (see Scheduler)

    def __post_init__(self):
        bad = [m for m in self.methods if m not in LOAD_METHODS]
        if bad or not self.methods:
            raise ValueError(f"unknown method {bad[0] if bad else '(none given)'!r}: use one of "
                             f"{', '.join(LOAD_METHODS)}")
        if not self.concurrency:
            raise ValueError("no concurrency level given: e.g. --concurrency 1,4,16")
        for c in self.concurrency:
            if int(c) != c or c < 1:
                raise ValueError(f"concurrency {c}: must be an integer >= 1")
        if self.rate is not None and not self.rate > 0:
            raise ValueError(f"arrival rate {self.rate}: must be > 0 requests per second")
        if self.chunk < 1 or self.repeats < 1:
            raise ValueError("chunk and repeats must be >= 1")
        if self.surge is not None and (self.rate is not None or len(self.concurrency) != 1):
            raise ValueError("--surge sets the arrivals itself: give one --concurrency (the slots) and no --rate")
        for x in self.batch_sizes or ():
            if int(x) != x or not 1 <= x <= min(self.concurrency):
                raise ValueError(f"batch size {x}: must be an integer in [1, concurrency]")
        if "none" in self.methods:  # the baseline goes first
            object.__setattr__(self, "methods", ("none",) + tuple(m for m in self.methods if m != "none"))
        else:
            object.__setattr__(self, "methods", ("none",) + self.methods)


def int_list(text: str, name: str) -> tuple[int, ...]:
    """A `--name 1,4,16` flag as integers (ValueError naming the flag otherwise)."""
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--{name} {text!r}: give comma-separated integers, e.g. 1,4,16") from None


def interleave(prompts: Sequence) -> list:
    """Round-robin over task classes (each in file order), so consecutive requests mix tasks."""
    groups: dict = {}
    for p in prompts:
        groups.setdefault(p.task, []).append(p)
    out = []
    for i in range(max(len(g) for g in groups.values())):
        out += [g[i] for g in groups.values() if i < len(g)]
    return out


def run(engine, prompts: Sequence, plan: LoadPlan, opts, *, chat: bool = False,
        specs: dict[str, SpecConfig] | None = None, progress: bool = True) -> tuple[list, list]:
    """Runs every (concurrency, repeat, method) over `prompts` (objects with `.text` and `.task`;
    text may be token ids). Returns per-request rows and per-run rows."""
    from tqdm import tqdm

    from specjax.serving.scheduler import Scheduler, Status, poisson_arrivals

    specs = specs or {}
    longest = max(len(x) for x in engine.check([p.text for p in prompts], opts, chat=chat))
    phase = [None] * len(prompts)
    if plan.surge:
        from specjax.bench import surge

        arrivals, phase = surge.arrivals(plan.surge)
        prompts = [prompts[i % len(prompts)] for i in range(len(arrivals))]  # the mix, cycled in order
    else:
        arrivals = poisson_arrivals(len(prompts), plan.rate) if plan.rate else [None] * len(prompts)
    total = len(plan.concurrency) * plan.repeats * len(plan.methods) * len(prompts)
    req_rows, run_rows = [], []
    with tqdm(total=total, desc="bench", unit="req", file=sys.stderr, disable=not progress) as bar:
        for c in plan.concurrency:
            for rep in range(plan.repeats):
                for m in plan.methods:
                    bar.set_postfix_str(f"{m} x{c}")
                    spec = "auto" if m == "auto" else specs.get(m, SpecConfig(method=m))
                    s = Scheduler(engine, slots=c, spec=spec, controller=plan.auto, opts=opts,
                                  chunk=plan.chunk, chat=chat, max_prompt_tokens=longest,
                                  batch_sizes=plan.batch_sizes)
                    for p, t in zip(prompts, arrivals):
                        s.submit(p.text, task=p.task, arrival=t)
                    memory.reset_peak()  # the resident peak of this run only (Linux)
                    s.prepare()
                    s.warm()  # every method starts warm, as auto does after calibrating
                    done = [0]

                    def tick(s, done=done):
                        n = sum(r.status is Status.FINISHED for r in s.requests)
                        bar.update(n - done[0])
                        done[0] = n

                    s.run(on_chunk=tick)
                    tick(s)
                    run_rows.append(_run_row(s, m, c, rep))
                    req_rows += [dict(_request_row(r, m, c, rep), phase=ph) for r, ph in zip(s.requests, phase)]
                    del s
                    gc.collect()
    return req_rows, run_rows


def _run_row(s, method: str, c: int, rep: int) -> dict:
    chunks = {}
    for ch in s.chunk_log:
        chunks[ch.option] = chunks.get(ch.option, 0) + 1
    row = dict(method=method, concurrency=c, rep=rep, memory=dataclasses.asdict(s.memory()),
               makespan_s=max(r.finished_s for r in s.requests), compile_s=s.compile_s, chunks=chunks,
               chunk_log=[ch.to_dict() for ch in s.chunk_log], **memory.peak())
    if s.cost is not None:
        row["cost_s_per_step"] = {o.label: t for o, t in s.cost.seconds.items()}
        row["cost_s_per_step_by_batch_size"] = {
            size: {o.label: t for o, t in c.seconds.items()} for size, c in s.costs.items()}
        row["acceptance"] = s.controller.summary()
    return row


def _request_row(r, method: str, c: int, rep: int) -> dict:
    return dict(method=method, concurrency=c, rep=rep, id=r.id, task=r.task, tokens=r.tokens,
                new_tokens=len(r.tokens), forwards=r.target_forwards, ttft_s=r.ttft_s,
                latency_s=r.latency_s, itl_s=r.itl_s, stop_reason=r.stop_reason, chunks=r.chunks,
                counters=r.counters, arrived_s=r.arrived_s, emissions=r.emissions)


def summarize(req_rows: list[dict], run_rows: list[dict], *, greedy: bool = True) -> list[dict]:
    """One record per (method, concurrency, task) plus task "all" (see the module docstring)."""
    out = []
    tasks = sorted({str(r["task"]) for r in req_rows if r["task"] is not None})
    keys = list(dict.fromkeys((r["method"], r["concurrency"]) for r in run_rows))
    base = {(r["concurrency"], r["rep"], r["id"]): r for r in req_rows if r["method"] == "none"}
    for m, c in keys:
        runs = [r for r in run_rows if r["method"] == m and r["concurrency"] == c]
        makespan = sum(r["makespan_s"] for r in runs)
        for t in ["all"] + tasks:
            sel = [r for r in req_rows if r["method"] == m and r["concurrency"] == c
                   and (t == "all" or str(r["task"]) == t)]
            rec = _stats(sel, makespan)
            b = [base[(r["concurrency"], r["rep"], r["id"])] for r in sel]
            ref = _stats(b, sum(x["makespan_s"] for x in run_rows
                                if x["method"] == "none" and x["concurrency"] == c))
            key = "throughput_tok_s" if t == "all" else "request_tok_s"
            rec["speedup_vs_none"] = rec[key] / ref[key]
            same = sum(r["tokens"] == x["tokens"] for r, x in zip(sel, b))
            top = max(runs, key=lambda r: r["peak_mem_bytes"])  # the repeat of the highest peak
            report = memory.Report(**top["memory"])
            out.append(dict(method=m, concurrency=c, task=t, requests=len(sel), **rec,
                            **{f"{k}_bytes": v for k, v in report.parts.items()}, arrays_bytes=report.arrays_bytes,
                            memory=top["memory"], peak_mem_bytes=top["peak_mem_bytes"],
                            peak_mem_source=top["peak_mem_source"],
                            greedy_identical=(same == len(sel)) if greedy else None,
                            greedy_identical_n=same if greedy else None))
    return out


def _stats(sel: list[dict], makespan: float) -> dict:
    toks = sum(r["new_tokens"] for r in sel)
    itl = [x for r in sel for x in r["itl_s"]]
    pct = lambda q: float(np.percentile(itl, q)) if itl else float("nan")
    chunks: dict[str, int] = {}  # chunks each option ran, counted once per request in them
    for r in sel:
        for label, n in r.get("chunks", {}).items():
            chunks[label] = chunks.get(label, 0) + n
    return dict(tau=sum(r["new_tokens"] - 1 for r in sel) / max(1, sum(r["forwards"] for r in sel)),
                throughput_tok_s=toks / makespan, request_tok_s=toks / sum(r["latency_s"] for r in sel),
                ttft_p50_s=statistics.median(r["ttft_s"] for r in sel), itl_p50_s=pct(50),
                itl_p99_s=pct(99), new_tokens=toks, chunks=dict(sorted(chunks.items(), key=lambda x: -x[1])))


def markdown(records: list[dict]) -> str:
    """The per-task table, then memory per method and concurrency."""
    head = ("| method | conc. | task | reqs | tau | speedup vs none | tok/s | TTFT p50 | ITL p50 | "
            "ITL p99 | identical |\n|---|---|---|---|---|---|---|---|---|---|---|\n")
    ms = lambda x: f"{x * 1e3:.0f} ms"
    rows = [f"| {r['method']} | {r['concurrency']} | {r['task']} | {r['requests']} | {r['tau']:.2f} | "
            f"{r['speedup_vs_none']:.2f}x | {r['throughput_tok_s'] if r['task'] == 'all' else r['request_tok_s']:.1f} | "
            f"{ms(r['ttft_p50_s'])} | {ms(r['itl_p50_s'])} | {ms(r['itl_p99_s'])} | "
            f"{'' if r['greedy_identical'] is None else r['greedy_identical_n']}/{r['requests']} |"
            for r in records]
    mem = memory.markdown({f"{r['method']}, {r['concurrency']} slots": memory.Report(**r["memory"])
                           for r in records if r["task"] == "all"})
    note = ("\n\ntok/s: throughput over the run for task `all`; per task, tokens over summed request "
            "latency (what one client sees), which is also what the per-task speedup compares.")
    # what a method of several options (auto) ran: per request, the chunks of each option it sat in
    ran = [f"- {r['method']} at {r['concurrency']}, {r['task']}: "
           + ", ".join(f"{label} {n}" for label, n in r["chunks"].items())
           for r in records if len(r.get("chunks", {})) > 1]
    if ran:
        note += "\n\nChunks per option (summed over requests):\n" + "\n".join(ran)
    return head + "\n".join(rows) + note + "\n\n" + mem


def plot(records: list[dict], out_dir: str) -> list[str]:
    """speedup_vs_concurrency.png and tau_by_task.png in `out_dir` (needs the `plot` extra)."""

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("plots need matplotlib: pip install -e '.[plot]'") from None
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    methods = list(dict.fromkeys(r["method"] for r in records))
    fig, ax = plt.subplots(figsize=(6, 4))
    for m in methods:
        sel = sorted((r["concurrency"], r["speedup_vs_none"]) for r in records
                     if r["method"] == m and r["task"] == "all")
        ax.plot([x for x, _ in sel], [y for _, y in sel], marker="o", label=m)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    levels = sorted({r["concurrency"] for r in records})
    ax.set(xscale="log", xlabel="concurrency (batch slots)", ylabel="throughput speedup vs none",
           title="Speedup against concurrency")
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.minorticks_off()
    ax.legend()
    paths = [out / "speedup_vs_concurrency.png"]
    fig.savefig(paths[0], dpi=120, bbox_inches="tight")
    plt.close(fig)

    c0 = min(r["concurrency"] for r in records)
    tasks = list(dict.fromkeys(r["task"] for r in records if r["concurrency"] == c0))
    spec = [m for m in methods if m != "none"] or methods
    fig, ax = plt.subplots(figsize=(max(6, len(tasks) * 1.2), 4))
    w = 0.8 / len(spec)
    for i, m in enumerate(spec):
        tau = {r["task"]: r["tau"] for r in records if r["method"] == m and r["concurrency"] == c0}
        ax.bar(np.arange(len(tasks)) + i * w, [tau.get(t, 0) for t in tasks], w, label=m)
    ax.set_xticks(np.arange(len(tasks)) + w * (len(spec) - 1) / 2, tasks, rotation=20)
    ax.set(ylabel="tau (tokens per target forward)", title=f"tau per task class (concurrency {c0})")
    ax.legend()
    paths.append(out / "tau_by_task.png")
    fig.savefig(paths[1], dpi=120, bbox_inches="tight")
    plt.close(fig)
    return [str(p) for p in paths]


def telemetry_rows(req_rows: list[dict]) -> list[dict]:
    """vLLM-shaped counters per request and aggregated, per (method, concurrency)."""
    from specjax import telemetry

    out = []
    for m, c in dict.fromkeys((r["method"], r["concurrency"]) for r in req_rows):
        sel = [dict(id=r["id"], task=r["task"], rep=r["rep"], counters=r["counters"]) for r in req_rows
               if r["method"] == m and r["concurrency"] == c]
        out += telemetry.records(sel, method=m, concurrency=c)
    return out
