"""OpenAI's `logprobs` on the server: what a request asks for, and the response's shapes.

A chat request asks with `logprobs: true` and `top_logprobs: n` (0..20); a completion request with
`logprobs: n`. Either way n is at most what the server records (`specjax serve --logprobs N`,
`Scheduler(logprobs=N)`); past it, or with `top_logprobs` and no `logprobs`, the request is a 400
naming the field. The values are the target's log-probabilities before logit_bias, a constraint's
mask and temperature (`specjax.core.logprobs`), one entry per generated token:

- chat: `choices[i].logprobs = {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token",
  "logprob", "bytes"}, ...]}, ...]}`;
- completions: `{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}`,
  the offsets counted in characters of the generated text.

A stream's chunks carry the entries of their own tokens. A token whose bytes are not whole UTF-8
(a piece of a character) is spelled "bytes:\\xNN..." as OpenAI does; `bytes` has its exact bytes
(`specjax.constrain.token_bytes`; a special token, or a vocabulary spelled neither byte-level nor
SentencePiece: its decoded text).
"""

from __future__ import annotations

import itertools
from typing import Sequence

from specjax.constrain import token_bytes
from specjax.core.logprobs import TokenLogprob
from specjax.serving.server.protocol import ChatRequest, bad


def requested(body, most: int | None) -> int | None:
    """The alternatives per token a request asks for with its logprobs (None: no logprobs), checked
    against the server's `most` (None: the server records none). Raises a 400 naming the field."""
    chat = isinstance(body, ChatRequest)
    if chat:
        if body.logprobs is not None and not isinstance(body.logprobs, bool):
            raise bad(f"logprobs={body.logprobs!r}: a chat request asks with true or false (and top_logprobs: n)",
                      "logprobs")
        if body.top_logprobs is not None and not body.logprobs:
            raise bad("top_logprobs needs logprobs: true", "top_logprobs")
        n = (body.top_logprobs or 0) if body.logprobs else None
        field = "top_logprobs"
    else:
        if body.top_logprobs is not None:
            raise bad("a completion request asks for alternatives with logprobs: n (top_logprobs is chat's)",
                      "top_logprobs")
        if isinstance(body.logprobs, bool):
            raise bad(f"logprobs={body.logprobs}: a completion request asks with an integer, the alternatives "
                      "per token (0: the chosen token's only)", "logprobs")
        n, field = body.logprobs, "logprobs"
    if n is None:
        return None
    if most is None:
        raise bad("this server records no logprobs: start it with --logprobs N (N alternatives per token at most)",
                  field)
    if not 0 <= n <= most:
        raise bad(f"{field}={n}: this server gives at most {most} alternatives per token "
                  f"(start it with a larger --logprobs, up to 20)", field)
    return n


class Formatter:
    """Token records (`TokenLogprob`) as OpenAI's JSON, with the tokenizer's spelling of each token."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._bytes: dict[int, bytes] | None = None  # each ordinary token's bytes, read at first use

    def bytes_of(self, token: int) -> bytes:
        if self._bytes is None:
            try:
                self._bytes = token_bytes(self.tokenizer)
            except ValueError:  # a vocabulary spelled neither byte-level nor SentencePiece: its decoded text
                self._bytes = {}
        b = self._bytes.get(token)
        return self.tokenizer.decode([token]).encode("utf-8") if b is None else b  # a special token: its text

    def text_of(self, token: int) -> str:
        b = self.bytes_of(token)
        try:
            return b.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{c:02x}" for c in b)

    def _entry(self, token: int, logprob: float) -> dict:
        return {"token": self.text_of(token), "logprob": logprob, "bytes": list(self.bytes_of(token))}

    def chat(self, tokens: Sequence[int], records: Sequence[TokenLogprob]) -> dict:
        return {"content": [{**self._entry(t, r.logprob), "top_logprobs": [self._entry(i, v) for i, v in r.top]}
                            for t, r in zip(tokens, records)]}

    def completion(self, tokens: Sequence[int], records: Sequence[TokenLogprob], offset: int = 0) -> dict:
        """`offset`: characters of generated text before these tokens (a stream's earlier chunks)."""
        texts = [self.text_of(t) for t in tokens]
        starts = list(itertools.accumulate(map(len, texts[:-1]), initial=offset))[: len(texts)]
        return {"tokens": texts, "token_logprobs": [r.logprob for r in records],
                "top_logprobs": [{self.text_of(i): v for i, v in r.top} for r in records], "text_offset": starts}
