"""`specjax loadbench --url`: the load bench against a running `specjax serve`, over HTTP.

A real async HTTP client (httpx) streams chat or text completions (SSE) from the server, as vLLM's
`bench serve` does. Arrivals: closed loop (`--concurrency` N: N clients, each sends its next request
when the last one ended), Poisson (`--rate`, at most `--concurrency` in flight), or the surge
(`--surge RATE:SECONDS,...`, Poisson within each phase). Each method of `--methods` is a value of
the request's `speculation` field ("none" sends "off", "auto" sends "auto", any other method
{"method": M, "k": K}), run one after another on the same prompts.

Measured per request on the client, from the moment it sent the request:
- TTFT: to the first streamed token; E2E: to the end of the stream (its last event);
- TPOT = (E2E - TTFT) / (tokens - 1): the fair per-token figure under speculation, where one
  chunk may carry several tokens;
- ITL: gaps between successive streamed chunks (vLLM's definition; a chunk may carry several tokens).
Per (method, concurrency or phase, task class, and "all"): their p50 / p99, output throughput
(tokens over the run's wall time), request throughput, goodput (requests per second meeting every
`--goodput` SLO), requests refused (429) or failed, and the server's own speculation counters over
the run (scraped from /metrics before and after).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Sequence

import numpy as np

SPEC_COUNTERS = ("spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
                 "spec_decode_num_accepted_tokens_total")


def speculation_field(method: str, k: int | None):
    if method == "none":
        return "off"
    if method == "auto":
        return "auto"
    return {"method": method} if k is None else {"method": method, "k": k}


def parse_goodput(text: str | None) -> dict[str, float]:
    """"ttft:2000,tpot:100,e2el:20000" (milliseconds, vLLM's flag) -> {"ttft": 2.0, ...} seconds."""
    out = {}
    for part in (text or "").split(","):
        if not part.strip():
            continue
        name, _, value = part.partition(":")
        if name not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"--goodput {text!r}: give ttft:MS,tpot:MS,e2el:MS (any of them)")
        try:
            out[name] = float(value) / 1e3
        except ValueError:
            raise ValueError(f"--goodput {text!r}: {value!r} is not a number of milliseconds") from None
    return out


async def one_request(client, url: str, body: dict) -> dict:
    """Streams one completion; returns its client-side timings (seconds from the send)."""
    t0 = time.perf_counter()
    chunks, tokens, finish, err = [], 0, None, None
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                return dict(status=r.status_code, error=text[:200], sent=t0)
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                if "error" in ev:
                    err = ev["error"].get("message")
                    break
                n = sum(len(c.get("token_ids", [])) for c in ev.get("choices", []))
                if n:
                    chunks.append((time.perf_counter() - t0, n))
                    tokens += n
                for c in ev.get("choices", []):
                    finish = c.get("finish_reason") or finish
    except Exception as e:  # connection refused or reset: counted as failed
        return dict(status=0, error=f"{type(e).__name__}: {e}", sent=t0)
    t_end = time.perf_counter() - t0
    if err is not None or not chunks:
        return dict(status=500, error=err or "no tokens", sent=t0)
    ttft = chunks[0][0]
    return dict(status=200, sent=t0, ttft_s=ttft, e2e_s=t_end, tokens=tokens, finish=finish,
                tpot_s=(t_end - ttft) / (tokens - 1) if tokens > 1 else float("nan"),
                itl_s=[b[0] - a[0] for a, b in zip(chunks, chunks[1:])])


def request_body(model: str, prompt, *, chat: bool, max_tokens: int, speculation) -> dict:
    body = dict(model=model, max_tokens=max_tokens, temperature=0.0, stream=True, return_token_ids=True,
                speculation=speculation, task=prompt.task)
    if chat:
        body["messages"] = [{"role": "user", "content": prompt.text}]
    else:
        body["prompt"] = prompt.text
    return body


async def run_level(base: str, model: str, prompts: Sequence, *, chat: bool, max_tokens: int, speculation,
                    concurrency: int, arrivals: Sequence[float] | None) -> tuple[list[dict], float]:
    """Runs the prompts once: closed loop with `concurrency` clients, or at `arrivals` (seconds
    from the start) with at most `concurrency` in flight. Returns per-request rows and wall time."""
    import httpx

    url = base + ("/v1/chat/completions" if chat else "/v1/completions")
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    rows: list[dict | None] = [None] * len(prompts)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        t0 = time.perf_counter()
        gate = asyncio.Semaphore(concurrency)

        async def send(i):
            if arrivals is not None:
                await asyncio.sleep(max(0.0, t0 + arrivals[i] - time.perf_counter()))
            async with gate:
                body = request_body(model, prompts[i], chat=chat, max_tokens=max_tokens, speculation=speculation)
                start = time.perf_counter() - t0  # when it was sent (taken before the await)
                rows[i] = dict(await one_request(client, url, body), index=i, task=prompts[i].task, start_s=start)

        await asyncio.gather(*(send(i) for i in range(len(prompts))))
        wall = time.perf_counter() - t0
    return rows, wall


def scrape(client, base: str) -> dict[str, float]:
    text = client.get(base + "/metrics").text
    out = {}
    for line in text.splitlines():
        for name in SPEC_COUNTERS:
            if line.startswith(f"specjax:{name} "):
                out[name] = float(line.split()[-1])
    return out


def summarize(rows: list[dict], wall: float, *, slo: dict[str, float]) -> dict:
    ok = [r for r in rows if r["status"] == 200]
    pct = lambda xs, q: float(np.percentile(xs, q)) if xs else float("nan")
    ttft = [r["ttft_s"] for r in ok]
    tpot = [r["tpot_s"] for r in ok if r["tokens"] > 1]
    e2e = [r["e2e_s"] for r in ok]
    itl = [x for r in ok for x in r["itl_s"]]
    good = [r for r in ok if r["ttft_s"] <= slo.get("ttft", float("inf")) and r["e2e_s"] <= slo.get(
        "e2el", float("inf")) and (r["tokens"] <= 1 or r["tpot_s"] <= slo.get("tpot", float("inf")))]
    tokens = sum(r["tokens"] for r in ok)
    return dict(requests=len(rows), completed=len(ok), refused_429=sum(r["status"] == 429 for r in rows),
                failed=sum(r["status"] not in (200, 429) for r in rows), tokens=tokens, wall_s=wall,
                output_tok_s=tokens / wall, request_per_s=len(ok) / wall, goodput_req_s=len(good) / wall,
                ttft_p50_s=pct(ttft, 50), ttft_p99_s=pct(ttft, 99), tpot_p50_s=pct(tpot, 50),
                tpot_p99_s=pct(tpot, 99), itl_p50_s=pct(itl, 50), itl_p99_s=pct(itl, 99),
                e2e_p50_s=pct(e2e, 50), e2e_p99_s=pct(e2e, 99))


def markdown(records: list[dict]) -> str:
    ms = lambda x: "-" if x != x else f"{x * 1e3:.0f}"
    head = ("| method | load | task | done/reqs | 429 | tok/s | goodput req/s | TTFT p50/p99 ms | "
            "TPOT p50/p99 ms | ITL p50/p99 ms | E2E p50/p99 ms | accept. rate |\n" + "|---" * 12 + "|\n")
    rows = [f"| {r['method']} | {r['load']} | {r['task']} | {r['completed']}/{r['requests']} | {r['refused_429']} | "
            f"{r['output_tok_s']:.1f} | {r['goodput_req_s']:.2f} | {ms(r['ttft_p50_s'])}/{ms(r['ttft_p99_s'])} | "
            f"{ms(r['tpot_p50_s'])}/{ms(r['tpot_p99_s'])} | {ms(r['itl_p50_s'])}/{ms(r['itl_p99_s'])} | "
            f"{ms(r['e2e_p50_s'])}/{ms(r['e2e_p99_s'])} | "
            f"{'' if r.get('draft_acceptance_rate') is None else '%.2f' % r['draft_acceptance_rate']} |"
            for r in records]
    return head + "\n".join(rows)


def main(args) -> int:
    """The CLI entry for `specjax loadbench --url URL`."""
    from specjax.bench import surge

    base, methods, phases, conc, slo, prompts = _check(args)
    model, options, info = _server(base)
    loaded = {o.split(":")[0] for o in options}
    bad = [m for m in methods if m not in ("none", "auto") and m not in loaded]
    if bad or not methods:
        raise ValueError(f"--methods {args.methods!r}: this server loaded {', '.join(options)} "
                         "(use none, auto or one of those)")
    if args.max_new_tokens > info["max_tokens"]:
        raise ValueError(f"--max-new-tokens {args.max_new_tokens}: the server allows at most {info['max_tokens']}")
    arrivals, phase_of = None, None
    if phases:
        arrivals, phase_of = surge.arrivals(phases)
        prompts = [prompts[i % len(prompts)] for i in range(len(arrivals))]
    elif args.rate:
        from specjax.serving.scheduler import poisson_arrivals

        arrivals = poisson_arrivals(len(prompts), args.rate)
    print(f"{base}: model {model}, options {', '.join(options)}; {len(prompts)} prompts, "
          f"{args.max_new_tokens} new tokens, methods {', '.join(methods)}, concurrency {conc}, "
          f"{'surge ' + args.surge if phases else 'Poisson %.2f req/s' % args.rate if args.rate else 'closed loop'}",
          file=sys.stderr)
    records, raw = _measure(args, base, model, prompts, methods, conc, arrivals, phases, phase_of, slo)
    print(markdown(records))
    print("\nLatency counts from the moment the client sent the request. TPOT = (E2E - TTFT) / (tokens - 1); "
          "ITL: gaps between streamed chunks. Goodput: requests/s meeting " +
          ", ".join(f"{k} <= {v * 1e3:.0f} ms" for k, v in slo.items()) + ".")
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(dict(records=records, requests=raw), f, indent=1)
    bad_runs = [r for r in records if r["task"] == "all" and r["failed"]]
    return 1 if bad_runs else 0


def _check(args):
    """The flags, checked before any request: (base URL, methods, surge phases, concurrency levels,
    goodput SLOs, prompts)."""
    from specjax.bench import surge
    from specjax.bench.offline import SYNTHETIC_PROMPT
    from specjax.bench.load import DEFAULT_CONCURRENCY, int_list, interleave
    from specjax.bench.prompts import bench_prompts, check_output_paths

    base = args.url.rstrip("/")
    if not base.startswith(("http://", "https://")):
        raise ValueError(f"--url {args.url!r}: give the server's base URL, e.g. http://127.0.0.1:8000")
    methods = tuple(dict.fromkeys(m.strip() for m in args.methods.split(",") if m.strip()))
    phases = surge.parse_phases(args.surge) if args.surge else None
    conc = int_list(args.concurrency, "concurrency") if args.concurrency else (
        (16,) if phases else DEFAULT_CONCURRENCY)
    if any(c < 1 for c in conc):
        raise ValueError(f"--concurrency {args.concurrency}: each level must be >= 1")
    if args.rate is not None and not args.rate > 0:
        raise ValueError(f"--rate {args.rate}: must be > 0 requests per second")
    slo = parse_goodput(getattr(args, "goodput", None) or "ttft:2000,tpot:100")
    check_output_paths(args.json_path)
    prompts = bench_prompts(args.prompts_file, per_task=args.per_task, tasks=args.tasks, default=SYNTHETIC_PROMPT)
    return base, methods, phases, conc, slo, (prompts if args.file_order else interleave(prompts))


def _server(base: str):
    """(model id, speculation options, /v1/models' entry) of a healthy server at `base`."""
    import httpx

    with httpx.Client(timeout=10) as c:
        try:
            info = c.get(base + "/v1/models").json()["data"][0]
            healthy = c.get(base + "/health").status_code == 200
        except httpx.HTTPError as e:
            raise ValueError(f"cannot reach a specjax server at {base}: {e}; start one with `specjax serve`") from None
    if not healthy:
        raise ValueError(f"{base}/health is not 200 (still compiling?): wait for it, then run again")
    return info["id"], info["speculation"]["options"], info


def _measure(args, base, model, prompts, methods, conc, arrivals, phases, phase_of, slo):
    """Every (concurrency, method) against the server: the records per task (and phase) and the raw
    request rows."""
    import httpx

    from specjax.bench import surge

    records, raw = [], []
    spans = surge.windows(phases) if phases else []
    with httpx.Client(timeout=10) as mc:
        for c in conc:
            for m in methods:
                before = scrape(mc, base)
                rows, wall = asyncio.run(run_level(
                    base, model, prompts, chat=args.chat, max_tokens=args.max_new_tokens,
                    speculation=speculation_field(m, args.k), concurrency=c, arrivals=arrivals))
                after = scrape(mc, base)
                d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in SPEC_COUNTERS}
                acc = dict(num_drafts=d[SPEC_COUNTERS[0]], num_draft_tokens=d[SPEC_COUNTERS[1]],
                           num_accepted_tokens=d[SPEC_COUNTERS[2]],
                           draft_acceptance_rate=d[SPEC_COUNTERS[2]] / d[SPEC_COUNTERS[1]] if d[SPEC_COUNTERS[1]] else None)
                load = f"x{c}" if arrivals is None else (f"surge x{c}" if phases else f"{args.rate}/s x{c}")
                groups = {"all": rows}
                for r in rows:
                    groups.setdefault(str(r["task"]), []).append(r)
                for r in rows if phases else ():
                    groups.setdefault(f"phase {phase_of[r['index']]}", []).append(r)
                for task, sel in groups.items():
                    span = wall  # a phase's throughput is over its own window
                    if task.startswith("phase "):
                        lo, hi = spans[int(task.split()[1])]
                        span = hi - lo
                    rec = dict(method=m, load=load, concurrency=c, task=task, **summarize(sel, span, slo=slo))
                    records.append(dict(rec, **acc) if task == "all" else rec)
                raw += [dict(r, method=m, concurrency=c) for r in rows]
                print(f"  {m} {load}: {records[-len(groups)]['output_tok_s']:.1f} tok/s", file=sys.stderr)
    return records, raw
