"""The OpenAI-compatible HTTP surface (Starlette) over the engine thread.

Routes: POST /v1/chat/completions and /v1/completions (SSE with "stream": true), GET /v1/models,
GET /health (503 until the warm-up compiles are done, then 200), GET /metrics (Prometheus).

A request is validated here (pydantic, then the model's limits) before it reaches the engine
thread, so bad input costs no compile and no slot. Text comes back through the tokenizer's stream
decoder; stop strings are matched on the decoded text (held back by the longest stop string minus
one character, so no stop string is ever streamed) and cancel the request in the engine at the
next chunk boundary. A client that disconnects cancels its request the same way.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import hashlib
import json
import logging
import threading
import time
import uuid
from typing import AsyncIterator

import pydantic
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from specjax.serving.scheduler import Scheduler
from specjax.serving.server import protocol
from specjax.serving.server.engine_thread import End, EngineThread, Job, NotAccepting, QueueFull
from specjax.serving.server.metrics import Metrics, memory_added, memory_now, memory_parts
from specjax.serving.server.protocol import APIError, ChatRequest, CompletionRequest, bad


log = logging.getLogger("specjax.serving.server")

MAX_TASKS = 64  # task classes kept apart (per-class acceptance); later ones count as "other"
MAX_TENANTS = 100_000  # tenants remembered (least recently seen forgotten first)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServeConfig:
    """Server settings.

    Attributes:
      model_name: the id clients pass as `model` (GET /v1/models lists it).
      max_queue: requests that may wait beyond the slots; past it, 429 with Retry-After.
      request_timeout: default deadline in seconds from arrival (None: none); a request's
        `timeout` field may only shorten it.
      share_ngram_table: every tenant reads and writes one n-gram table (default: one scope per
        tenant: API key, else `user`, else the anonymous tenant).
      retry_after: seconds a 429 / 503 asks the client to wait.
    """

    model_name: str
    max_queue: int = 64
    request_timeout: float | None = None
    share_ngram_table: bool = False
    retry_after: int = 1


@dataclasses.dataclass
class _Ctx:
    """What the response needs besides the engine's events."""

    kind: str  # "chat" | "completion"
    id: str
    created: int
    prompt_tokens: int
    stops: list[str]
    stream: bool
    include_usage: bool
    token_ids: bool


class Server:
    """An engine thread and the Starlette app over it.

    Example:
      >>> sched = Scheduler(engine, slots=8, spec="auto", opts=GenerateOptions(max_new_tokens=256),
      ...                   max_prompt_tokens=512, history=1024)
      >>> server = Server(engine_thread_of(sched), ServeConfig(model_name="smollm2-135m"))
      >>> uvicorn.run(server.app, host="127.0.0.1", port=8000)
    """

    def __init__(self, sched: Scheduler, config: ServeConfig, *,
                 startup_memory: dict[str, dict[str, int]] | None = None):
        """`startup_memory`: what loading added before this (stage -> `memory_now` kind -> bytes),
        e.g. {"weights": ..., "draft_weights": ...}; the scheduler's warm-up is measured here."""
        if sched.engine.tokenizer is None:
            raise ValueError("serving text needs an Engine with a tokenizer")
        if sched.max_prompt_tokens is None:
            raise ValueError("give the scheduler max_prompt_tokens= (the longest prompt the server accepts)")
        self.bucket = sched.engine.bucket_for(sched.max_prompt_tokens)  # the scheduler's, known before compiling
        self.sched, self.config = sched, config
        self.tokenizer = sched.engine.tokenizer
        self.metrics = Metrics(startup_memory=startup_memory)
        loaded = memory_now()

        def on_ready():  # in the engine thread, once compiled and warmed up
            self.metrics.record_startup("caches_and_programs", memory_added(loaded, memory_now()))
            try:
                self.metrics.record_parts(memory_parts(sched))
            except Exception:  # a metric must never keep the server from starting
                log.exception("cannot measure the device buffers per part")

        self.engine = EngineThread(sched, max_queue=config.max_queue, on_chunk=self.metrics.on_chunk,
                                   on_end=self.metrics.on_end, on_ready=on_ready)
        self.metrics.watch(self.engine)
        self._drainer: threading.Thread | None = None
        self._tenants: collections.OrderedDict[str, int] = collections.OrderedDict()  # hashed key -> id, LRU
        self._next_tenant = 1
        self.max_tenants = MAX_TENANTS
        self._task_names: set[str] = set()
        self.app = Starlette(routes=[
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.prometheus, methods=["GET"]),
        ], exception_handlers={APIError: self._error}, lifespan=self._lifespan)

    @contextlib.asynccontextmanager
    async def _lifespan(self, app):
        if not self.engine.thread.is_alive() and not self.engine.ready.is_set():
            self.engine.start()
        yield
        await asyncio.to_thread(self.engine.stop, 0.0)  # uvicorn has already drained the requests

    def drain(self, timeout: float) -> threading.Thread:
        """Stops accepting requests (they get 503, and /health 503); those in flight get `timeout`
        seconds to finish, then the rest end with finish_reason "cancelled", sent to their clients,
        and the engine thread ends. Returns the thread that waits (SIGTERM calls this)."""
        self.engine.drain()
        if self._drainer is None:
            self._drainer = threading.Thread(target=self.engine.stop, args=(timeout,), name="specjax-drain",
                                             daemon=True)
            self._drainer.start()
        return self._drainer

    async def _error(self, request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    # ---- plain routes -------------------------------------------------------------------------
    async def health(self, request):
        if self.engine.startup_error is not None:
            return JSONResponse({"status": "failed", "error": str(self.engine.startup_error)}, status_code=503)
        if not self.engine.ready.is_set():
            return JSONResponse({"status": "warming up"}, status_code=503)
        if not self.engine.accepting:
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def models(self, request):
        s = self.sched
        options = [o.label for o in s.options]
        return JSONResponse({"object": "list", "data": [{
            "id": self.config.model_name, "object": "model", "created": 0, "owned_by": "specjax",
            "max_model_len": s.engine.config.max_seq_len, "max_tokens": s.opts.max_new_tokens,
            "speculation": {"mode": "auto" if s.controller is not None or s.ccfg is not None else "fixed",
                            "options": options}}]})

    async def prometheus(self, request):
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # ---- completions ---------------------------------------------------------------------------
    async def chat(self, request: HTTPRequest):
        arrived = time.perf_counter()  # latency counts from here: parsing and tokenizing included
        body = await self._parse(request, ChatRequest)
        msgs = [{"role": m.role, "content": protocol.message_text(m, i)} for i, m in enumerate(body.messages)]
        try:
            text = self.tokenizer.apply_chat_template(msgs)
        except Exception as e:
            raise bad(f"messages: the model's chat template rejected them: {e}", "messages") from None
        ids = self.tokenizer.encode(text, add_bos=False)
        return await self._complete(request, body, ids, "chat",
                                    body.max_completion_tokens if body.max_tokens is None else body.max_tokens,
                                    arrived)

    async def completions(self, request: HTTPRequest):
        arrived = time.perf_counter()
        body = await self._parse(request, CompletionRequest)
        p = body.prompt
        if isinstance(p, list) and p and isinstance(p[0], str):
            if len(p) != 1:
                raise bad("prompt: give one prompt per request (batches of prompts are not supported)", "prompt")
            p = p[0]
        if body.echo:
            raise bad("echo is not supported", "echo")
        ids = self.tokenizer.encode(p) if isinstance(p, str) else [int(t) for t in p]
        return await self._complete(request, body, ids, "completion", body.max_tokens, arrived)

    async def _parse(self, request: HTTPRequest, model):
        raw = await request.body()
        try:
            obj = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise bad(f"the body is not valid JSON ({e}); send a JSON object") from None
        if not isinstance(obj, dict):
            raise bad("the body must be a JSON object")
        try:
            body = model.model_validate(obj)
        except pydantic.ValidationError as e:
            err = e.errors()[0]
            loc = ".".join(str(x) for x in err["loc"])
            raise bad(f"{loc}: {err['msg']}", loc or None) from None
        if body.model != self.config.model_name:
            raise APIError(404, f"the model {body.model!r} does not exist: this server serves "
                                f"{self.config.model_name!r}", type="not_found_error", param="model",
                           code="model_not_found")
        return body

    def tenant(self, request: HTTPRequest, user: str | None) -> int:
        """The n-gram table scope: one per API key (else per `user`), 0 for anonymous requests,
        everyone's 0 with `share_ngram_table`. Keys are kept hashed; ids are never reused."""
        if self.config.share_ngram_table:
            return 0
        auth = request.headers.get("authorization", "")
        key = f"key:{auth[7:]}" if auth.lower().startswith("bearer ") and auth[7:].strip() else (
            f"user:{user}" if user else None)
        return 0 if key is None else self.tenant_id(key)

    def tenant_id(self, key: str) -> int:
        """The id of tenant `key` ("key:<API key>" or "user:<user>"), given on first sight. The
        server remembers the last `max_tenants` tenants (a client sending a new `user` each time
        cannot grow it without bound); one forgotten and seen again gets a new id, so its old
        table entries are never proposed again, to it or anyone. Ids are never reused."""
        h = hashlib.sha256(key.encode()).hexdigest()
        if h in self._tenants:
            self._tenants.move_to_end(h)
            return self._tenants[h]
        if self._next_tenant >= 2 ** 31:
            raise APIError(503, "too many tenants for the n-gram table's scopes; restart the server",
                           type="server_error")
        self._tenants[h] = self._next_tenant
        self._next_tenant += 1
        while len(self._tenants) > self.max_tenants:
            self._tenants.popitem(last=False)
        return self._tenants[h]

    def _submit_args(self, request: HTTPRequest, body, ids: list[int], max_tokens: int | None) -> dict:
        s, opts = self.sched, self.sched.opts
        if body.n != 1:
            raise bad(f"n={body.n}: only n=1 is supported", "n")
        if body.logprobs or body.top_logprobs:
            raise bad("logprobs are not supported by this server", "logprobs")
        if not ids:
            raise bad("the prompt is empty", "prompt")
        vocab = s.engine.config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise bad(f"prompt token ids must lie in [0, {vocab})", "prompt")
        if len(ids) > self.bucket:
            raise bad(f"the prompt has {len(ids)} tokens; this server accepts at most {self.bucket} "
                      "(start it with a larger --max-prompt-tokens)", "prompt")
        m = opts.max_new_tokens if max_tokens is None else max_tokens
        if int(m) != m or not 1 <= m <= opts.max_new_tokens:
            raise bad(f"max_tokens={max_tokens}: must be an integer in [1, {opts.max_new_tokens}] "
                      "(the server's --max-tokens sizes its cache)", "max_tokens")
        greedy = opts.sampling.greedy
        if body.temperature is not None:
            if not body.temperature >= 0:
                raise bad(f"temperature={body.temperature}: must be >= 0 (0 = greedy)", "temperature")
            if body.temperature > 0 and greedy:
                raise bad(f"temperature={body.temperature}: this server decodes greedily; start it with "
                          "--temperature > 0 to compile the sampled programs", "temperature")
        if body.top_p is not None and not 0 < body.top_p <= 1:
            raise bad(f"top_p={body.top_p}: must lie in (0, 1]", "top_p")
        if body.top_k is not None and body.top_k < 0:
            raise bad(f"top_k={body.top_k}: must be >= 0 (0 = off)", "top_k")
        if body.seed is not None and not 0 <= body.seed < 2 ** 32:
            raise bad(f"seed={body.seed}: must lie in [0, 2**32)", "seed")
        if body.timeout is not None and not body.timeout > 0:
            raise bad(f"timeout={body.timeout}: must be > 0 seconds", "timeout")
        stop_ids = list(body.stop_token_ids or [])
        if any(not 0 <= t < vocab for t in stop_ids):
            raise bad(f"stop_token_ids must lie in [0, {vocab})", "stop_token_ids")
        task = body.task or request.headers.get("x-task")
        if task is not None and len(task) > 64:
            raise bad("task: at most 64 characters", "task")
        if task is not None and task not in self._task_names:  # per-class statistics stay bounded
            if len(self._task_names) >= MAX_TASKS:
                task = "other"
            else:
                self._task_names.add(task)
        kw = dict(max_new_tokens=int(m), task=task, contribute=body.contribute,
                  temperature=body.temperature, top_k=body.top_k, top_p=body.top_p, seed=body.seed,
                  stop_ids=stop_ids, tenant=self.tenant(request, body.user),
                  stream=None if body.seed is None else 0)  # a seed names the whole random stream
        kw.update(protocol.speculation_option(body.speculation, s.options, fixed=s.fixed))
        if len(set(stop_ids) | set(s.engine.stop_ids(opts))) > 8:
            raise bad("stop_token_ids: at most 8 stop tokens, the model's own included", "stop_token_ids")
        return kw

    async def _complete(self, request: HTTPRequest, body, ids: list[int], kind: str, max_tokens, arrived: float):
        kw = self._submit_args(request, body, ids, max_tokens)
        stops = protocol.stop_strings(body.stop)
        if self.engine.startup_error is not None:
            raise APIError(503, f"the engine failed to start: {self.engine.startup_error}", type="server_error")
        timeout = min(x for x in (body.timeout, self.config.request_timeout, float("inf")) if x is not None)
        loop = asyncio.get_running_loop()
        job = Job(ids=ids, submit=kw, loop=loop, events=asyncio.Queue(), arrived=arrived)
        if timeout != float("inf"):
            job.deadline = job.arrived + timeout
        retry = {"Retry-After": str(self.config.retry_after)}
        try:
            self.engine.submit(job)
        except QueueFull as e:
            raise APIError(429, f"the server is at capacity ({e}); retry after {self.config.retry_after} s",
                           type="rate_limit_error", code="queue_full", headers=retry) from None
        except NotAccepting as e:
            raise APIError(503, f"{e}; retry later", type="server_error", code="unavailable", headers=retry) from None
        ctx = _Ctx(kind=kind, id=("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex,
                   created=int(time.time()), prompt_tokens=len(ids), stops=stops, stream=body.stream,
                   include_usage=bool(body.stream_options and body.stream_options.include_usage),
                   token_ids=body.return_token_ids)
        if body.stream:
            return StreamingResponse(self._sse(job, ctx), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        watcher = asyncio.create_task(self._watch_disconnect(request, job))
        try:
            text, toks, finish, end = "", [], None, None
            async for delta, ids_delta, finish, end in self._events(job, ctx):
                text += delta
                toks += ids_delta
        finally:
            watcher.cancel()
            if not job.ended:
                self.engine.cancel(job)
        if end is not None and end.reason == "error":
            raise self._end_error(end)
        return JSONResponse(self._final(ctx, text, toks, finish, end))

    async def _watch_disconnect(self, request: HTTPRequest, job: Job) -> None:
        while True:
            await asyncio.sleep(0.2)
            if await request.is_disconnected():
                self.engine.cancel(job)
                return

    async def _events(self, job: Job, ctx: _Ctx) -> AsyncIterator[tuple[str, list[int], str | None, End | None]]:
        """(text delta, token ids delta, finish_reason or None, End or None) until the end."""
        dec = self.tokenizer.decode_stream(skip_special=True)
        hold = max((len(s) for s in ctx.stops), default=1) - 1
        buf, n = "", 0
        while True:
            ev = await job.events.get()
            end = ev if isinstance(ev, End) else None
            ids = [] if end else ev
            n += len(ids)
            buf += dec.flush() if end else dec.push(ids)
            hit = [i for i in (buf.find(s) for s in ctx.stops) if i >= 0]
            if hit and (end is None or end.reason != "error"):
                if end is None:
                    self.engine.cancel(job, "stop")
                yield buf[: min(hit)], ids, "stop", end
                return
            if end is not None:
                yield buf, ids, (None if end.reason == "error" else end.reason), end
                return
            emit = buf[: len(buf) - hold] if hold else buf
            buf = buf[len(emit):]
            if emit or ids:
                yield emit, ids, None, None

    def _end_error(self, end: End) -> APIError:
        if end.client_error:
            return bad(end.error)
        return APIError(500, f"the request failed in the engine: {end.error}", type="server_error")

    def _usage(self, ctx: _Ctx, end: End | None, completion: int) -> dict:
        return {"prompt_tokens": ctx.prompt_tokens, "completion_tokens": completion,
                "total_tokens": ctx.prompt_tokens + completion}

    def _spec_metrics(self, end: End | None) -> dict:
        req = end.request if end is not None else None
        if req is None:
            return {}
        return {"metrics": {"speculative_decoding": {**req.counters.to_dict(), "chunks": dict(req.chunks),
                                                     "target_forwards": req.target_forwards}}}

    def _final(self, ctx: _Ctx, text: str, toks: list[int], finish: str | None, end: End | None) -> dict:
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                   "finish_reason": finish} if ctx.kind == "chat" else
                  {"index": 0, "text": text, "logprobs": None, "finish_reason": finish})
        if ctx.token_ids:
            choice["token_ids"] = toks
        return {"id": ctx.id, "object": "chat.completion" if ctx.kind == "chat" else "text_completion",
                "created": ctx.created, "model": self.config.model_name, "choices": [choice],
                "usage": self._usage(ctx, end, len(toks)), **self._spec_metrics(end)}

    def _chunk(self, ctx: _Ctx, text: str, toks: list[int], finish: str | None, *, first: bool = False) -> dict:
        if ctx.kind == "chat":
            delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        if ctx.token_ids:
            choice["token_ids"] = toks
        return {"id": ctx.id, "object": "chat.completion.chunk" if ctx.kind == "chat" else "text_completion",
                "created": ctx.created, "model": self.config.model_name, "choices": [choice]}

    async def _sse(self, job: Job, ctx: _Ctx):
        sse = lambda obj: f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
        n, first = 0, True
        try:
            async for delta, ids, finish, end in self._events(job, ctx):
                if end is not None and end.reason == "error":
                    yield sse(self._end_error(end).body())
                    break
                n += len(ids)
                yield sse(self._chunk(ctx, delta, ids, finish, first=first))
                first = False
                if finish is not None:
                    if ctx.include_usage:
                        usage = {**self._chunk(ctx, "", [], None), "choices": [],
                                 "usage": self._usage(ctx, end, n), **self._spec_metrics(end)}
                        yield sse(usage)
                    break
            yield "data: [DONE]\n\n"
        finally:  # the client went away (Starlette cancels this generator), or a stop string ended it
            if not job.ended:
                self.engine.cancel(job)
