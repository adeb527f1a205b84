"""What HTTP adds to time to first token at concurrency 1: the client's TTFT beside the server's own.

    .venv/bin/specjax serve --model smollm2-135m --method none --slots 16 --batch-sizes 1,2,4,8 \
        --max-tokens 256 --max-prompt-tokens 81 --port 8019 &
    .venv/bin/python -m specjax.bench.experiments.http_ttft http://127.0.0.1:8019 --per-task 4 --rounds 2

One streaming chat request at a time (8 new tokens). Per request: the client's TTFT (from sending
to the first content chunk, httpx), and the server's (from the request's arrival in the handler to
its first token, read as the increase of `specjax:time_to_first_token_seconds_sum` on /metrics, which
is scraped before and after each request, outside the timed span). The difference is the share of
HTTP, JSON and SSE the server does not see; the server's own TTFT beside the in-process
scheduler's (`specjax loadbench --concurrency 1`) is the rest of the overhead.
"""

from __future__ import annotations

import argparse
import re
import statistics
import time

import httpx

from specjax.bench.prompts import bench_prompts

_SUM = re.compile(r"^specjax:time_to_first_token_seconds_sum(?:\{[^}]*\})? ([0-9.eE+-]+)$", re.M)


def _server_ttft_sum(client: httpx.Client, url: str) -> float:
    return sum(float(x) for x in _SUM.findall(client.get(url + "/metrics").text))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("url")
    p.add_argument("--prompts-file", default="ops", help="a file, or a shipped set (default: ops)")
    p.add_argument("--per-task", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--model", default="smollm2-135m")
    a = p.parse_args()
    prompts = bench_prompts(a.prompts_file, per_task=a.per_task, tasks=None, default="")
    client_s, server_s = [], []
    with httpx.Client(timeout=120) as c:
        for _ in range(a.rounds):
            for pr in prompts:
                body = {"model": a.model, "messages": [{"role": "user", "content": pr.text}],
                        "max_tokens": 8, "stream": True}
                before = _server_ttft_sum(c, a.url)
                t0 = time.perf_counter()
                first = None
                with c.stream("POST", a.url + "/v1/chat/completions", json=body) as r:
                    r.raise_for_status()
                    for line in r.iter_lines():
                        if first is None and line.startswith("data: ") and '"content"' in line:
                            first = time.perf_counter() - t0
                if first is None:
                    raise SystemExit(f"no content chunk for prompt {pr.id}")
                client_s.append(first)
                server_s.append(_server_ttft_sum(c, a.url) - before)
    diff = [x - y for x, y in zip(client_s, server_s)]
    ms = lambda xs: ", ".join(f"{1e3 * x:.1f}" for x in xs)
    print(f"client TTFT ms: {ms(client_s)}\nserver TTFT ms: {ms(server_s)}")
    print(f"median client {1e3 * statistics.median(client_s):.1f} ms, server {1e3 * statistics.median(server_s):.1f} "
          f"ms; client - server per request: median {1e3 * statistics.median(diff):.1f} ms, "
          f"max {1e3 * max(diff):.1f} ms ({len(diff)} requests)")


if __name__ == "__main__":
    main()
