"""OpenAI-shaped requests and errors, and their validation into `Scheduler.submit` arguments.

Everything here runs on the event loop before the request reaches the engine thread, and compiles
nothing: a bad request gets one 400 (or 404 for an unknown model) saying what is wrong.

Extensions beside the OpenAI fields (as vLLM and llama-server add theirs):
- `top_k`: 0 = off.
- `stop_token_ids`: stop tokens besides the model's.
- `speculation`: "off" (never speculated on, and its text stays out of the n-gram table), "auto"
  (the server's choice: the controller for `--method auto`, else the loaded method), or
  {"method": "ngram", "k": 4}: one of the options the server loaded (see GET /v1/models).
- `task`: the task class (or the `X-Task` header) that per-class acceptance is kept under.
- `contribute`: false keeps this request's text out of the cross-request n-gram table.
- `timeout`: seconds from arrival; past it the request ends with finish_reason "timeout".
- `return_token_ids`: the generated token ids beside the text (as vLLM's).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class APIError(Exception):
    """An error answered as `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


class SpecRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    method: str
    k: int | None = None


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    user: str | None = None
    speculation: Literal["off", "auto"] | SpecRequest | None = None
    task: str | None = None
    contribute: bool = True
    timeout: float | None = None
    return_token_ids: bool = False
    logprobs: bool | int | None = None  # not supported: refused when asked for
    top_logprobs: int | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int]
    echo: bool = False


def message_text(m: ChatMessage, i: int) -> str:
    if m.content is None or isinstance(m.content, str):
        return m.content or ""
    parts = []
    for p in m.content:
        if p.get("type") != "text":
            raise bad(f"messages[{i}].content: only text parts are supported, got type {p.get('type')!r}",
                      f"messages[{i}].content")
        parts.append(str(p.get("text", "")))
    return "".join(parts)


def stop_strings(stop: str | list[str] | None) -> list[str]:
    out = [stop] if isinstance(stop, str) else list(stop or [])
    if len(out) > 4 or any(not s for s in out):
        raise bad("stop: give up to 4 non-empty strings", "stop")
    return out


def speculation_option(spec, options: tuple, *, fixed) -> dict:
    """`Scheduler.submit` arguments for the `speculation` field, within the loaded `options`
    (`SpecConfig`s); a request names one by its kind ("ngram", "medusa-tree") and k (its depth)."""
    loaded = ", ".join(o.label for o in options)
    if spec is None or spec == "auto":
        return {}
    if spec == "off":
        if not any(o.method == "none" for o in options):
            raise bad(f"speculation 'off': this server runs only {loaded}", "speculation")
        return dict(opt_out=True)
    methods = {o.kind for o in options if o.depth > 0}
    if spec.method not in methods:
        raise bad(f"unknown speculation method {spec.method!r}: this server loaded "
                  f"{', '.join(sorted(methods)) or 'none (plain decoding only)'}; use one of those, "
                  "'auto' or 'off'", "speculation")
    ks = sorted(o.depth for o in options if o.kind == spec.method and o.depth > 0)
    k = spec.k if spec.k is not None else (ks[0] if len(ks) == 1 else None)
    if k not in ks:
        raise bad(f"speculation {spec.method} with k={spec.k}: this server loaded k in {ks} for it",
                  "speculation")
    return dict(speculation=next(o for o in options if o.kind == spec.method and o.depth == k))
