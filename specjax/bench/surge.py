"""Surge mode of the load bench: an arrival rate that ramps up and down, reported per phase.

`--surge 0.5:60,8:60,0.5:60` runs three phases (requests/s : seconds), Poisson arrivals within each,
over the prompt mix cycled in order. Every method serves the same arrivals through a scheduler of
`--concurrency` slots that may run each chunk at a smaller batch size (`--batch-sizes`), so a light
load pays for a small batch. Per method and phase: time to first token, time to completion,
inter-token latency p50/p99, throughput (tokens emitted inside the phase's window over its length),
the fraction of chunks speculated, and the run's memory report (`specjax.memory.Report`, as a dict;
its table is the load bench's).
"""

from __future__ import annotations

import statistics

import numpy as np


def parse_phases(text: str) -> tuple[tuple[float, float], ...]:
    """"0.5:60,8:60,0.5:60" -> ((0.5, 60.0), (8.0, 60.0), (0.5, 60.0))."""
    phases = []
    for part in text.split(","):
        try:
            rate, seconds = (float(x) for x in part.split(":"))
        except ValueError:
            raise ValueError(f"--surge {text!r}: give phases as RATE:SECONDS, comma-separated, "
                             "e.g. 0.5:60,8:60,0.5:60") from None
        if not rate > 0 or not seconds > 0:
            raise ValueError(f"--surge phase {part!r}: rate and seconds must be > 0")
        phases.append((rate, seconds))
    if not phases:
        raise ValueError("--surge: give at least one RATE:SECONDS phase")
    return tuple(phases)


def arrivals(phases, *, seed: int = 0) -> tuple[list[float], list[int]]:
    """Arrival times of a Poisson process whose rate is constant within each phase, and each
    arrival's phase index."""
    rng = np.random.default_rng(seed)
    times, index, start = [], [], 0.0
    for i, (rate, seconds) in enumerate(phases):
        t = start + rng.exponential(1.0 / rate)
        while t < start + seconds:
            times.append(float(t))
            index.append(i)
            t += rng.exponential(1.0 / rate)
        start += seconds
    return times, index


def windows(phases) -> list[tuple[float, float]]:
    edges = np.cumsum([0.0] + [s for _, s in phases])
    return [(float(a), float(b)) for a, b in zip(edges[:-1], edges[1:])]


def summarize(req_rows: list[dict], run_rows: list[dict], phases) -> list[dict]:
    """One record per (method, phase) and per method over the whole run (phase "all")."""
    out = []
    spans = windows(phases)
    for run in run_rows:
        m = run["method"]
        reqs = [r for r in req_rows if r["method"] == m and r["rep"] == run["rep"]]
        end = max(r["arrived_s"] + r["latency_s"] for r in reqs)
        for p, (lo, hi) in list(enumerate(spans)) + [("all", (0.0, end))]:
            sel = [r for r in reqs if p == "all" or r["phase"] == p]
            chunks = [c for c in run["chunk_log"] if lo <= c["start_s"] < hi]
            emitted = sum(n for r in reqs for t, n in r["emissions"] if lo <= t < hi)
            itl = [x for r in sel for x in r["itl_s"]]
            pct = lambda q: float(np.percentile(itl, q)) if itl else float("nan")
            med = lambda k: statistics.median(r[k] for r in sel) if sel else float("nan")
            out.append(dict(
                method=m, phase=p, rate=None if p == "all" else phases[p][0], requests=len(sel),
                ttft_p50_s=med("ttft_s"), latency_mean_s=float(np.mean([r["latency_s"] for r in sel])) if sel else
                float("nan"), latency_p50_s=med("latency_s"), itl_p50_s=pct(50), itl_p99_s=pct(99),
                throughput_tok_s=emitted / (hi - lo), chunks=len(chunks),
                speculated_fraction=sum(c["option"] != "none" for c in chunks) / max(1, len(chunks)),
                mean_batch_size=float(np.mean([c["batch_size"] for c in chunks])) if chunks else float("nan"),
                memory=run["memory"]))
    base = {r["phase"]: r for r in out if r["method"] == "none"}
    for r in out:
        r["latency_vs_none"] = base[r["phase"]]["latency_mean_s"] / r["latency_mean_s"]
        r["throughput_vs_none"] = r["throughput_tok_s"] / base[r["phase"]]["throughput_tok_s"]
        r["itl_p99_vs_none"] = r["itl_p99_s"] / base[r["phase"]]["itl_p99_s"]
    return out


def markdown(records: list[dict]) -> str:
    ms = lambda x: f"{x * 1e3:.0f} ms"
    head = ("| method | phase | req/s | reqs | TTFT p50 | completion mean | vs none | ITL p50 | ITL p99 | "
            "tok/s | vs none | speculated | batch |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    rows = [f"| {r['method']} | {r['phase']} | {'' if r['rate'] is None else r['rate']} | {r['requests']} | "
            f"{ms(r['ttft_p50_s'])} | {r['latency_mean_s']:.2f} s | {r['latency_vs_none']:.2f}x | "
            f"{ms(r['itl_p50_s'])} | {ms(r['itl_p99_s'])} | {r['throughput_tok_s']:.1f} | "
            f"{r['throughput_vs_none']:.2f}x | {100 * r['speculated_fraction']:.0f}% | {r['mean_batch_size']:.1f} |"
            for r in records]
    note = ("\n\ncompletion: arrival to last token; vs none: none's mean completion over the method's (> 1 is "
            "faster), and throughput over none's; speculated: chunks that ran a speculative option; batch: "
            "the mean batch size chunks ran at.")
    return head + "\n".join(rows) + note


def plot(req_rows: list[dict], run_rows: list[dict], phases, out_dir: str) -> str:
    """surge.png: per method, speculation on/off per chunk and each request's completion time."""
    import pathlib

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax0, ax1) = plt.subplots(2, 1, figsize=(9, 5.5), sharex=True)
    for run in run_rows:
        log = run["chunk_log"]
        t = [c["start_s"] for c in log]
        ax0.step(t, [1.0 if c["option"] != "none" else 0.0 for c in log], where="post", label=run["method"])
        sel = sorted((r["arrived_s"], r["latency_s"]) for r in req_rows if r["method"] == run["method"])
        ax1.plot([a for a, _ in sel], [x for _, x in sel], marker=".", lw=0.8, label=run["method"])
    for ax in (ax0, ax1):
        for i, (lo, hi) in enumerate(windows(phases)):
            ax.axvspan(lo, hi, color="grey", alpha=0.08 * (1 + i % 2), lw=0)
    ax0.set(ylabel="speculating", yticks=[0, 1], yticklabels=["plain", "spec"],
            title="Surge: " + ", ".join(f"{r:g} req/s for {s:g} s" for r, s in phases))
    ax1.set(xlabel="time (s)", ylabel="completion time (s)")
    ax1.legend()
    path = pathlib.Path(out_dir) / "surge.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return str(path)
