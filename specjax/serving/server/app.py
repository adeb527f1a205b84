"""The OpenAI-compatible HTTP surface (Starlette) over the engine thread.

Routes: POST /v1/chat/completions and /v1/completions (SSE with "stream": true), GET /v1/models (with
the speculation options and the constraint pool's limits),
GET /health (503 until the warm-up compiles are done, then 200), GET /metrics (Prometheus).
With API keys (`ServeConfig.api_keys`), the /v1 routes answer 401 without one; /health and /metrics
stay open (`auth`).

A request is checked in this order, so that a bad one costs little and delays no one: its key (401),
its body's size (413, `guard.read_body`), then, in a worker thread off the event loop, its JSON and
fields (`protocol.parse`), its prompt's length in characters (a prompt longer than the prompt bucket
times the tokenizer's longest token cannot fit), the chat template and the tokenizer, and the
model's limits (400 or 404), and last its constraint (`response_format`, `regex`, `choice`: compiled
through the engine's cache, which can take seconds for a large schema, and checked against the
scheduler's pool; 400 naming the field), all before it reaches the engine thread: bad input costs no compile and
no slot. Text comes back through the tokenizer's stream decoder; stop strings are matched on the
decoded text (held back by the longest stop string minus one character, so no stop string is ever
streamed) and cancel the request in the engine at the next chunk boundary. A client that
disconnects cancels its request the same way. Every response carries `X-Request-Id`, and the log
names that id for every error (`guard`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import json
import logging
import threading
import time
from typing import AsyncIterator

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from specjax.serving.constraints import ConstraintError
from specjax.serving.scheduler import Scheduler
from specjax.serving.server import logprobs, protocol
from specjax.serving.server.auth import Keys, TenantIds
from specjax.serving.server.engine_thread import End, EngineThread, Job, NotAccepting, QueueFull
from specjax.serving.server.guard import RequestIds, error_response, read_body, request_id
from specjax.serving.server.metrics import Metrics, memory_added, memory_now
from specjax.methods.predict.usage import prediction_usage
from specjax.serving.server.protocol import APIError, ChatRequest, CompletionRequest, bad


log = logging.getLogger("specjax.serving.server")

MAX_TASKS = 64  # task classes kept apart (per-class acceptance); later ones count as "other"
MAX_TENANTS = 100_000  # tenants remembered (least recently seen forgotten first)
MAX_BODY_BYTES = 2 << 20  # 2 MiB: a 128k-token prompt of JSON-escaped text fits
PARSERS = 2  # worker threads that parse, validate and tokenize request bodies


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServeConfig:
    """Server settings.

    Attributes:
      model_name: the id clients pass as `model` (GET /v1/models lists it).
      max_queue: requests that may wait beyond the slots; past it, 429 with Retry-After.
      request_timeout: default deadline in seconds from arrival (None: none); a request's
        `timeout` field may only shorten it.
      share_ngram_table: every tenant reads and writes one n-gram table (default: one scope per
        tenant, see `auth`).
      retry_after: seconds a 429 / 503 asks the client to wait.
      api_keys: the keys /v1 requests must carry (`Authorization: Bearer`); none: open, and the
        tenant scopes are then advisory (`auth`).
      max_body_bytes: a longer request body gets 413, unread.
      max_prompt_chars: a longer prompt (the characters of its messages) gets 400 before it is
        tokenized. None: the prompt bucket times the tokenizer's longest token in characters, the
        most a prompt that fits can have.
      metrics_tenants: tenants with their own series in /metrics (the first ones to finish a
        request); the others are counted under "other".
    """

    model_name: str
    max_queue: int = 64
    request_timeout: float | None = None
    share_ngram_table: bool = False
    retry_after: int = 1
    api_keys: tuple[str, ...] = ()
    max_body_bytes: int = MAX_BODY_BYTES
    max_prompt_chars: int | None = None
    metrics_tenants: int = 16


@dataclasses.dataclass
class _Ctx:
    """What the response needs besides the engine's events."""

    kind: str  # "chat" | "completion"
    rid: str  # the request id (X-Request-Id)
    id: str
    created: int
    prompt_tokens: int
    stops: list[str]
    stream: bool
    include_usage: bool
    token_ids: bool
    prediction: list[int] | None = None  # the request's predicted output, for the usage counts
    logprobs: bool = False  # it asked for logprobs
    offset: int = 0  # characters of text streamed so far (a completion's text_offset)


@dataclasses.dataclass
class _Prepared:
    """A request as the worker thread left it: validated, tokenized, its submit arguments."""

    body: ChatRequest | CompletionRequest
    ids: list[int]
    submit: dict
    stops: list[str]


def longest_token_chars(tokenizer) -> int:
    """The most characters one token stands for (its vocab entry; a byte-level entry has one
    character per byte, so it never counts fewer than the text it decodes to)."""
    return max(len(tokenizer.id_to_token(i) or "") for i in range(tokenizer.vocab_size))


def _check_sampling(body, *, greedy: bool) -> None:
    """A request's sampling fields and timeout against their ranges and a greedy server (400 naming the field)."""
    if body.temperature is not None:
        if not body.temperature >= 0:
            raise bad(f"temperature={body.temperature}: must be >= 0 (0 = greedy)", "temperature")
        if body.temperature > 0 and greedy:
            raise bad(f"temperature={body.temperature}: this server decodes greedily; start it with "
                      "--temperature > 0 to compile the sampled programs", "temperature")
    if body.top_p is not None and not 0 < body.top_p <= 1:
        raise bad(f"top_p={body.top_p}: must lie in (0, 1]", "top_p")
    if body.top_k is not None and not 0 <= body.top_k < 2 ** 31:
        raise bad(f"top_k={body.top_k}: must lie in [0, 2**31) (0 = off)", "top_k")
    if body.seed is not None and not 0 <= body.seed < 2 ** 32:
        raise bad(f"seed={body.seed}: must lie in [0, 2**32)", "seed")
    if body.timeout is not None and not body.timeout > 0:
        raise bad(f"timeout={body.timeout}: must be > 0 seconds", "timeout")


class Server:
    """An engine thread and the Starlette app over it.

    Example:
      >>> sched = Scheduler(engine, slots=8, spec="auto", opts=GenerateOptions(max_new_tokens=256),
      ...                   max_prompt_tokens=512, history=1024)
      >>> server = Server(sched, ServeConfig(model_name="smollm2-135m", api_keys=("sk-local",)))
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
        for name in ("max_body_bytes", "metrics_tenants"):
            if int(getattr(config, name)) != getattr(config, name) or getattr(config, name) < 1:
                raise ValueError(f"{name}={getattr(config, name)}: must be an integer >= 1")
        self.bucket = sched.engine.bucket_for(sched.max_prompt_tokens)  # the scheduler's, known before compiling
        self.sched, self.config = sched, config
        self.tokenizer = sched.engine.tokenizer
        self.logprobs = logprobs.Formatter(self.tokenizer)
        self.keys = Keys(config.api_keys)
        self.tenants = TenantIds(MAX_TENANTS)
        self.max_prompt_chars = config.max_prompt_chars or self.bucket * longest_token_chars(self.tokenizer)
        # a prompt of token ids, or messages (each costs a token at least), and room for the other fields
        self.max_values = 4 * self.bucket + 4096
        self.metrics = Metrics(startup_memory=startup_memory, tenants=config.metrics_tenants)
        loaded = memory_now()

        def on_ready():  # in the engine thread, once compiled and warmed up
            self.metrics.record_startup("caches_and_programs", memory_added(loaded, memory_now()))
            try:
                self.metrics.record_parts(sched.memory(measured=False).parts)
            except Exception:  # a metric must never keep the server from starting
                log.exception("cannot measure the device buffers per part")

        self.engine = EngineThread(sched, max_queue=config.max_queue, on_chunk=self.metrics.on_chunk,
                                   on_end=self.metrics.on_end, on_ready=on_ready)
        self.metrics.watch(self.engine)
        self._drainer: threading.Thread | None = None
        self._parser = concurrent.futures.ThreadPoolExecutor(PARSERS, thread_name_prefix="specjax-parse")
        self._task_names: set[str] = set()
        self.app = Starlette(routes=[
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.prometheus, methods=["GET"]),
        ], middleware=[Middleware(RequestIds)], exception_handlers={APIError: self._error}, lifespan=self._lifespan)

    @contextlib.asynccontextmanager
    async def _lifespan(self, app):
        if not self.engine.thread.is_alive() and not self.engine.ready.is_set():
            self.engine.start()
        yield
        await asyncio.to_thread(self.engine.stop, 0.0)  # uvicorn has already drained the requests
        self._parser.shutdown(wait=False)

    @property
    def draining(self) -> bool:
        """`drain` was called."""
        return self._drainer is not None

    def drain(self, timeout: float) -> threading.Thread:
        """Stops accepting requests (they get 503 with Retry-After, and /health 503); those in flight
        get `timeout` seconds to finish, then the rest end with finish_reason "cancelled", sent to
        their clients, and the engine thread ends. Returns the thread that waits (SIGTERM calls this)."""
        self.engine.drain()
        if self._drainer is None:
            self._drainer = threading.Thread(target=self.engine.stop, args=(timeout,), name="specjax-drain",
                                             daemon=True)
            self._drainer.start()
        return self._drainer

    async def _error(self, request, exc: APIError):
        (log.warning if exc.status >= 500 else log.info)("request %s: %d %s", request_id(request), exc.status,
                                                         exc.message)
        return error_response(exc)

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
        self.keys.tenant(request.headers.get("authorization"), None)
        s = self.sched
        options = [o.label for o in s.options]
        return JSONResponse({"object": "list", "data": [{
            "id": self.config.model_name, "object": "model", "created": 0, "owned_by": "specjax",
            "max_model_len": s.engine.config.max_seq_len, "max_tokens": s.opts.max_new_tokens,
            "speculation": {"mode": "auto" if s.ccfg is not None else "fixed", "options": options},
            # the largest constraint (response_format, regex, choice) a request may bring; null: none
            "constraints": (None if s.constraint_pool is None else
                            {"states": s.constraint_pool.states, "classes": s.constraint_pool.classes})}]})

    async def prometheus(self, request):
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # ---- completions ---------------------------------------------------------------------------
    async def chat(self, request: HTTPRequest):
        return await self._serve(request, "chat")

    async def completions(self, request: HTTPRequest):
        return await self._serve(request, "completion")

    async def _serve(self, request: HTTPRequest, kind: str):
        arrived = time.perf_counter()  # latency counts from here: reading, parsing and tokenizing included
        auth = request.headers.get("authorization")
        self.keys.tenant(auth, None)  # 401 before the body is read
        raw = await read_body(request, self.config.max_body_bytes)
        loop = asyncio.get_running_loop()
        prep = await loop.run_in_executor(self._parser, self._prepare, raw, kind)
        tenant = self.keys.tenant(auth, prep.body.user)
        prep.submit.update(task=self._task(prep.body.task or request.headers.get("x-task")),
                           tenant=0 if self.config.share_ngram_table else self.tenants.id(tenant.scope))
        return await self._complete(request, prep, kind, arrived, tenant.label)

    def _prepare(self, raw: bytes, kind: str) -> _Prepared:
        """In a worker thread: the body parsed and validated, the prompt tokenized (or 400 / 404)."""
        body = protocol.parse(raw, ChatRequest if kind == "chat" else CompletionRequest, max_values=self.max_values)
        if body.model != self.config.model_name:
            raise APIError(404, f"the model {body.model!r} does not exist: this server serves "
                                f"{self.config.model_name!r}", type="not_found_error", param="model",
                           code="model_not_found")
        if kind == "chat":
            msgs = [{"role": m.role, "content": protocol.message_text(m, i)} for i, m in enumerate(body.messages)]
            self._check_chars(sum(len(m["content"]) for m in msgs), "messages")
            try:
                text = self.tokenizer.apply_chat_template(msgs)
            except Exception as e:
                raise bad(f"messages: the model's chat template rejected them: {e}", "messages") from None
            ids = self.tokenizer.encode(text, add_bos=False)
            max_tokens = body.max_completion_tokens if body.max_tokens is None else body.max_tokens
        else:
            p = body.prompt
            if isinstance(p, list) and p and isinstance(p[0], str):
                if len(p) != 1:
                    raise bad("prompt: give one prompt per request (batches of prompts are not supported)", "prompt")
                p = p[0]
            if body.echo:
                raise bad("echo is not supported", "echo")
            if isinstance(p, str):
                self._check_chars(len(p), "prompt")
            ids = self.tokenizer.encode(p) if isinstance(p, str) else list(p)
            max_tokens = body.max_tokens
        return _Prepared(body, ids, self._submit_args(body, ids, max_tokens), protocol.stop_strings(body.stop))

    def _check_chars(self, n: int, param: str) -> None:
        if n > self.max_prompt_chars:
            raise bad(f"the prompt has {n} characters; a prompt this server accepts (at most {self.bucket} tokens) "
                      f"has at most {self.max_prompt_chars}", param)

    def _task(self, task: str | None) -> str | None:
        """The task class; past MAX_TASKS distinct ones, "other" (per-class statistics stay bounded)."""
        if task is not None and len(task) > 64:
            raise bad("task (or the X-Task header): at most 64 characters", "task")
        if task is not None and task not in self._task_names:
            if len(self._task_names) >= MAX_TASKS:
                return "other"
            self._task_names.add(task)
        return task

    def _submit_args(self, body, ids: list[int], max_tokens: int | None) -> dict:
        """`Scheduler.submit`'s arguments (but the task and tenant), each value checked against the
        server's limits (400 naming the field). Reads only settings: safe in a worker thread."""
        s, opts = self.sched, self.sched.opts
        if body.n != 1:
            raise bad(f"n={body.n}: only n=1 is supported", "n")
        protocol.refuse_unsupported(body)
        if not ids:
            raise bad("the prompt is empty", "prompt")
        if len(ids) > self.bucket:
            raise bad(f"the prompt has {len(ids)} tokens; this server accepts at most {self.bucket} "
                      "(start it with a larger --max-prompt-tokens)", "prompt")
        vocab = s.engine.config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise bad(f"prompt token ids must lie in [0, {vocab})", "prompt")
        m = opts.max_new_tokens if max_tokens is None else max_tokens
        if not 1 <= m <= opts.max_new_tokens:
            raise bad(f"max_tokens={max_tokens}: must be an integer in [1, {opts.max_new_tokens}] "
                      "(the server's --max-tokens sizes its cache)", "max_tokens")
        _check_sampling(body, greedy=opts.sampling.greedy)
        stop_ids = list(body.stop_token_ids or [])
        if any(not 0 <= t < vocab for t in stop_ids):
            raise bad(f"stop_token_ids must lie in [0, {vocab})", "stop_token_ids")
        if len(set(stop_ids) | set(s.engine.stop_ids(opts))) > 8:
            raise bad("stop_token_ids: at most 8 stop tokens, the model's own included", "stop_token_ids")
        kw = dict(max_new_tokens=m, contribute=body.contribute, temperature=body.temperature, top_k=body.top_k,
                  top_p=body.top_p, seed=body.seed, stop_ids=stop_ids,
                  stream=None if body.seed is None else 0)  # a seed names the whole random stream
        kw.update(protocol.speculation_option(body.speculation, s.options, fixed=s.fixed))
        predicted = protocol.prediction_text(body.prediction)
        if predicted is not None:
            self._check_chars(len(predicted), "prediction")
            kw["prediction"] = self.tokenizer.encode(predicted, add_bos=False)
            if s.prediction_cap is not None and len(kw["prediction"]) > s.prediction_cap:
                raise bad(f"the prediction has {len(kw['prediction'])} tokens; this server's predict option takes "
                          f"at most {s.prediction_cap} (start it with a larger --prediction-cap)", "prediction")
        top = logprobs.requested(body, s.logprobs)
        if top is not None:
            kw["top_logprobs"] = top
        if body.logit_bias:
            try:
                kw["logit_bias"] = s.check_logit_bias(body.logit_bias)
            except ValueError as e:
                raise bad(str(e), "logit_bias") from None
        tables = self._constraint(body, stop_ids)  # last: the one check that may take seconds
        if tables is not None:
            kw["constraint"] = tables
        return kw

    def _constraint(self, body, stop_ids: list[int]):
        """In the worker thread: the request's constraint compiled (cached) and checked against the
        scheduler's pool (`Scheduler.check_constraint`), or a 400 naming the field; None: free."""
        try:
            return self.sched.check_constraint(response_format=body.response_format, regex=body.regex,
                                               choice=body.choice, stop_ids=stop_ids)
        except ConstraintError as e:
            raise bad(str(e), e.field) from None

    async def _complete(self, request: HTTPRequest, prep: _Prepared, kind: str, arrived: float, tenant: str):
        body, ids = prep.body, prep.ids
        if self.engine.startup_error is not None:
            raise APIError(503, f"the engine failed to start: {self.engine.startup_error}", type="server_error")
        timeout = min(x for x in (body.timeout, self.config.request_timeout, float("inf")) if x is not None)
        loop = asyncio.get_running_loop()
        job = Job(ids=ids, submit=prep.submit, loop=loop, events=asyncio.Queue(), arrived=arrived, tenant=tenant)
        if timeout != float("inf"):
            job.deadline = job.arrived + timeout
        retry = {"Retry-After": str(self.config.retry_after)}
        try:
            self.engine.submit(job)
        except QueueFull as e:
            raise APIError(429, f"the server is at capacity ({e}); retry after {self.config.retry_after} s",
                           type="rate_limit_error", code="queue_full", headers=retry) from None
        except NotAccepting as e:
            raise APIError(503, f"{e}; retry after {self.config.retry_after} s", type="server_error",
                           code="unavailable", headers=retry) from None
        rid = request_id(request)
        ctx = _Ctx(kind=kind, rid=rid, id=("chatcmpl-" if kind == "chat" else "cmpl-") + rid,
                   created=int(time.time()), prompt_tokens=len(ids), stops=prep.stops, stream=body.stream,
                   include_usage=bool(body.stream_options and body.stream_options.include_usage),
                   token_ids=body.return_token_ids, prediction=prep.submit.get("prediction"),
                   logprobs="top_logprobs" in prep.submit)
        if body.stream:
            return StreamingResponse(self._sse(job, ctx), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        watcher = asyncio.create_task(self._watch_disconnect(request, job))
        try:
            text, toks, lps, finish, end = "", [], [], None, None
            async for delta, ids_delta, lps_delta, finish, end in self._events(job, ctx):
                text += delta
                toks += ids_delta
                lps += lps_delta or []
        finally:
            watcher.cancel()
            if not job.ended:
                self.engine.cancel(job)
        if end is not None and end.reason == "error":
            raise self._end_error(end, ctx)
        return JSONResponse(self._final(ctx, text, toks, lps, finish, end))

    async def _watch_disconnect(self, request: HTTPRequest, job: Job) -> None:
        while True:
            await asyncio.sleep(0.2)
            if await request.is_disconnected():
                self.engine.cancel(job)
                return

    async def _events(self, job: Job, ctx: _Ctx) -> AsyncIterator[tuple[str, list[int], list | None, str | None,
                                                                         End | None]]:
        """(text delta, token ids delta, their logprob records (None: not asked), finish_reason or None,
        End or None) until the end."""
        dec = self.tokenizer.decode_stream(skip_special=True)
        hold = max((len(s) for s in ctx.stops), default=1) - 1
        buf, n = "", 0
        while True:
            ev = await job.events.get()
            end = ev if isinstance(ev, End) else None
            ids, lps = ([], None) if end else ev
            n += len(ids)
            buf += dec.flush() if end else dec.push(ids)
            hit = [i for i in (buf.find(s) for s in ctx.stops) if i >= 0]
            if hit and (end is None or end.reason != "error"):
                if end is None:
                    self.engine.cancel(job, "stop")
                yield buf[: min(hit)], ids, lps, "stop", end
                return
            if end is not None:
                yield buf, ids, lps, (None if end.reason == "error" else end.reason), end
                return
            emit = buf[: len(buf) - hold] if hold else buf
            buf = buf[len(emit):]
            if emit or ids:
                yield emit, ids, lps, None, None

    def _end_error(self, end: End, ctx: _Ctx) -> APIError:
        if end.client_error:
            return bad(end.error)
        log.error("request %s failed in the engine: %s", ctx.rid, end.error)
        return APIError(500, f"the request failed in the engine: {end.error} (request {ctx.rid})", type="server_error")

    def _usage(self, ctx: _Ctx, end: End | None, completion: list[int]) -> dict:
        usage = {"prompt_tokens": ctx.prompt_tokens, "completion_tokens": len(completion),
                 "total_tokens": ctx.prompt_tokens + len(completion)}
        if ctx.prediction is not None:
            accepted, rejected = prediction_usage(ctx.prediction, completion)
            usage["completion_tokens_details"] = {"accepted_prediction_tokens": accepted,
                                                  "rejected_prediction_tokens": rejected}
        return usage

    def _spec_metrics(self, end: End | None) -> dict:
        req = end.request if end is not None else None
        if req is None:
            return {}
        return {"metrics": {"speculative_decoding": {**req.counters.to_dict(), "chunks": dict(req.chunks),
                                                     "target_forwards": req.target_forwards}}}

    def _logprobs(self, ctx: _Ctx, toks: list[int], lps: list | None) -> dict | None:
        """The choice's `logprobs` for these tokens (None when the request asked for none)."""
        if not ctx.logprobs:
            return None
        if ctx.kind == "chat":
            return self.logprobs.chat(toks, lps or [])
        out = self.logprobs.completion(toks, lps or [], ctx.offset)
        ctx.offset += sum(map(len, out["tokens"]))
        return out

    def _final(self, ctx: _Ctx, text: str, toks: list[int], lps: list, finish: str | None, end: End | None) -> dict:
        lp = self._logprobs(ctx, toks, lps)
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": lp,
                   "finish_reason": finish} if ctx.kind == "chat" else
                  {"index": 0, "text": text, "logprobs": lp, "finish_reason": finish})
        if ctx.token_ids:
            choice["token_ids"] = toks
        return {"id": ctx.id, "object": "chat.completion" if ctx.kind == "chat" else "text_completion",
                "created": ctx.created, "model": self.config.model_name, "choices": [choice],
                "usage": self._usage(ctx, end, toks), **self._spec_metrics(end)}

    def _chunk(self, ctx: _Ctx, text: str, toks: list[int], finish: str | None, *, first: bool = False,
               lps: list | None = None) -> dict:
        lp = self._logprobs(ctx, toks, lps)
        if ctx.kind == "chat":
            delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}
        if ctx.token_ids:
            choice["token_ids"] = toks
        return {"id": ctx.id, "object": "chat.completion.chunk" if ctx.kind == "chat" else "text_completion",
                "created": ctx.created, "model": self.config.model_name, "choices": [choice]}

    async def _sse(self, job: Job, ctx: _Ctx):
        sse = lambda obj: f"data: {json.dumps(obj, ensure_ascii='error' in obj)}\n\n"  # errors may quote input
        try:
            try:
                toks, first = [], True
                async for delta, ids, lps, finish, end in self._events(job, ctx):
                    if end is not None and end.reason == "error":
                        yield sse(self._end_error(end, ctx).body())
                        break
                    toks += ids
                    yield sse(self._chunk(ctx, delta, ids, finish, first=first, lps=lps))
                    first = False
                    if finish is not None:
                        if ctx.include_usage:
                            usage = {**self._chunk(ctx, "", [], None), "choices": [],
                                     "usage": self._usage(ctx, end, toks), **self._spec_metrics(end)}
                            yield sse(usage)
                        break
            except Exception:  # the status is sent: the stream ends with an error event naming the request
                log.exception("request %s failed while streaming", ctx.rid)
                yield sse(APIError(500, f"internal error while streaming request {ctx.rid}; the server's log "
                                        "has the details under that id", type="server_error").body())
            yield "data: [DONE]\n\n"
        finally:  # the client went away (Starlette cancels this generator), or a stop string ended it
            if not job.ended:
                self.engine.cancel(job)
