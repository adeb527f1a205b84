"""OpenAI-shaped requests and errors, and their validation into `Scheduler.submit` arguments.

`parse` turns a request body into a request model or one 400 saying what is wrong: invalid JSON,
NaN / Infinity, nesting deeper than the JSON parser allows, integers past Python's digit limit,
more JSON values than a request can need, lone UTF-16 surrogates, and wrong types. Types are
strict, as OpenAI's: a token count is an integer (`true`, `1.0` and `"1"` are not), a flag is a
boolean, a message role is one of `ROLES`. Nothing here compiles anything; the server runs it off
the event loop.

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

Structured answers (the server needs a constraint pool: `specjax serve --constraint-states N
--constraint-classes M`, on by default; 0 turns it off, and a constrained request is then a 400 saying
so). One of:
- `response_format`: {"type": "text"} (no constraint), {"type": "json_object"} (any JSON object), or
  {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": true}}: the answer
  is compact JSON valid under the schema (keys in the schema's order).
- `regex` (extension, a string): the whole answer matches this regular expression.
- `choice` (extension, a list of strings): the answer is exactly one of them.
The constraint is compiled (cached; a large schema can take seconds) in a worker thread off the event
loop, before the request is queued; a malformed one, two at once, or one larger than the pool (its
automaton states or token classes) is a 400 naming the field, with the fix. Every position the model
samples or verifies is masked by the constraint's automaton, speculation included; the answer ends at
the model's stop token once complete (finish_reason "stop"), or at max_tokens ("length": cut short,
not valid yet); a constraint the vocabulary cannot finish (a dead automaton state, which the compiler
prunes) ends at the stop token with finish_reason "constraint_unmet".

`prediction` ({"type": "content", "content": text or text parts}, OpenAI's Predicted Outputs) is the
text the answer is expected to restate: a `predict` option drafts from it, and `usage` reports
`completion_tokens_details.accepted_prediction_tokens` / `rejected_prediction_tokens` whatever ran.
`logit_bias` is added to the target's logits at every position; `logprobs` / `top_logprobs` give each
token's log-probabilities (`specjax.serving.server.logprobs`).

Nothing is dropped in silence. A field that would change the answer and is not supported
(`UNSUPPORTED`: penalties, tools, audio, reasoning effort, ...) is a 400 naming it, unless its value
is the neutral one (a penalty of 0, `tools: []`, `tool_choice: "none"`); so is a top-level field this
server does not know. `IGNORED` lists the OpenAI fields it accepts that cannot change the answer.
"""

from __future__ import annotations

import json
import sys
from typing import Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field

ROLES = ("system", "developer", "user", "assistant", "tool")
IGNORED = ("metadata", "store", "service_tier", "parallel_tool_calls", "user")  # accepted: no effect on the answer


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


_STRICT = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)
_REQUEST = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)  # a top-level field it does not know: 400


class SpecRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    method: str
    k: int | None = None


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False


class ContentPart(BaseModel):
    model_config = _STRICT
    type: str
    text: str | None = None


class Prediction(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["content"]
    content: str | list[ContentPart]


class _Common(BaseModel):
    model_config = _REQUEST

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
    logprobs: bool | int | None = None  # chat: true/false; completions: the alternatives (`server.logprobs`)
    top_logprobs: int | None = None
    prediction: Prediction | None = None
    response_format: dict | None = None  # a constraint (see the module docstring), with `regex` and `choice`
    regex: str | None = None
    choice: list[str] | None = None
    # OpenAI fields that change the answer, refused unless neutral (`UNSUPPORTED`)
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    tools: list | None = None
    tool_choice: str | dict | None = None
    functions: list | None = None
    function_call: str | dict | None = None
    reasoning_effort: str | None = None
    modalities: list[str] | None = None
    audio: dict | None = None
    web_search_options: dict | None = None
    # OpenAI fields that cannot change the answer (`IGNORED`)
    metadata: dict | None = None
    store: bool | None = None
    service_tier: str | None = None
    parallel_tool_calls: bool | None = None


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: Literal[ROLES]
    content: str | list[ContentPart] | None = None


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int]
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


# field -> (its neutral values: accepted, as leaving it out; why another value is refused)
UNSUPPORTED = {
    "frequency_penalty": ((None, 0, 0.0), "penalties are not supported: send 0 or leave it out"),
    "presence_penalty": ((None, 0, 0.0), "penalties are not supported: send 0 or leave it out"),
    "tools": ((None, []), "tool calls are not supported: leave tools out"),
    "tool_choice": ((None, "none", "auto"), "tool calls are not supported: leave tool_choice out"),
    "functions": ((None, []), "function calls are not supported: leave functions out"),
    "function_call": ((None, "none", "auto"), "function calls are not supported: leave function_call out"),
    "reasoning_effort": ((None,), "this server's models do not reason: leave reasoning_effort out"),
    "modalities": ((None, ["text"]), "only text output is supported: send [\"text\"] or leave it out"),
    "audio": ((None,), "audio output is not supported: leave audio out"),
    "web_search_options": ((None,), "web search is not supported: leave web_search_options out"),
    "best_of": ((None, 1), "best_of > 1 is not supported: send 1 or leave it out"),
    "suffix": ((None, ""), "insertion (suffix) is not supported: leave suffix out"),
}


def refuse_unsupported(body: BaseModel) -> None:
    """A 400 naming the first field whose value would change the answer in a way this server does
    not support (`UNSUPPORTED`); nothing for neutral values."""
    for name, (neutral, why) in UNSUPPORTED.items():
        if name in type(body).model_fields and getattr(body, name) not in neutral:
            raise bad(f"{name}: {why}", name)


def prediction_text(prediction: Prediction | None) -> str | None:
    """The predicted output's text (its text parts joined), or None."""
    if prediction is None:
        return None
    if isinstance(prediction.content, str):
        return prediction.content
    parts = []
    for i, p in enumerate(prediction.content):
        if p.type != "text" or p.text is None:
            raise bad(f"prediction.content[{i}]: only text parts ({{\"type\": \"text\", \"text\": ...}}) are "
                      f"supported, got type {p.type!r}", "prediction.content")
        parts.append(p.text)
    return "".join(parts)


def message_text(m: ChatMessage, i: int) -> str:
    if m.content is None or isinstance(m.content, str):
        return m.content or ""
    parts = []
    for p in m.content:
        if p.type != "text" or p.text is None:
            raise bad(f"messages[{i}].content: only text parts ({{\"type\": \"text\", \"text\": ...}}) are "
                      f"supported, got type {p.type!r}", f"messages[{i}].content")
        parts.append(p.text)
    return "".join(parts)


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON; send numbers as finite decimals")


def _check_values(obj, limit: int) -> None:
    """Refuses a body of more than `limit` JSON values (validating a huge list would hold the
    interpreter for long) and strings that are not Unicode text (a lone UTF-16 surrogate such as
    "\\ud800": the tokenizer and the response encoder cannot take them). Walks without recursion,
    and stops at the limit."""
    stack, n = [(obj, "")], 0
    while stack:
        x, where = stack.pop()
        n += 1
        if n > limit:
            raise bad(f"the body holds more than {limit} JSON values; a request this server accepts needs fewer")
        if isinstance(x, str):
            try:
                x.encode("utf-8")
            except UnicodeEncodeError as e:
                raise bad(f"{where or 'a key'}: the string holds a lone UTF-16 surrogate "
                          f"({x[e.start]!a} at character {e.start}); send valid Unicode", where or None) from None
        elif isinstance(x, dict):
            for k, v in x.items():
                stack += [(k, where), (v, f"{where}.{k}" if where else str(k))]
        elif isinstance(x, list):
            stack += [(v, f"{where}.{i}") for i, v in enumerate(x[:limit])]


def parse(raw: bytes, model: type[BaseModel], *, max_values: int) -> BaseModel:
    """The request model of a body, or one 400 naming what is wrong (see the module docstring);
    `max_values` bounds the JSON values (strings, numbers, lists, objects...) it may hold."""
    try:
        obj = json.loads(raw, parse_constant=_no_constant)
    except RecursionError:
        raise bad("the body nests deeper than the JSON parser allows; send a flat JSON object") from None
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError, NaN / Infinity, the digit limit
        if "integer string conversion" in str(e):
            raise bad(f"the body has an integer of more than {sys.get_int_max_str_digits()} digits; no field "
                      "takes one") from None
        raise bad(f"the body is not valid JSON ({e}); send a JSON object") from None
    if not isinstance(obj, dict):
        raise bad("the body must be a JSON object")
    _check_values(obj, max_values)
    try:
        return model.model_validate(obj)
    except pydantic.ValidationError as e:
        err = e.errors(include_url=False, include_input=False)[0]
        loc = ".".join(str(x) for x in err["loc"])
        if err["type"] == "extra_forbidden":
            raise bad(f"{loc}: unknown field; this server does not support it (leave it out)", loc) from None
        raise bad(f"{loc}: {err['msg']}", loc or None) from None


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
