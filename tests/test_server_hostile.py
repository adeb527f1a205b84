"""The server under hostile input: malformed bodies get 4xx (never 5xx), large ones are refused
before they are parsed and stall no one, API keys keep tenants apart.

Servers run the tiny model on 127.0.0.1 (`tiny_server`); every request loop is bounded in count and
time, and every server stops in a `finally`. The SIGTERM drain is tested in test_server.py.
"""

import asyncio
import hashlib
import json
import logging
import time

import httpx
import pytest
from conftest import need_module
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st
from tiny_server import MAX_TOKENS, MODEL, PROMPTS, idle, running, shared_engine, tiny_server, wait_until

from specjax.serving.server import protocol

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
ERROR_KEYS = {"message", "type", "param", "code"}
KEYS = ("sk-test-a", "sk-test-b", "sk-test-c")


@pytest.fixture(scope="module")
def served():
    eng = shared_engine()
    server = tiny_server(eng)
    with running(server) as url:
        yield eng, server, url


@pytest.fixture(scope="module")
def keyed():
    """A server that takes the keys `KEYS` and gives 2 tenants their own series in /metrics."""
    eng = shared_engine()
    server = tiny_server(eng, api_keys=KEYS, metrics_tenants=2)
    with running(server) as url:
        yield eng, server, url


def chat(content="abc", **kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4, **kw}


def assert_error(r: httpx.Response, status: int | None = None, param: str | None = None) -> dict:
    """An OpenAI-shaped error with a message, a 4xx unless `status` says otherwise."""
    assert (r.status_code == status) if status else 400 <= r.status_code < 500, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert set(err) == ERROR_KEYS and isinstance(err["message"], str) and err["message"], err
    if param is not None:
        assert err["param"] == param, err
    return err


def post(url: str, path: str, body, **kw) -> httpx.Response:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(url + path, content=raw, headers={"content-type": "application/json", **kw.pop("headers", {})},
                      timeout=30, **kw)


def test_malformed_requests_get_400_naming_the_field(served):
    """The four 500s of the issue, and strictness where OpenAI is strict (roles, integer token
    counts, booleans): each a 400 saying what is wrong. Unknown and ignored OpenAI fields pass."""
    eng, server, url = served
    msg = lambda content: [{"role": "user", "content": content}]
    cases = [
        (b'{"model": "tiny", "messages": [{"role": "user", "content": "hi \\ud800 there"}]}', "messages.0.content"),
        (b"[" * 100_000 + b"]" * 100_000, None),
        (b'{"model": "tiny", "messages": [], "max_tokens": ' + b"9" * 5000 + b"}", None),
        (chat(top_k=2 ** 70), "top_k"),
        (chat(seed=2 ** 64), "seed"),
        ({"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
        (chat(max_tokens=True), "max_tokens"),
        (chat(max_tokens=2.0), "max_tokens"),
        (chat(max_tokens="2"), "max_tokens"),
        (chat(max_completion_tokens=False, max_tokens=None), "max_completion_tokens"),
        (chat(stream="yes"), "stream"),
        (chat(n=True), "n"),
        ({"model": MODEL, "prompt": [1, True, 3]}, None),
        (b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "temperature": NaN}', None),
        (b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_p": 1e999}', "top_p"),
        (b'{"model": "tiny", "user": "\\udfff", "messages": [{"role": "user", "content": "x"}]}', "user"),
        (b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "meta": {"\\udfff": "\\ud800"}}', None),
        (b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}]}\xff', None),
        ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "u"}]}]},
         "messages[0].content"),
        ({"model": MODEL, "messages": msg("a" * 900)}, "messages"),  # past the characters bound, not tokenized
    ]
    for body, param in cases:
        path = COMPLETIONS if isinstance(body, dict) and "prompt" in body else CHAT
        r = post(url, path, body)
        err = assert_error(r, 400, param)
        assert r.headers["x-request-id"], r.headers
        assert "sys.set_int_max_str_digits" not in err["message"]
    ok = post(url, CHAT, chat(frequency_penalty=0, response_format={"type": "text"}, tools=[], metadata={"a": 1}))
    assert ok.status_code == 200, ok.text
    assert set(protocol.IGNORED) >= {"metadata", "store"}
    for field, value in (("frequency_penalty", 0.5), ("some_future_field", {"x": [1, 2]})):  # never dropped
        assert_error(post(url, CHAT, chat(**{field: value})), 400, field)
    wait_until(lambda: idle(server), 10, "the engine to go idle")


def test_unexpected_errors_are_500s_naming_the_request_id(served, monkeypatch, caplog):
    """An exception nobody expected: a 500 whose message names the request id (X-Request-Id), and
    the log has the traceback under that id; a stream that has begun ends with an error event
    naming it, then [DONE]. The server keeps serving."""
    eng, server, url = served
    caplog.set_level(logging.INFO, logger="specjax.serving.server")
    tok = server.tokenizer

    def broken(*a, **kw):
        raise RuntimeError("tokenizer exploded")

    monkeypatch.setattr(tok, "encode", broken)
    r = post(url, COMPLETIONS, {"model": MODEL, "prompt": "abc"})
    rid = r.headers["x-request-id"]
    err = assert_error(r, 500)
    assert rid in err["message"] and err["type"] == "server_error" and "Internal Server Error" not in r.text
    logged = [rec for rec in caplog.records if rid in rec.getMessage()]
    assert logged and logged[0].exc_info and "tokenizer exploded" in str(logged[0].exc_info[1])
    monkeypatch.undo()

    class Exploding:  # the stream decoder fails on its second chunk
        def __init__(self):
            self.calls = 0

        def push(self, ids):
            self.calls += 1
            if self.calls > 1:
                raise RuntimeError("decoder exploded")
            return "x"

        def flush(self):
            return ""

    monkeypatch.setattr(tok, "decode_stream", lambda **kw: Exploding())
    with httpx.stream("POST", url + COMPLETIONS, json={"model": MODEL, "prompt": "abc", "stream": True,
                                                        "max_tokens": MAX_TOKENS, "speculation": "off"},
                      timeout=30) as r:
        rid = r.headers["x-request-id"]
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert r.status_code == 200 and events[-1] == "[DONE]"
    last = json.loads(events[-2])["error"]
    assert rid in last["message"] and last["type"] == "server_error"
    assert any(rid in rec.getMessage() and rec.exc_info for rec in caplog.records)
    monkeypatch.undo()
    assert post(url, COMPLETIONS, {"model": MODEL, "prompt": "abc", "max_tokens": 2}).status_code == 200
    wait_until(lambda: idle(server), 10, "the engine to go idle")


def test_body_limit_is_checked_before_parsing(served):
    """413 past --max-body-bytes (2 MiB by default): at once from Content-Length, and for a chunked
    body without one as soon as it passes the limit; the client gets the answer (not a reset)."""
    eng, server, url = served
    limit = server.config.max_body_bytes
    assert limit == 2 << 20
    big = b'{"model": "tiny", "prompt": "' + b"a" * (8 << 20) + b'"}'
    err = assert_error(post(url, COMPLETIONS, big), 413)
    assert err["code"] == "request_too_large" and str(limit) in err["message"]

    def chunks():  # no Content-Length: Transfer-Encoding chunked
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(48):
            yield b"a" * (64 << 10)
        yield b'"}'

    r = httpx.post(url + COMPLETIONS, content=chunks(), timeout=30)
    assert "content-length" not in r.request.headers
    assert_error(r, 413)
    under = b'{"model": "tiny", "prompt": "' + b"a" * (limit - 100) + b'"}'  # read, then refused by its length
    assert "characters" in assert_error(post(url, COMPLETIONS, under), 400, "prompt")["message"]


def _hostile_bodies(limit: int) -> list[bytes]:
    return [
        b'{"model": "tiny", "prompt": "' + b"a" * (8 << 20) + b'"}',  # 8 MB: 413 unread
        b"[" * 100_000,  # 100k deep: 400
        json.dumps({"model": MODEL, "prompt": [5] * ((limit - 100) // 3)}).encode(),  # ~700k ids to validate
        b'{"model": "tiny", "prompt": "' + b"ab " * ((limit - 100) // 3) + b'"}',  # 2 MB of text: not tokenized
        b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}',
        b'{"model": "tiny", "prompt": "x", "max_tokens": ' + b"7" * 5000 + b"}",
    ]


def test_large_and_malformed_bodies_stall_neither_health_nor_a_stream(served, reference_stream, monkeypatch):
    """While a stream runs (a 0.15 s chunk), the hostile bodies above arrive, each twice: every one
    gets its 4xx, the stream's tokens are exact, no gap between its events exceeds one chunk plus
    0.35 s, and no /health answer (polled every 20 ms) takes longer than 0.25 s."""
    eng, server, url = served
    wait_until(lambda: idle(server), 10, "the engine to go idle")
    step = server.sched.step

    def slow_step():
        time.sleep(0.15)
        return step()

    monkeypatch.setattr(server.sched, "step", slow_step)
    bodies = _hostile_bodies(server.config.max_body_bytes)

    async def main():
        async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=16)) as c:
            done, times, health = asyncio.Event(), [], []

            async def stream():
                body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": MAX_TOKENS, "stream": True,
                        "return_token_ids": True, "speculation": "off"}
                toks = []
                async with c.stream("POST", url + COMPLETIONS, json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            times.append(time.perf_counter())
                            toks += json.loads(line[6:])["choices"][0].get("token_ids", [])
                done.set()
                return toks

            async def poll():
                for _ in range(500):  # at most 10 s
                    if done.is_set():
                        return
                    t0 = time.perf_counter()
                    assert (await c.get(url + "/health")).status_code == 200
                    health.append(time.perf_counter() - t0)
                    await asyncio.sleep(0.02)

            async def attack():
                while not times:
                    await asyncio.sleep(0.01)
                out = []
                for body in bodies * 2:
                    r = await c.post(url + COMPLETIONS, content=body, headers={"content-type": "application/json"})
                    out.append(r)
                return out

            toks, _, answers = await asyncio.wait_for(asyncio.gather(stream(), poll(), attack()), 60)
            return toks, times, health, answers

    toks, times, health, answers = asyncio.run(main())
    for r in answers:
        assert_error(r)
    assert [r.status_code for r in answers[:2]] == [413, 400]
    gaps = [b - a for a, b in zip(times, times[1:])]
    print(f"\nstream gaps max {max(gaps):.3f} s (chunk 0.15 s), /health max {max(health):.3f} s "
          f"p50 {sorted(health)[len(health) // 2]:.3f} s over {len(health)} polls")
    assert toks == reference_stream
    assert max(gaps) < 0.15 + 0.35, gaps
    assert max(health) < 0.25, sorted(health)[-5:]


@pytest.fixture(scope="module")
def reference_stream(served):
    return served[0].generate([PROMPTS[1]], max_new_tokens=MAX_TOKENS)[0].tokens


# ---- the fuzz ----------------------------------------------------------------------------------------

FIELDS = ["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
          "seed", "stop", "stop_token_ids", "stream", "stream_options", "n", "user", "speculation", "task",
          "contribute", "timeout", "return_token_ids", "logprobs", "top_logprobs", "echo", "tools",
          "response_format", "no_such_field"]
ODD_TEXT = st.one_of(st.text(max_size=12), st.sampled_from(
    ["\ud800", "a \udfff b", "\x00", "é", "😀", "<|im_start|>", "a" * 900, "\u202e", "", "tiny", "off", "auto"]))
ODD_INT = st.one_of(st.integers(-3, 30), st.sampled_from([2 ** 31, 2 ** 32, 2 ** 63, 2 ** 70, -2 ** 70, 10 ** 300]))
ODD_FLOAT = st.one_of(st.floats(allow_nan=False, allow_infinity=False), st.sampled_from([-0.0, 5e-324, 1e308, 0.5]))
SCALAR = st.one_of(st.none(), st.booleans(), ODD_INT, ODD_FLOAT, ODD_TEXT)
VALUE = st.recursive(SCALAR, lambda kids: st.one_of(st.lists(kids, max_size=3),
                                                    st.dictionaries(ODD_TEXT, kids, max_size=3)), max_leaves=6)
MESSAGES = st.lists(st.fixed_dictionaries(
    {"role": st.one_of(st.sampled_from(protocol.ROLES + ("wizard",)), VALUE),
     "content": st.one_of(ODD_TEXT, VALUE, st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image"]),
                                                                             "text": ODD_TEXT}), max_size=2))}),
    max_size=3)


@st.composite
def bodies(draw) -> tuple[str, bytes]:
    path = draw(st.sampled_from([CHAT, COMPLETIONS]))
    kind = draw(st.sampled_from(["object", "object", "object", "raw"]))
    if kind == "raw":
        raw = draw(st.one_of(
            st.binary(max_size=48),
            st.sampled_from([b"[" * 100_000, b'{"a":' * 20_000,
                             b'{"model": "tiny", "max_tokens": ' + b"9" * 5000 + b"}",
                             b'{"model": NaN}', b'{"model": "tiny", "prompt": Infinity}', b"", b"null", b"[]",
                             b'"s"', b"\xff\xfe{}", b'{"model": "tiny", "prompt": "\\ud800"}', b'{"model": "ti']),
            st.builds(lambda v: json.dumps(v).encode(), VALUE)))
        return path, raw
    base = chat() if path == CHAT else {"model": MODEL, "prompt": "abc", "max_tokens": 4}
    body = {**base, **draw(st.dictionaries(st.sampled_from(FIELDS), VALUE, max_size=3))}
    if draw(st.booleans()):
        body["messages" if path == CHAT else "prompt"] = draw(MESSAGES if path == CHAT else st.one_of(
            ODD_TEXT, st.lists(ODD_INT, max_size=4), st.lists(ODD_TEXT, max_size=2)))
    for key in draw(st.lists(st.sampled_from(["model", "messages", "prompt"]), max_size=1)):
        body.pop(key, None)
    ascii_only = draw(st.booleans())
    return path, json.dumps(body, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")


def test_fuzz_never_a_5xx_and_healthy_after(served, reference_stream):
    """Odd bodies (valid JSON of odd shapes, invalid JSON, odd unicode, huge numbers, deep nesting,
    wrong types for every field) to both routes: never a 5xx; an error is OpenAI-shaped; a 200
    streams no error. 150 examples and the four of the issue, no shrinking (bounded time); then
    the server is idle, healthy, and exact."""
    eng, server, url = served

    @settings(max_examples=150, deadline=None, database=None, phases=[Phase.explicit, Phase.generate],
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(req=bodies())
    @example(req=(CHAT, b'{"model": "tiny", "messages": [{"role": "user", "content": "hi \\ud800 there"}]}'))
    @example(req=(CHAT, b"[" * 100_000))
    @example(req=(CHAT, b'{"model": "tiny", "messages": [], "max_tokens": ' + b"9" * 5000 + b"}"))
    @example(req=(COMPLETIONS, json.dumps({"model": MODEL, "prompt": "a", "top_k": 2 ** 70}).encode()))
    def one(req):
        path, raw = req
        r = httpx.post(url + path, content=raw, headers={"content-type": "application/json"}, timeout=30)
        if r.status_code != 200:
            assert_error(r)
        elif r.headers["content-type"].startswith("text/event-stream"):
            events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]" and all("error" not in json.loads(e) for e in events[:-1]), r.text[-300:]
        else:
            assert r.json()["choices"], r.text

    one()
    wait_until(lambda: idle(server), 20, "the engine to go idle")
    assert httpx.get(url + "/health", timeout=10).json() == {"status": "ok"}
    r = post(url, COMPLETIONS, {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": MAX_TOKENS,
                                "return_token_ids": True})
    assert r.json()["choices"][0]["token_ids"] == reference_stream


# ---- keys and tenants --------------------------------------------------------------------------------

def test_api_keys_401_without_200_with(keyed):
    """With keys: /v1 answers 401 (OpenAI-shaped, WWW-Authenticate) without a valid Bearer key,
    before reading the body; /health and /metrics stay open; the official client works with a
    key. Per-tenant series: the first 2 tenants by their key's hash, the third under "other"."""
    openai = need_module("openai")
    eng, server, url = keyed
    for headers in ({}, {"authorization": "Bearer nope"}, {"authorization": "sk-test-a"},
                    {"authorization": "Basic sk-test-a"}, {"authorization": "Bearer sk-test-a x"}):
        for method, path in (("GET", "/v1/models"), ("POST", CHAT), ("POST", COMPLETIONS)):
            r = httpx.request(method, url + path, headers=headers, content=b"{not json", timeout=10)
            err = assert_error(r, 401)
            assert err["code"] == "invalid_api_key" and r.headers["www-authenticate"] == "Bearer"
    assert httpx.get(url + "/health", timeout=10).status_code == 200
    assert httpx.get(url + "/metrics", timeout=10).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
    for key in KEYS:
        c = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=30)
        assert [m.id for m in c.models.list()] == [MODEL]
        r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "abc"}], max_tokens=3)
        assert r.usage.completion_tokens == 3
        text = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "abc"}], max_tokens=3, stream=True) if ch.choices)
        assert text == r.choices[0].message.content
    wait_until(lambda: idle(server), 10, "the engine to go idle")
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=10).text
    requests, tokens = {}, {}
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            if smp.name == "specjax:tenant_requests_total":
                requests[smp.labels["tenant"]] = requests.get(smp.labels["tenant"], 0) + smp.value
            if smp.name == "specjax:tenant_generation_tokens_total":
                tokens[smp.labels["tenant"]] = smp.value
    label = lambda key: "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]
    a, b, _ = KEYS
    assert requests == {label(a): 2, label(b): 2, "other": 2}, requests  # the third key is "other"
    assert tokens == {t: 6 for t in requests}, tokens
    assert "sk-test" not in text  # never the key itself


def test_keyed_tenants_never_draft_each_others_text(keyed):
    """Accepted drafts from the n-gram table: key B's drafts for a prompt are the same before and
    after key A put that text into the table, and so are key B's with A's `user` (a `user` cannot
    cross keys), and key A's under another `user` (sub-scopes); A's own drafts take it up (more
    accepted in fewer drafts), so the test can see a leak."""
    eng, server, url = keyed
    prompt = PROMPTS[2]  # its continuation is not repetitive: the table's drafts beat in-request lookup
    ref = eng.generate([prompt], max_new_tokens=MAX_TOKENS)[0].tokens

    def ask(key, user=None, contribute=False):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "return_token_ids": True,
                "contribute": contribute, "speculation": {"method": "ngram", "k": 4},
                **({} if user is None else {"user": user})}
        r = post(url, COMPLETIONS, body, headers={"authorization": f"Bearer {key}"})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == ref
        c = r.json()["metrics"]["speculative_decoding"]
        return c["num_drafts"], c["num_accepted_tokens"], c["accepted_tokens_per_pos"]

    a, b, _ = KEYS
    before = {who: ask(*who) for who in ((b, None), (b, "alice"), (a, "bob"), (a, "alice"))}
    ask(a, "alice", contribute=True)  # A (as alice) writes its text
    after = {who: ask(*who) for who in before}
    for who in ((b, None), (b, "alice"), (a, "bob")):
        assert after[who] == before[who], who
    a0, a1 = before[(a, "alice")], after[(a, "alice")]
    assert a1[1] > a0[1] and a1[0] < a0[0], (a0, a1)  # A's text does reach A
    wait_until(lambda: idle(server), 10, "the engine to go idle")


def test_keys_from_the_command_line_and_a_file(tmp_path, monkeypatch, capsys):
    """`specjax serve --api-key K --api-key-file F`: the server takes both (comments and blank lines
    of the file skipped); an empty file is refused."""
    from specjax.cli import commands
    from specjax.serving import server as srv
    from specjax.serving.engine import Engine

    path = tmp_path / "keys"
    path.write_text("# keys\nfile-key-1\n\n  file-key-2  \n")
    built = {}
    monkeypatch.setattr(Engine, "load", classmethod(lambda cls, *a, **k: shared_engine()))
    monkeypatch.setattr(srv, "run", lambda server, **kw: built.setdefault("server", server) and 0)
    args = ["serve", "--model", MODEL, "--method", "none", "--slots", "2", "--max-tokens", "8",
            "--max-prompt-tokens", "16"]
    assert commands.main(args + ["--api-key", "cli-key", "--api-key-file", str(path), "--max-body-bytes", "1000"]) == 0
    server = built.pop("server")
    assert server.config.api_keys == ("cli-key", "file-key-1", "file-key-2")
    assert server.config.max_body_bytes == 1000
    assert server.keys.tenant("Bearer file-key-2", None).label.startswith("key-")
    (tmp_path / "empty").write_text("# nothing\n")
    assert commands.main(args + ["--api-key-file", str(tmp_path / "empty")]) == 2 and "server" not in built
    assert "no key in it" in capsys.readouterr().err
