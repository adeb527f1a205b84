"""Whether large and malformed bodies slow a server's other clients: a stream's gaps and /health.

    .venv/bin/specjax serve --model smollm2-135m --method ngram --k 4 --slots 4 --port 8031 &
    .venv/bin/python -m specjax.bench.experiments.hostile_latency http://127.0.0.1:8031 --rounds 2

Each round has two phases. In both, one streaming chat request (plain, `--max-tokens` tokens) runs
while /health is polled every 50 ms. In the hostile phase, once the stream has begun, these bodies
are sent one after another, each on its own connection: an 8 MB message, JSON nested 100,000
deep, a 5,000-digit integer, a lone surrogate, `top_k` 2**70, and a 1.9 MB message (under a 2 MiB
body limit). Printed per phase: the stream's largest and median gap between events, /health's
largest and median latency; per hostile body, its status and how long its answer took. Several
URLs are measured in turn, phase by phase (an A/B of two servers on one machine in one run).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import httpx


def hostile_bodies(model: str) -> list[tuple[str, bytes]]:
    chat = lambda content, **kw: json.dumps({"model": model, "messages": [{"role": "user", "content": content}],
                                             "max_tokens": 4, **kw}).encode()
    return [
        ("8 MB message", chat("a " * (4 << 20))),
        ("100k-deep JSON", b"[" * 100_000 + b"]" * 100_000),
        ("5000-digit int", chat("hi")[:-1] + b', "seed": ' + b"9" * 5000 + b"}"),
        ("lone surrogate", b'{"model": "' + model.encode() + b'", "messages": [{"role": "user", '
                           b'"content": "hi \\ud800 there"}]}'),
        ("top_k 2**70", chat("hi", top_k=2 ** 70)),
        ("1.9 MB message", chat("a " * 950_000)),
    ]


async def phase(url: str, model: str, max_tokens: int, hostile: bool) -> dict:
    async with httpx.AsyncClient(timeout=120) as c:
        events, health, answers, done = [], [], [], asyncio.Event()

        async def stream():
            body = {"model": model, "messages": [{"role": "user", "content": "Write a docker-compose file for "
                                                  "a web app with Redis and Postgres."}],
                    "max_tokens": max_tokens, "stream": True, "speculation": "off"}
            async with c.stream("POST", url + "/v1/chat/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        events.append(time.perf_counter())
            done.set()

        async def poll():
            while not done.is_set():
                t0 = time.perf_counter()
                await c.get(url + "/health")
                health.append(time.perf_counter() - t0)
                await asyncio.sleep(0.05)

        async def attack():
            while not events and not done.is_set():
                await asyncio.sleep(0.01)
            for name, raw in hostile_bodies(model) if hostile else []:
                t0 = time.perf_counter()
                try:
                    async with httpx.AsyncClient(timeout=120) as one:
                        r = await one.post(url + "/v1/chat/completions", content=raw,
                                           headers={"content-type": "application/json"})
                    status = r.status_code
                except httpx.HTTPError as e:
                    status = type(e).__name__
                answers.append((name, status, time.perf_counter() - t0))

        await asyncio.gather(stream(), poll(), attack())
    gaps = [b - a for a, b in zip(events, events[1:])]
    return dict(gap_max=max(gaps), gap_p50=statistics.median(gaps), health_max=max(health),
                health_p50=statistics.median(health), polls=len(health), answers=answers)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("urls", nargs="+")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args()
    for r in range(a.rounds):
        for hostile in (False, True):
            for url in a.urls:
                out = asyncio.run(phase(url, a.model, a.max_tokens, hostile))
                print(f"round {r} {'hostile ' if hostile else 'baseline'} {url}: stream gap max {out['gap_max']:.3f} s "
                      f"p50 {out['gap_p50']:.3f} s; /health max {out['health_max']:.3f} s p50 "
                      f"{out['health_p50']:.3f} s ({out['polls']} polls)", flush=True)
                for name, status, seconds in out["answers"]:
                    print(f"    {name:>16}: {status} in {seconds:.3f} s", flush=True)


if __name__ == "__main__":
    main()
