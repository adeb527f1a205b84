"""The HTTP server: the official `openai` client against a tiny model on 127.0.0.1.

One server (prompt lookup, k=4, with the plain loop beside it, 4 slots) is shared by the module;
the SIGTERM test runs its own in a subprocess (this file run as a script). Every wait is bounded.
"""

import asyncio
import contextlib
import gc
import hashlib
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import need_module
from tiny_server import (MAX_TOKENS, MODEL, PROMPTS, HookedBatch, free_port, healthy, idle, running, shared_engine,
                         tiny_engine, tiny_server, wait_until)

from specjax.core import ngram_table
from specjax.methods.config import SpecConfig
from specjax.serving.engine import Engine
from specjax.serving import server as srv


@pytest.fixture(scope="module")
def served():
    eng = shared_engine()
    server = tiny_server(eng)
    with running(server) as url:
        yield eng, server, url


@pytest.fixture(scope="module")
def reference(served):
    """Engine.generate's greedy tokens for each prompt, chat and completion (the oracle)."""
    eng = served[0]
    out = {}
    for p in PROMPTS:
        out[("chat", p)] = eng.generate([p], chat=True, max_new_tokens=MAX_TOKENS)[0].tokens
        out[("completion", p)] = eng.generate([p], max_new_tokens=MAX_TOKENS)[0].tokens
    return out


@pytest.fixture
def client(served):
    openai = need_module("openai")
    return openai.OpenAI(base_url=served[2] + "/v1", api_key="test", max_retries=0, timeout=60)


def live_device_bytes() -> tuple[int, int]:
    """(arrays alive, the bytes the runtime reports for their buffers): device memory as measured on
    any backend (the CPU's allocator reports no bytes in use). Garbage (earlier tests' servers) is
    collected first."""
    gc.collect()
    arrays = [x for x in jax.live_arrays() if not x.is_deleted()]
    return len(arrays), sum(x.on_device_size_in_bytes() for x in arrays)


def _text(eng, tokens):
    return eng.tokenizer.decode(tokens, skip_special=True)


@pytest.mark.parametrize("speculation", ["off", "auto", {"method": "ngram", "k": 4}])
def test_openai_client_greedy_equals_generate(served, reference, client, speculation):
    """Chat and completion, streamed and not: the tokens and text of Engine.generate, plain and
    with prompt lookup; usage and finish_reason as OpenAI's."""
    eng, server, _ = served
    compiled = eng.compile_count  # the warm-up compiled every program: no request compiles anything
    extra = {"speculation": speculation, "return_token_ids": True}
    for p in PROMPTS[:2]:
        ref = reference[("chat", p)]
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": p}],
                                           max_tokens=MAX_TOKENS, extra_body=extra)
        choice = r.choices[0]
        assert choice.model_extra["token_ids"] == ref
        assert choice.message.content == _text(eng, ref) and choice.message.role == "assistant"
        assert choice.finish_reason == ("length" if len(ref) == MAX_TOKENS else "stop")
        n_prompt = len(eng.encode([p], chat=True)[0])
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (n_prompt, len(ref))
        spec = r.model_extra["metrics"]["speculative_decoding"]
        assert (spec["num_drafts"] == 0) == (speculation == "off")

        toks, text, finish = [], "", None
        stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": p}],
                                                max_tokens=MAX_TOKENS, stream=True, extra_body=extra,
                                                stream_options={"include_usage": True})
        usage = None
        for ch in stream:
            if ch.usage is not None:
                usage = ch.usage
            for c in ch.choices:
                toks += c.model_extra.get("token_ids", [])
                text += c.delta.content or ""
                finish = c.finish_reason or finish
        assert toks == ref and text == _text(eng, ref) and finish == choice.finish_reason
        assert usage.completion_tokens == len(ref)

        ref = reference[("completion", p)]
        r = client.completions.create(model=MODEL, prompt=p, max_tokens=MAX_TOKENS, extra_body=extra)
        assert r.choices[0].model_extra["token_ids"] == ref and r.choices[0].text == _text(eng, ref)
        toks, text = [], ""
        for ch in client.completions.create(model=MODEL, prompt=p, max_tokens=MAX_TOKENS, stream=True,
                                            extra_body=extra):
            toks += ch.choices[0].model_extra.get("token_ids", [])
            text += ch.choices[0].text
        assert toks == ref and text == _text(eng, ref)
    assert eng.compile_count == compiled
    wait_until(lambda: idle(server), 10, "the engine to go idle")


def test_auto_server_greedy_equals_generate(served, reference):
    """A `--method auto` server (the controller over plain and prompt lookup; the module's
    programs but auto's bare ones, so mostly the calibration runs): the controller decides "auto" requests, and every
    request, auto, off or naming its method, decodes Engine.generate's greedy tokens."""
    from specjax.serving.controller import ControllerConfig

    eng = served[0]
    compiled = eng.compile_count
    sched = srv.scheduler_for(eng, method="auto", controller=ControllerConfig(ks=(0, 4)), slots=4,
                              max_tokens=MAX_TOKENS, max_prompt_tokens=64, chunk=4, history=64)
    server = srv.Server(sched, srv.ServeConfig(model_name=MODEL))
    with running(server) as url:
        info = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["speculation"]
        assert info == {"mode": "auto", "options": ["none", "ngram:4"]}
        for spec in ("auto", "off", {"method": "ngram", "k": 4}):
            for p in PROMPTS:
                body = {"model": MODEL, "prompt": p, "max_tokens": MAX_TOKENS, "return_token_ids": True,
                        "speculation": spec, "stream": True}
                toks = []
                with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: {"):
                            toks += json.loads(line[6:])["choices"][0].get("token_ids", [])
                assert toks == reference[("completion", p)], (spec, p)
            r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
                "model": MODEL, "messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": MAX_TOKENS,
                "return_token_ids": True, "speculation": spec}).json()
            assert r["choices"][0]["token_ids"] == reference[("chat", PROMPTS[0])]
        wait_until(lambda: idle(server), 10, "the engine to go idle")
        reasons = {c.reason for c in sched.chunk_log}
        assert "fixed" not in reasons and {"opt_out", "requested"} <= reasons, reasons
        assert any(c.option == "ngram:4" and c.reason not in ("requested",) for c in sched.chunk_log)
    # auto's own programs: its bare plain loop, and a bare insert per prompt bucket
    assert eng.compile_count == compiled + 1 + len(sched.batch.insert_buckets)


def test_sampling_per_request(served, reference):
    """A server that compiled the sampled programs: a request that names its seed samples what
    Engine.generate samples with that seed and temperature (plain chunks), and the same twice with
    prompt lookup over an unchanged n-gram table; temperature 0, and top_k 1, decode greedily;
    other seeds differ."""
    openai = need_module("openai")
    eng = served[0]
    with running(tiny_server(eng, temperature=1.0)) as url:
        c = openai.OpenAI(base_url=url + "/v1", api_key="s", max_retries=0, timeout=60)

        def ask(p, **kw):
            r = c.completions.create(model=MODEL, prompt=p, max_tokens=MAX_TOKENS,
                                     extra_body=dict(return_token_ids=True, **kw.pop("extra", {})), **kw)
            return r.choices[0].model_extra["token_ids"]

        for p in PROMPTS[:2]:
            want = eng.generate([p], max_new_tokens=MAX_TOKENS, temperature=1.3, seed=5)[0].tokens
            assert ask(p, temperature=1.3, seed=5, extra={"speculation": "off"}) == want
            # with speculation the sample also depends on the drafts: the same with an unchanged table
            same = dict(extra={"contribute": False})
            assert ask(p, temperature=1.3, seed=5, **same) == ask(p, temperature=1.3, seed=5, **same)
            assert ask(p, temperature=0.0) == reference[("completion", p)]
            assert ask(p, temperature=1.3, extra={"top_k": 1}) == reference[("completion", p)]
            assert ask(p, temperature=1.3, top_p=1e-6) == reference[("completion", p)]  # the top token only
        outs = {tuple(ask(PROMPTS[2], temperature=1.5, seed=s, extra={"speculation": "off"})) for s in range(4)}
        assert len(outs) > 1


def test_stop_strings_and_max_tokens(served, reference, client):
    eng, _, _ = served
    ref = reference[("completion", PROMPTS[0])]
    full = _text(eng, ref)
    stop = full[3:5]
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, stop=[stop])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == full[: full.find(stop)]
    text = "".join(ch.choices[0].text for ch in client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, stop=stop, stream=True))
    assert text == full[: full.find(stop)]
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=3)
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                                  extra_body={"stop_token_ids": [ref[2]], "return_token_ids": True})
    got = r.choices[0].model_extra["token_ids"]
    assert got == ref[: ref.index(ref[2]) + 1] and r.choices[0].finish_reason == "stop"


def test_bad_requests_are_rejected_before_any_compile(served, client):
    eng, server, url = served
    before = eng.compile_count
    msg = [{"role": "user", "content": "hi"}]
    cases = [
        (b"{not json", 400, None),
        (json.dumps({"model": "gpt-4", "messages": msg}), 404, "model"),
        (json.dumps({"model": MODEL, "messages": msg, "max_tokens": -1}), 400, "max_tokens"),
        (json.dumps({"model": MODEL, "messages": msg, "max_tokens": MAX_TOKENS + 1}), 400, "max_tokens"),
        (json.dumps({"model": MODEL, "messages": msg, "temperature": -0.5}), 400, "temperature"),
        (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "a" * 80}]}), 400, "prompt"),
        (json.dumps({"model": MODEL, "messages": msg, "speculation": {"method": "medusa"}}), 400, "speculation"),
        (json.dumps({"model": MODEL, "messages": msg, "speculation": {"method": "ngram", "k": 8}}), 400,
         "speculation"),
        (json.dumps({"model": MODEL, "messages": msg, "speculation": "sometimes"}), 400, "speculation"),
        (json.dumps({"model": MODEL}), 400, "messages"),
        (json.dumps({"model": MODEL, "messages": msg, "top_p": 0}), 400, "top_p"),
        (json.dumps({"model": MODEL, "messages": msg, "logprobs": True, "top_logprobs": 21}), 400, "top_logprobs"),
        (json.dumps({"model": MODEL, "messages": msg, "n": 2}), 400, "n"),
    ]
    for body, status, param in cases:
        r = httpx.post(url + "/v1/chat/completions", content=body, headers={"content-type": "application/json"})
        assert r.status_code == status, (body, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
        assert err["param"] == param or (param and err["param"].startswith(param)), (body, err)
    openai = need_module("openai")
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model=MODEL, messages=msg, temperature=-1)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")
    assert eng.compile_count == before and idle(server)


def test_bad_requests_compile_nothing_and_health_waits_for_warm_up():
    """On a server whose engine never started: bad requests get their 400/404 all the same, good
    ones 503 (warming up), /health 503, and nothing was compiled."""
    from starlette.testclient import TestClient

    eng = tiny_engine()
    server = tiny_server(eng)
    c = TestClient(server.app)  # no lifespan: the engine thread never starts
    msg = [{"role": "user", "content": "hi"}]
    for body, status in [({"model": MODEL, "messages": msg, "max_tokens": -1}, 400),
                         ({"model": MODEL, "messages": msg, "temperature": -1}, 400),
                         ({"model": "other", "messages": msg}, 404),
                         ({"model": MODEL, "prompt": "a" * 80}, 400),
                         ({"model": MODEL, "messages": msg, "speculation": {"method": "eagle", "k": 3}}, 400)]:
        path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
        r = c.post(path, json=body)
        assert r.status_code == status and r.json()["error"]["message"], (body, r.text)
    r = c.post("/v1/chat/completions", json={"model": MODEL, "messages": msg})
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert c.get("/health").status_code == 503
    assert eng.compile_count == 0 and server.sched.state is None


def scrape(url: str) -> dict[tuple, float]:
    """GET /metrics parsed: (sample name, sorted labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for smp in fam.samples:
            out[(smp.name, tuple(sorted(smp.labels.items())))] = smp.value
    return out


def metric(m: dict, name: str, **labels) -> float:
    return m.get(("specjax:" + name, tuple(sorted(labels.items()))), 0.0)


def test_models_health_metrics(served, client):
    """/metrics exposes every metric the issue names, and their values agree with the requests'
    own counters: the speculation counters (totals and per position), per-class acceptance,
    chunks per option and the fraction speculated, queue depth and running requests, the TTFT /
    ITL / e2e histograms, requests by finish reason, and memory as measured."""
    eng, server, url = served
    ids = [m.id for m in client.models.list()]
    assert ids == [MODEL]
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    wait_until(lambda: idle(server), 10, "the engine to go idle")
    before = scrape(url)
    counters, tokens = [], 0
    for p, task in ((PROMPTS[0], "cfgclass"), (PROMPTS[1], "cfgclass"), (PROMPTS[3], "diagclass")):
        by = dict(extra_body={"task": task}) if task == "cfgclass" else dict(extra_headers={"X-Task": task})
        r = client.completions.create(model=MODEL, prompt=p, max_tokens=MAX_TOKENS, **by)
        counters.append((task, r.model_extra["metrics"]["speculative_decoding"]))
        tokens += r.usage.completion_tokens
    r = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=8, extra_body={"speculation": "off"})
    after = scrape(url)
    d = lambda name, **lb: metric(after, name, **lb) - metric(before, name, **lb)
    total = lambda key: sum(c[key] for _, c in counters)
    assert total("num_drafts") > 0 and total("num_accepted_tokens") > 0
    assert d("spec_decode_num_drafts_total") == total("num_drafts")
    assert d("spec_decode_num_draft_tokens_total") == total("num_draft_tokens")
    assert d("spec_decode_num_accepted_tokens_total") == total("num_accepted_tokens")
    per_pos = [sum(c["accepted_tokens_per_pos"][i] for _, c in counters if i < len(c["accepted_tokens_per_pos"]))
               for i in range(4)]
    assert [d("spec_decode_num_accepted_tokens_per_pos_total", position=str(i)) for i in range(4)] == per_pos
    for task in ("cfgclass", "diagclass"):  # per-class acceptance (only this test uses these classes)
        drafted = sum(c["num_draft_tokens"] for t, c in counters if t == task)
        accepted = sum(c["num_accepted_tokens"] for t, c in counters if t == task)
        assert metric(after, "spec_decode_num_draft_tokens_by_task_total", task=task) == drafted
        assert metric(after, "spec_decode_num_accepted_tokens_by_task_total", task=task) == accepted
        assert metric(after, "spec_decode_acceptance_rate_by_task", task=task) == pytest.approx(accepted / drafted)
    chunks = {o: d("chunks_total", option=o) for o in ("none", "ngram:4")}
    assert chunks["ngram:4"] > 0 and chunks["none"] > 0  # the last request ran plain
    assert 0 < metric(after, "chunks_speculated_fraction") < 1
    assert (metric(after, "num_requests_waiting"), metric(after, "num_requests_running")) == (0, 0)
    assert d("request_finished_total", finished_reason="length") + d(
        "request_finished_total", finished_reason="stop") == 4
    for h in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert d(h + "_count") == 4 and d(h + "_sum") > 0
        assert metric(after, h + "_bucket", le="+Inf") == metric(after, h + "_count")
    assert d("inter_token_latency_seconds_count") == tokens + r.usage.completion_tokens - 4  # gaps
    assert metric(after, "memory_bytes", kind="process_rss") > 1e6  # the process's RSS, measured now
    key = ("specjax:memory_startup_bytes", (("kind", "process_rss"), ("stage", "caches_and_programs")))
    assert math.isfinite(after[key])  # what warming up added, measured (< 0 if the allocator gave pages back)
    parts = {p: metric(after, "memory_device_buffer_bytes", part=p)
             for p in ("weights", "draft_weights", "caches", "ngram_table")}
    table = server.sched.table
    assert parts["weights"] >= sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(eng.params))
    assert parts["ngram_table"] > 0 and parts["caches"] > 0 and parts["draft_weights"] == 0
    assert parts["ngram_table"] >= server.sched.memory().parts["ngram_table"] and table is not None


async def _stream(url, prompt, *, cancel_after: int | None, key: str = "test", max_tokens: int = MAX_TOKENS):
    """Streams a chat completion; with `cancel_after`, closes the connection after that many
    chunks. Returns (token ids, finish_reason)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "stream": True, "return_token_ids": True, "speculation": "off"}
    toks, finish, chunks = [], None, 0
    async with httpx.AsyncClient(timeout=60) as c:
        async with c.stream("POST", url + "/v1/chat/completions", json=body,
                            headers={"authorization": f"Bearer {key}"}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ch = json.loads(line[6:])
                assert "error" not in ch, ch
                for c0 in ch["choices"]:
                    toks += c0.get("token_ids", [])
                    finish = c0["finish_reason"] or finish
                chunks += 1
                if cancel_after is not None and chunks >= cancel_after:
                    return toks, "closed"
    return toks, finish


def test_32_streams_half_cancelled_by_disconnect(served, reference, monkeypatch):
    eng, server, url = served
    sched = server.sched
    wait_until(lambda: idle(server), 10, "the engine to go idle")
    step = sched.step

    def slow_step():  # a chunk takes long enough for the cancels to land mid-stream
        time.sleep(0.01)
        return step()

    monkeypatch.setattr(sched, "step", slow_step)
    # the baseline: an idle server that has served (the scheduler keeps the last chunk's outputs)
    httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 2}, timeout=60)
    wait_until(lambda: idle(server), 10, "the engine to go idle")
    rss0 = server.metrics.memory.labels(kind="process_rss")._value.get()
    live0 = live_device_bytes()
    m0 = scrape(url)

    async def main():
        jobs = [_stream(url, PROMPTS[i % len(PROMPTS)], cancel_after=2 if i % 2 else None) for i in range(32)]
        return await asyncio.wait_for(asyncio.gather(*jobs), 120)

    out = asyncio.run(main())
    for i, (toks, finish) in enumerate(out):
        ref = reference[("chat", PROMPTS[i % len(PROMPTS)])]
        if i % 2:
            assert finish == "closed" and toks == ref[: len(toks)]
        else:
            assert toks == ref and finish in ("stop", "length")
    wait_until(lambda: idle(server), 20, "every slot to be freed and the queue to empty")
    ours = list(sched.requests)[-32:]  # the bounded history (64) holds these 32 last
    cancelled = [r for r in ours if r.status == "cancelled"]
    assert len(cancelled) >= 8  # those that had not finished when their client left
    assert all(r.status in ("finished", "cancelled") for r in ours)
    rows = sched.snapshot().rows
    assert all(r.slot is None or rows[r.slot] is None or rows[r.slot].request != r.id for r in cancelled)
    assert len(sched.requests) <= 64 and len(sched.chunk_log) <= 64  # the bounded history
    assert not server.engine.jobs and server.engine._cmds.empty() and not sched.live
    m1 = scrape(url)
    assert (metric(m1, "num_requests_waiting"), metric(m1, "num_requests_running")) == (0, 0)
    assert metric(m1, "request_finished_total", finished_reason="cancelled") - metric(
        m0, "request_finished_total", finished_reason="cancelled") == len(cancelled)
    # memory: the device buffers alive are those before, byte for byte; the RSS is back near its baseline
    assert live_device_bytes() == live0
    rss1 = server.metrics.memory.labels(kind="process_rss")._value.get()
    assert rss1 - rss0 < 100e6


def test_queue_full_gives_429_with_retry_after(served, monkeypatch):
    eng, server, url = served
    wait_until(lambda: idle(server), 10, "the engine to go idle")
    gate = threading.Event()
    step = server.sched.step

    in_step = threading.Event()

    def blocked_step():
        in_step.set()
        gate.wait(30)
        return step()

    monkeypatch.setattr(server.sched, "step", blocked_step)
    cap = server.engine.capacity
    body = {"model": MODEL, "prompt": "a", "max_tokens": 2}

    async def main():
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=cap + 4)) as c:
            first = [asyncio.create_task(c.post(url + "/v1/completions", json=body)) for _ in range(cap)]
            await asyncio.sleep(0.2)
            t_end = time.monotonic() + 20
            while (server.engine.pending < cap or not in_step.is_set()) and time.monotonic() < t_end:
                await asyncio.sleep(0.05)
            over = await c.post(url + "/v1/completions", json=body)
            m = await asyncio.to_thread(scrape, url)  # the queue depth while the engine is held in a chunk
            gate.set()
            return over, m, await asyncio.gather(*first)

    try:
        over, m, first = asyncio.run(main())
    finally:
        gate.set()
    running, waiting = metric(m, "num_requests_running"), metric(m, "num_requests_waiting")
    assert 1 <= running <= server.sched.b and running + waiting == cap, (running, waiting)
    assert over.status_code == 429 and over.headers["retry-after"] == "1"
    assert over.json()["error"]["type"] == "rate_limit_error"
    assert all(r.status_code == 200 for r in first)
    wait_until(lambda: idle(server), 20, "the engine to go idle")


def test_first_token_streams_before_the_first_chunk(served, monkeypatch):
    """The first token (from the prefill) reaches the client before the chunk after it has run."""
    eng, server, url = served
    wait_until(lambda: idle(server), 10, "the engine to go idle")
    monkeypatch.setattr(server.sched.batch, "before_run", lambda: time.sleep(2.0))  # a slow chunk
    body = {"model": MODEL, "prompt": PROMPTS[2], "max_tokens": 8, "stream": True, "speculation": "off"}
    t0, first = time.perf_counter(), None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and first is None:
                first = time.perf_counter() - t0
    total = time.perf_counter() - t0
    assert first < 1.5 and total > 2.0, (first, total)
    wait_until(lambda: idle(server), 10, "the engine to go idle")


def test_deadline_ends_with_timeout(served, client, monkeypatch):
    eng, server, url = served
    step = server.sched.step

    def slow_step():
        time.sleep(0.1)
        return step()

    monkeypatch.setattr(server.sched, "step", slow_step)
    r = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=MAX_TOKENS,
                                  extra_body={"timeout": 0.25, "speculation": "off"})
    assert r.choices[0].finish_reason == "timeout" and r.usage.completion_tokens < MAX_TOKENS
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=MAX_TOKENS, stream=True,
                                            extra_body={"timeout": 0.25, "speculation": "off"}))
    assert chunks[-1].choices[0].finish_reason == "timeout"
    wait_until(lambda: idle(server), 10, "the engine to go idle")


def test_a_failing_request_fails_alone_and_an_engine_error_fails_only_those_in_flight(
        served, reference, client, monkeypatch):
    eng, server, url = served
    sched = server.sched
    need_module("openai")
    bad = eng.tokenizer.encode("QQQ")

    def failing_insert(inputs):  # an error in this request's admission (before its prefill ran)
        if _prompt_of(inputs) == bad:
            raise RuntimeError("this request's prefill failed")

    monkeypatch.setattr(sched.batch, "before_insert", failing_insert)
    submit, late = sched.submit, eng.tokenizer.encode("ZZZ")

    def late_check(ids, **kw):  # bad input caught only by the scheduler: that request's 400
        if list(ids) == late:
            raise ValueError("the scheduler refuses this prompt")
        return submit(ids, **kw)

    monkeypatch.setattr(sched, "submit", late_check)

    async def main():
        async with httpx.AsyncClient(timeout=60) as c:
            post = lambda p: c.post(url + "/v1/completions", json={"model": MODEL, "prompt": p, "max_tokens": MAX_TOKENS,
                                                                   "return_token_ids": True})
            return await asyncio.gather(post("QQQ"), post("ZZZ"), *(post(p) for p in PROMPTS))

    failed, refused, *ok = asyncio.run(main())
    assert failed.status_code == 500 and "prefill failed" in failed.json()["error"]["message"]
    assert refused.status_code == 400 and refused.json()["error"]["message"] == "the scheduler refuses this prompt"
    for p, r in zip(PROMPTS, ok):
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == reference[("completion", p)]
    assert all(r.status != "queued" for r in sched.requests)

    failed = []

    def device_error():  # once all four are running, one chunk fails as a device error would
        if not failed and sched.snapshot().running == sched.b:
            failed.append(1)
            raise RuntimeError("XLA device lost")

    step = sched.step

    def slow_step():  # so that the four are all admitted before the first ones finish
        time.sleep(0.05)
        return step()

    monkeypatch.setattr(sched.batch, "before_run", device_error)
    monkeypatch.setattr(sched, "step", slow_step)

    async def in_flight():
        async with httpx.AsyncClient(timeout=60) as c:
            common = {"model": MODEL, "max_tokens": MAX_TOKENS, "speculation": "off"}
            body = lambda p, stream: {**common, "prompt": p, "stream": stream}

            async def streamed(p):
                events = []
                async with c.stream("POST", url + "/v1/completions", json=body(p, True)) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            events.append(json.loads(line[6:]))
                return r.status_code, events

            return await asyncio.wait_for(asyncio.gather(
                c.post(url + "/v1/completions", json=body(PROMPTS[0], False)),
                c.post(url + "/v1/chat/completions",
                       json={**common, "messages": [{"role": "user", "content": PROMPTS[1]}]}),
                streamed(PROMPTS[2]), streamed(PROMPTS[3])), 60)

    plain, chat, *streams = asyncio.run(in_flight())
    assert failed == [1]
    msg = "engine error while decoding: RuntimeError: XLA device lost"
    for r in (plain, chat):  # every request in flight failed, each with the device's message
        assert r.status_code == 500 and msg in r.json()["error"]["message"], r.text
        assert r.json()["error"]["type"] == "server_error"
    for status, events in streams:  # a stream that had begun ends with an OpenAI-shaped error event
        assert status == 200 and msg in events[-1]["error"]["message"], events[-1]
        assert all("error" not in e for e in events[:-1])
    monkeypatch.setattr(sched, "step", step)
    for p in PROMPTS[:2]:  # and the server keeps serving, exactly
        r = client.completions.create(model=MODEL, prompt=p, max_tokens=MAX_TOKENS,
                                      extra_body={"return_token_ids": True})
        assert r.choices[0].model_extra["token_ids"] == reference[("completion", p)]
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    wait_until(lambda: idle(server), 10, "the engine to go idle")


def test_tenants_never_see_each_others_text(served):
    """Tenant A's text enters the n-gram table under A only: the table holds no entry of B's,
    and a lookup of A's own n-grams finds A's followers for A and nothing for B."""
    openai = need_module("openai")
    eng, server, url = served
    a = openai.OpenAI(base_url=url + "/v1", api_key="tenant-a", max_retries=0)
    b = openai.OpenAI(base_url=url + "/v1", api_key="tenant-b", max_retries=0)
    a.completions.create(model=MODEL, prompt="secret: abcdefgh abcdefgh", max_tokens=MAX_TOKENS)
    wait_until(lambda: idle(server), 10, "the engine to go idle")
    table = server.sched.state.table
    before = (np.asarray(table.keys) >= 0).any(axis=1).sum()
    # B reads the table (its own scope) but opts out of contributing to it
    b.completions.create(model=MODEL, prompt="secret: abcdefgh abcdefgh", max_tokens=MAX_TOKENS,
                         extra_body={"contribute": False})
    b.completions.create(model=MODEL, prompt="other: ijklmn ijklmn", max_tokens=MAX_TOKENS,
                         extra_body={"speculation": "off"})  # never speculated on: contributes nothing either
    wait_until(lambda: idle(server), 10, "the engine to go idle")
    ta, tb = server.tenants.id("key:tenant-a"), server.tenants.id("key:tenant-b")
    assert ta != tb and 0 not in (ta, tb)
    table = server.sched.state.table
    keys, follow, owner = np.asarray(table.keys), np.asarray(table.follow), np.asarray(table.owner)
    used = (keys >= 0).any(axis=1)
    assert used.sum() == before  # B wrote nothing
    mine = np.flatnonzero(used & (owner == ta))
    assert mine.size > 0 and not (used & (owner == tb)).any()
    for slot in mine[:16]:  # A's n-grams are proposed to A, never to B
        gram = [int(t) for t in keys[slot] if t >= 0]
        ctx = jnp.asarray([[0] * 4 + gram])
        n = jnp.asarray([ctx.shape[1]])
        for tenant, expect in ((ta, True), (tb, False)):
            draft, found = ngram_table.lookup(table, ctx, n, 4, jnp.asarray([tenant], jnp.int32))
            assert bool(found[0]) == expect, (gram, tenant)
            if expect and len(gram) == table.max_n:
                assert draft[0].tolist() == follow[slot, :4].tolist()


def test_tenant_scopes():
    """Whose scope a request reads and writes. Without keys: its bearer token, else its `user`,
    else the anonymous tenant 0 (advisory). With keys: 401 without one of them; the key decides,
    and `user` only sub-scopes within it. The last `limit` tenants are remembered: one forgotten
    gets a new id when it returns; ids are never reused."""
    from specjax.serving.server.auth import ANONYMOUS, Keys, TenantIds
    from specjax.serving.server.protocol import APIError

    bearer = lambda key: None if key is None else f"Bearer {key}"
    ids = TenantIds(limit=3)
    scope = lambda keys, key=None, user=None: ids.id(keys.tenant(bearer(key), user).scope)
    open_ = Keys()
    a, b = scope(open_, "key-a"), scope(open_, "key-b", "alice")
    assert 0 < a < b and scope(open_, "key-a", "bob") == a  # the token decides, not the user
    alice = scope(open_, None, "alice")
    assert alice not in (0, a, b) and scope(open_, None, "alice") == alice
    assert open_.tenant(None, None) == open_.tenant("Bearer ", None) == open_.tenant("Basic x", None) == ANONYMOUS
    scope(open_, "key-a")  # a is now the most recently seen
    scope(open_, None, "carol")  # forgets the least recently seen: b
    assert len(ids) == 3 and scope(open_, "key-a") == a
    assert scope(open_, "key-b") not in (0, a, b, alice)  # b again: a new id

    keys = Keys(["k1", "k2"])
    for header in (None, "Bearer nope", "k1", "Basic k1", "Bearer"):
        with pytest.raises(APIError) as e:
            keys.tenant(header, "alice")
        assert e.value.status == 401 and e.value.code == "invalid_api_key"
    t1, t1_alice, t2_alice = keys.tenant("Bearer k1", None), keys.tenant("bearer k1", "alice"), keys.tenant(
        "Bearer k2", "alice")
    assert len({t1.scope, t1_alice.scope, t2_alice.scope}) == 3  # `user` sub-scopes within a key only
    assert t1.label == t1_alice.label != t2_alice.label and "k1" not in t1.scope + t1.label
    assert t1.label == "key-" + hashlib.sha256(b"k1").hexdigest()[:12]
    with pytest.raises(ValueError, match="whitespace"):
        Keys(["ok", "has space"])


def test_tenant_text_is_never_proposed_to_another_tenant(served):
    """On the proposals themselves: tenant B's drafts for a prompt (their count, tokens and
    acceptance per position) are the same before and after tenant A put the same text into the
    table, while A's own drafts take it up (more accepted in fewer drafts). The same for tenants
    named by `user` (no API key). And a server started with share_ngram_table does propose A's text
    to B: the test can see a leak."""
    eng, server, url = served
    prompt = PROMPTS[2]  # its continuation is not repetitive: the table's drafts beat in-request lookup

    def ask(u, *, key=None, user=None, contribute=True):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "return_token_ids": True,
                "contribute": contribute, "speculation": {"method": "ngram", "k": 4}}
        if user is not None:
            body["user"] = user
        r = httpx.post(u + "/v1/completions", json=body, timeout=60,
                       headers={} if key is None else {"authorization": f"Bearer {key}"})
        assert r.status_code == 200, r.text
        out = r.json()
        c = out["metrics"]["speculative_decoding"]
        assert out["choices"][0]["token_ids"] == eng.generate([prompt], max_new_tokens=MAX_TOKENS)[0].tokens
        return c["num_drafts"], c["num_draft_tokens"], c["num_accepted_tokens"], c["accepted_tokens_per_pos"]

    def drafts(u, a: dict, b: dict):
        b0 = ask(u, **b, contribute=False)  # B reads its (empty) scope and writes nothing
        a1 = ask(u, **a)  # A writes its text
        a2 = ask(u, **a, contribute=False)  # A's drafts now come from its own text
        b1 = ask(u, **b, contribute=False)
        return b0, a1, a2, b1

    for a, b in (({"key": "prop-a"}, {"key": "prop-b"}), ({"user": "alice"}, {"user": "bob"})):
        b0, a1, a2, b1 = drafts(url, a, b)
        assert b1 == b0, (a, b)  # nothing of A's reached B's drafts
        assert a2[2] > a1[2] and a2[0] < a1[0], (a1, a2)  # A's text does reach A's
        assert a2[2] > b1[2]
    wait_until(lambda: idle(server), 10, "the engine to go idle")

    shared = tiny_server(eng, share_ngram_table=True)
    with running(shared) as url2:
        b0, a1, a2, b1 = drafts(url2, {"key": "prop-a"}, {"key": "prop-b"})
        assert b1 == a2 and b1 != b0  # one scope: B is proposed A's text


def test_loadbench_over_http(served, tmp_path):
    """`specjax loadbench --url`: closed loop at 1 and 4 clients, plain and prompt lookup, through
    the real HTTP client; every request completes, client-side timings are consistent."""
    from specjax.cli import commands as cli

    eng, server, url = served
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"question_id": i, "task": f"t{i % 2}", "turns": [p]}) + "\n"
                            for i, p in enumerate(PROMPTS)))
    out = tmp_path / "out.json"
    rc = cli.main(["loadbench", "--url", url, "--prompts-file", str(path), "--methods", "none,ngram",
                   "--concurrency", "1,4", "--max-new-tokens", "8", "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    runs = [r for r in data["records"] if r["task"] == "all"]
    assert [(r["method"], r["concurrency"]) for r in runs] == [("none", 1), ("ngram", 1), ("none", 4), ("ngram", 4)]
    for r in runs:
        assert r["completed"] == len(PROMPTS) and r["failed"] == 0 and r["tokens"] > 0
        assert 0 < r["ttft_p50_s"] <= r["e2e_p50_s"] and r["output_tok_s"] > 0
    assert runs[0]["num_drafts"] == 0 and runs[1]["num_drafts"] > 0
    for q in data["requests"]:
        assert q["status"] == 200 and q["ttft_s"] <= q["e2e_s"] and q["tokens"] <= 8
    assert cli.main(["loadbench", "--url", url, "--prompts-file", str(path), "--methods", "medusa"]) == 2
    wait_until(lambda: idle(server), 10, "the engine to go idle")


def test_loadbench_times_from_the_send(tmp_path):
    """`loadbench_http.one_request` against a scripted SSE server on 127.0.0.1: TTFT counts from
    the moment the client sent (the server waits 0.3 s before its response even starts), TPOT =
    (E2E - TTFT) / (tokens - 1), ITL are the gaps between streamed chunks; an error event, a 429
    and a refused connection are counted as such. `summarize`: p50 / p99, throughput, goodput."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    from specjax.bench import http as lb

    sse = lambda obj: f"data: {json.dumps(obj)}\n\n"

    async def completions(request):
        mode = (await request.json())["prompt"]
        if mode == "busy":
            return JSONResponse({"error": {"message": "full"}}, status_code=429, headers={"Retry-After": "1"})
        await asyncio.sleep(0.3)  # before the response starts: a client timing from the headers misses it

        async def events():
            yield sse({"choices": [{"index": 0, "text": "a", "token_ids": [1], "finish_reason": None}]})
            if mode == "fail":
                yield sse({"error": {"message": "engine error"}})
                return
            for i in range(3):
                await asyncio.sleep(0.1)
                yield sse({"choices": [{"index": 0, "text": "bb", "token_ids": [2, 3],
                                        "finish_reason": "length" if i == 2 else None}]})
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]),
                            Route("/health", lambda r: JSONResponse({"status": "ok"}))])

    async def main(url):
        async with httpx.AsyncClient(timeout=30) as c:
            return await asyncio.wait_for(asyncio.gather(*(
                lb.one_request(c, url + "/v1/completions", {"prompt": m}) for m in ("ok", "fail", "busy"))), 30)

    with running(app) as url:
        ok, fail, busy = asyncio.run(main(url))
        closed = asyncio.run(main(f"http://127.0.0.1:{free_port()}"))[0]  # nothing listens there
    assert ok["status"] == 200 and ok["tokens"] == 7 and ok["finish"] == "length"
    assert 0.3 <= ok["ttft_s"] < 0.3 + 1.0, ok  # no client can see a token before the server sent it
    assert ok["tpot_s"] == pytest.approx((ok["e2e_s"] - ok["ttft_s"]) / 6)
    # the three later chunks were sent 0.1 s apart (a busy client may read one late: some slack)
    assert len(ok["itl_s"]) == 3 and all(0 < x < 1.0 for x in ok["itl_s"]), ok["itl_s"]
    assert sum(ok["itl_s"]) > 0.3 - 0.15 and ok["e2e_s"] - ok["ttft_s"] >= sum(ok["itl_s"])
    assert (fail["status"], fail["error"]) == (500, "engine error")
    assert busy["status"] == 429 and closed["status"] == 0

    rows = [dict(status=200, ttft_s=t, e2e_s=t + 1.0, tokens=11, tpot_s=0.1, itl_s=[0.1] * 10)
            for t in (0.1, 0.2, 0.3, 5.0)] + [dict(status=429), dict(status=500)]
    out = lb.summarize(rows, 2.0, slo={"ttft": 1.0, "tpot": 0.2})
    assert (out["requests"], out["completed"], out["refused_429"], out["failed"]) == (6, 4, 1, 1)
    assert out["tokens"] == 44 and out["output_tok_s"] == 22.0 and out["request_per_s"] == 2.0
    assert out["goodput_req_s"] == 1.5  # three of the four meet TTFT <= 1 s
    assert out["ttft_p50_s"] == pytest.approx(0.25) and out["ttft_p99_s"] == pytest.approx(np.percentile(
        [0.1, 0.2, 0.3, 5.0], 99))
    assert out["tpot_p99_s"] == pytest.approx(0.1) and out["itl_p50_s"] == pytest.approx(0.1)
    assert lb.summarize(rows, 2.0, slo={"tpot": 0.05})["goodput_req_s"] == 0.0


def test_loadbench_poisson_and_surge_over_http(served, tmp_path):
    """`specjax loadbench --url` with Poisson arrivals (--rate) and with the surge (--surge):
    every request completes; the surge reports each phase apart."""
    from specjax.cli import commands as cli

    eng, server, url = served
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"question_id": i, "task": "t", "turns": [p]}) + "\n"
                            for i, p in enumerate(PROMPTS)))
    out = tmp_path / "rate.json"
    assert cli.main(["loadbench", "--url", url, "--prompts-file", str(path), "--methods", "ngram",
                     "--rate", "20", "--concurrency", "4", "--max-new-tokens", "4", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    [run] = [r for r in data["records"] if r["task"] == "all"]
    assert run["load"] == "20.0/s x4" and run["completed"] == len(PROMPTS) and run["failed"] == 0
    starts = sorted(q["start_s"] for q in data["requests"])
    assert starts[-1] > 0.05  # spread over time, not all at once

    out = tmp_path / "surge.json"
    assert cli.main(["loadbench", "--url", url, "--prompts-file", str(path), "--methods", "none",
                     "--surge", "5:0.4,30:0.4,5:0.4", "--concurrency", "8", "--max-new-tokens", "4",
                     "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    by = {r["task"]: r for r in data["records"]}
    assert by["all"]["load"] == "surge x8" and by["all"]["failed"] == 0
    phases = [by[k] for k in sorted(by) if k.startswith("phase ")]
    assert sum(p["requests"] for p in phases) == by["all"]["requests"] == len(data["requests"]) > 0
    assert max(p["requests"] for p in phases) == by["phase 1"]["requests"]  # the peak
    wait_until(lambda: idle(server), 10, "the engine to go idle")


def _prompt_of(inputs) -> list[int]:
    """The prompt of a request's batch of one (`RunningBatch.insert`'s inputs)."""
    return np.asarray(inputs.prompts)[0, :int(inputs.prompt_lengths[0])].tolist()


def test_scheduler_failures_history_and_requested_speculation(served, reference):
    """The scheduler under the server, directly (its programs are the served ones): a request that
    fails at admission ends "failed" and the others finish; after a chunk error `reset_batch` fails
    the running ones and the queued ones then finish exactly; the history is bounded; a chunk runs
    the option its requests name, plain while an opted-out one runs."""
    eng = served[0]
    s = srv.scheduler_for(eng, method="ngram", spec=SpecConfig(method="ngram", k=4), slots=4, max_tokens=MAX_TOKENS,
                          max_prompt_tokens=64, chunk=4, history=3, batch_engine=HookedBatch)
    s.prepare()
    ids = [eng.encode([p])[0] for p in PROMPTS]

    def bad_row(inputs):
        if _prompt_of(inputs) == ids[0]:
            raise RuntimeError("bad row")

    s.batch.before_insert = bad_row
    rids = [s.submit(x) for x in ids]
    s.run()
    reqs = {r.id: r for r in s.requests}
    assert len(s.requests) == 3 and len(s.chunk_log) <= 3 and not s.live and not s.queue
    assert rids[0] not in reqs  # evicted from the bounded history; it had failed:
    for rid, p in zip(rids[1:], PROMPTS[1:]):
        assert reqs[rid].status == "finished" and reqs[rid].tokens == reference[("completion", p)]
    s.cancel(rids[0])  # an id no longer known: a no-op
    s.batch.before_insert = None

    first = [s.submit(x) for x in ids[:2]]
    later = s.submit(ids[2])
    snap = s.snapshot()
    assert (snap.slots, snap.queued, snap.live, snap.running, snap.idle) == (4, 3, 3, 0, False)
    s.step()  # admits all three, runs a chunk
    snap = s.snapshot()
    assert (snap.queued, snap.live, snap.running) == (0, 3, 3) and snap.last_chunk is s.chunk_log[-1]
    rows = [r for r in snap.rows if r is not None]
    assert sorted(r.request for r in rows) == sorted([*first, later]) and rows[0].slot == 0
    assert all(r.status == "running" and r.tokens >= 1 for r in rows)
    s.batch.before_run = lambda: (_ for _ in ()).throw(RuntimeError("device lost"))
    with pytest.raises(RuntimeError, match="device lost"):
        s.step()
    failed = s.reset_batch("engine error: device lost")
    assert {r.id for r in failed} == {*first, later} and all(r.status == "failed" for r in failed)
    s.batch.before_run = None
    again = s.submit(ids[3])
    s.run()
    assert s.live == {} and all(r is None for r in s.slots)
    assert [r for r in s.requests if r.id == again][0].tokens == reference[("completion", PROMPTS[3])]

    named = s.submit(ids[1], speculation=SpecConfig(method="ngram", k=4))
    off = s.submit(ids[2], opt_out=True, max_new_tokens=4)
    s.run()
    by = {r.id: r for r in s.requests}
    assert by[named].tokens == reference[("completion", PROMPTS[1])]
    assert set(by[off].chunks) == {"none"} and "ngram:4" in by[named].chunks
    reasons = [c.reason for c in s.chunk_log]
    assert "requested" in reasons
    with pytest.raises(ValueError, match="speculation"):
        s.submit(ids[0], speculation=SpecConfig(method="ngram", k=8))
    with pytest.raises(ValueError, match="seed"):
        s.submit(ids[0], seed=-1)


def test_a_non_streaming_client_that_leaves_cancels_its_request(served, monkeypatch):
    """A client that closes the connection while waiting for a whole (non-streamed) completion:
    its request is cancelled at a chunk boundary and its slot freed, well before it would end."""
    eng, server, url = served
    sched = server.sched
    wait_until(lambda: idle(server), 10, "the engine to go idle")
    step = sched.step

    def slow_step():  # 24 tokens, plain, take at least 6 chunks: 1.2 s
        time.sleep(0.2)
        return step()

    monkeypatch.setattr(sched, "step", slow_step)
    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": MAX_TOKENS, "speculation": "off"}

    async def main():
        async with httpx.AsyncClient(timeout=60) as c:
            post = asyncio.create_task(c.post(url + "/v1/completions", json=body))
            t_end = time.monotonic() + 20
            while not server.engine.running and time.monotonic() < t_end:
                await asyncio.sleep(0.02)
            post.cancel()  # closes its connection
            with contextlib.suppress(asyncio.CancelledError):
                await post

    t0 = time.monotonic()
    asyncio.run(main())
    wait_until(lambda: idle(server), 10, "the engine to go idle")
    req = list(sched.requests)[-1]
    assert req.status == "cancelled" and 0 < len(req.tokens) < MAX_TOKENS, (req.status, len(req.tokens))
    assert time.monotonic() - t0 < 1.2 + 2  # not waited out


def test_drain_finishes_what_it_can_then_cancels_the_rest(served, reference):
    """`Server.drain` (what SIGTERM calls), bounded: new requests get 503 and /health says
    draining; a request that can finish within the drain timeout finishes; one that cannot ends
    with finish_reason "cancelled", its tokens a prefix of the greedy ones; the engine thread ends."""
    eng = served[0]
    server = tiny_server(eng)  # the module's programs: nothing to compile
    step = server.sched.step

    def slow_step():
        time.sleep(0.3)
        return step()

    server.sched.step = slow_step
    with running(server) as url:
        async def main():
            # plain, 4 tokens a chunk: the short one needs 2 chunks (done by 0.9 s), the long one 6 (1.8 s)
            short = asyncio.create_task(_stream(url, PROMPTS[0], cancel_after=None, max_tokens=6))
            long = asyncio.create_task(_stream(url, PROMPTS[1], cancel_after=None))
            t_end = time.monotonic() + 20
            while time.monotonic() < t_end:  # until both have their first token
                jobs = list(server.engine.jobs.values())
                if len(jobs) == 2 and all(j.sent for j in jobs):
                    break
                await asyncio.sleep(0.02)
            server.drain(1.0)
            body = {"model": MODEL, "prompt": "a", "max_tokens": 2}
            refused = await asyncio.to_thread(httpx.post, url + "/v1/completions", json=body, timeout=10)
            health = await asyncio.to_thread(httpx.get, url + "/health", timeout=10)
            return await asyncio.wait_for(asyncio.gather(short, long), 30), refused, health

        ((short_toks, short_end), (long_toks, long_end)), refused, health = asyncio.run(main())
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1", refused.text
        assert refused.json()["error"]["code"] == "unavailable"
        assert health.status_code == 503 and health.json() == {"status": "draining"}
        assert short_end == "length" and short_toks == reference[("chat", PROMPTS[0])][:6]
        ref = reference[("chat", PROMPTS[1])]
        assert long_end == "cancelled" and 0 < len(long_toks) < len(ref) and long_toks == ref[: len(long_toks)]
        server._drainer.join(10)
        assert not server.engine.thread.is_alive() and server.engine.pending == 0


# ---- SIGTERM: a subprocess running this file as a script ------------------------------------------

def _serve_main(port: int, step_s: float, drain_s: float) -> int:
    eng = tiny_engine()
    server = tiny_server(eng)
    step = server.sched.step

    def slow_step():  # so that requests are still in flight when SIGTERM arrives
        time.sleep(step_s)
        return step()

    server.sched.step = slow_step
    return srv.run(server, host="127.0.0.1", port=port, drain_timeout=drain_s, log_level="warning")


def test_sigterm_drains_in_flight_requests_then_exits_0(reference):
    """SIGTERM with four streams in flight (plain, 4 tokens a 0.3 s chunk; drain timeout 1 s): the
    port stays open and new requests get 503 with Retry-After, /health 503 "draining"; the two
    short streams (6 tokens) finish, the two long ones (24) end "cancelled" with a prefix of their
    greedy tokens; then the process exits 0."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, PYTHONPATH=os.path.dirname(__file__))
    proc = subprocess.Popen([sys.executable, __file__, str(port), "0.3", "1.0"], env=env)
    try:
        wait_until(lambda: healthy(url) or proc.poll() is not None, 300, "the subprocess server's warm-up", 0.2)
        assert proc.poll() is None

        async def main():
            tasks = [asyncio.create_task(_stream(url, p, cancel_after=None, max_tokens=6 if i < 2 else MAX_TOKENS))
                     for i, p in enumerate(PROMPTS)]
            t_end = time.monotonic() + 30
            while time.monotonic() < t_end:  # until every request is in a slot
                m = await asyncio.to_thread(httpx.get, url + "/metrics", timeout=10)
                if "specjax:num_requests_running 4.0" in m.text:
                    break
                await asyncio.sleep(0.05)
            proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.2)
            async with httpx.AsyncClient(timeout=10) as c:
                refused = await c.post(url + "/v1/completions", json={"model": MODEL, "prompt": "a"})
                health = await c.get(url + "/health")
            return await asyncio.wait_for(asyncio.gather(*tasks), 60), refused, health

        out, refused, health = asyncio.run(main())
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1", refused.text
        assert refused.json()["error"]["code"] == "unavailable"
        assert health.status_code == 503 and health.json() == {"status": "draining"}
        for i, (p, (toks, finish)) in enumerate(zip(PROMPTS, out)):
            ref = reference[("chat", p)]
            assert toks and toks == ref[: len(toks)], (p, toks)
            assert finish == ("length" if i < 2 else "cancelled"), (i, finish)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


@pytest.mark.parametrize("method, flags, options", [
    ("none", [], ["none"]),
    ("ngram", ["--k", "3"], ["none", "ngram:3"]),
    ("auto", ["--auto-methods", "ngram", "--auto-max-step-cost", "1.5"], ["none", "ngram:2", "ngram:4", "ngram:8"]),
])
def test_serve_command_builds_its_server(monkeypatch, method, flags, options):
    """`specjax serve --method M` builds the scheduler it names (without starting it): the options
    `/v1/models` lists, and auto's latency bound reaches the controller."""
    from specjax.cli import commands as cli

    built = {}
    monkeypatch.setattr(Engine, "load", classmethod(lambda cls, *a, **k: tiny_engine()))
    monkeypatch.setattr(srv, "run", lambda server, **kw: built.setdefault("server", server) and 0)
    assert cli.main(["serve", "--model", MODEL, "--method", method, "--slots", "2", "--max-tokens", "8",
                     "--max-prompt-tokens", "16", *flags]) == 0
    sched = built["server"].sched
    assert [o.label for o in sched.options] == options
    if method == "auto":
        assert sched.ccfg.max_step_cost == 1.5


if __name__ == "__main__":
    sys.exit(_serve_main(int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])))
