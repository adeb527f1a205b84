"""The text side of a host: prompts, predictions and logit_bias turned into checked token ids.

`Prompts` tokenizes (with the chat template when asked), checks every id against the vocabulary and
every prompt against the buckets and the model's context, and compiles a request's constraint
(`specjax.constrain.from_request`, cached), so bad input fails with one error naming it before
anything compiles. The `Engine` holds one and answers through it; a host that keeps no model could
use it alone.
"""

from __future__ import annotations

import operator
from typing import Sequence

from specjax import constrain
from specjax.core.sampling import check_logit_bias
from specjax.serving.batch import GenerateOptions, _prompt_list, _values


class Prompts:
    """A model's tokenizer (None: token ids only), vocabulary size, context length and prompt buckets."""

    def __init__(self, tokenizer, *, vocab: int, max_seq_len: int, buckets: Sequence[int]):
        self.tokenizer, self.vocab, self.max_seq_len = tokenizer, vocab, max_seq_len
        self.buckets = tuple(b for b in sorted(buckets) if b <= max_seq_len) or (max_seq_len,)

    def encode(self, prompts: Sequence[str | Sequence[int]], *, chat: bool = False) -> list[list[int]]:
        """Token ids for each prompt (strings are tokenized, with the chat template if asked)."""
        if chat and self.tokenizer is not None and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("chat=True (--chat) needs the model's chat template, and this model has none (a base "
                             "model completes text): give the prompt as plain text, without --chat")
        out = []
        for i, p in enumerate(_prompt_list(prompts)):
            if isinstance(p, str):
                if self.tokenizer is None:
                    raise ValueError("this Engine has no tokenizer: pass token ids, not strings")
                if chat:
                    p = self.tokenizer.apply_chat_template([{"role": "user", "content": p}])
                    ids = self.tokenizer.encode(p, add_bos=False)
                else:
                    ids = self.tokenizer.encode(p)
            else:
                try:
                    ids = [operator.index(t) for t in p]
                except TypeError:
                    raise ValueError(f"prompt {i} is {p!r}: each prompt is a string or a list of integer token "
                                     "ids; pass a list of prompts, e.g. [[1, 2, 3]] or [\"text\"]") from None
            if not ids:
                raise ValueError(f"prompt {i} is empty: give at least one token or character")
            bad = [t for t in ids if not 0 <= t < self.vocab]
            if bad:
                raise ValueError(f"prompt {i} has token ids {bad[:4]} outside [0, {self.vocab})")
            out.append(ids)
        return out

    def encode_predictions(self, prediction, n: int) -> list[list[int] | None] | None:
        """Token ids of each prompt's predicted output (`prediction`: one entry per prompt, a string,
        token ids or None; None: no prompt has one). Text is tokenized without BOS, as the answer
        continues the prompt."""
        if prediction is None:
            return None
        if isinstance(prediction, (str, bytes)):
            raise ValueError("prediction is one string: give one per prompt, e.g. prediction=[text] "
                             "(None for a prompt without one)")
        rows = list(prediction)
        if len(rows) != n:
            raise ValueError(f"prediction has {len(rows)} entries for {n} prompts: give one per prompt (None for none)")
        out = []
        for i, p in enumerate(rows):
            if p is None:
                out.append(None)
                continue
            if isinstance(p, str):
                if self.tokenizer is None:
                    raise ValueError("this Engine has no tokenizer: give predictions as token ids, not strings")
                ids = self.tokenizer.encode(p, add_bos=False)
            else:
                try:
                    ids = [operator.index(t) for t in p]
                except TypeError:
                    raise ValueError(f"prediction {i} is {p!r}: give a string or a list of integer token ids") from None
            bad = [t for t in ids if not 0 <= t < self.vocab]
            if bad:
                raise ValueError(f"prediction {i} has token ids {bad[:4]} outside [0, {self.vocab})")
            out.append(ids)
        return out

    def bucket_for(self, length: int) -> int:
        for b in self.buckets:
            if length <= b:
                return b
        raise ValueError(
            f"prompt of {length} tokens is longer than the largest bucket ({self.buckets[-1]}); "
            "shorten the prompt or pass larger `buckets=` (up to the model's max_seq_len "
            f"{self.max_seq_len})")

    def stop_ids(self, opts: GenerateOptions) -> tuple[int, ...]:
        """The stop tokens of a call: the options' own, else the tokenizer's."""
        if opts.stop_ids is not None:
            return tuple(opts.stop_ids)
        return tuple(getattr(self.tokenizer, "stop_ids", ()) or ())

    def check(self, prompts, opts: GenerateOptions, *, chat: bool = False) -> list[list[int]]:
        """Validates prompts and options without compiling; returns the token ids."""
        opts.validate()
        ids = self.encode(prompts, chat=chat)
        for x in ids:
            self.bucket_for(len(x))
            if len(x) + opts.max_new_tokens > self.max_seq_len:
                raise ValueError(
                    f"prompt ({len(x)} tokens) + max_new_tokens ({opts.max_new_tokens}) exceeds the "
                    f"model's context of {self.max_seq_len}; lower max_new_tokens")
        n = len(ids)
        for name in ("temperature", "top_k", "top_p"):
            v = _values(getattr(opts, name))
            if len(v) not in (1, n):
                raise ValueError(f"{name} has {len(v)} values for {n} prompts: give one, or one per prompt")
        return ids

    def logit_biases(self, logit_bias, n: int) -> list[dict[int, float] | None] | None:
        """Each of `n` prompts' logit_bias, checked against the vocabulary (`sampling.check_logit_bias`):
        `logit_bias` is one map for every prompt, one per prompt (None for none), or None."""
        if logit_bias is None:
            return None
        rows = [logit_bias] * n if isinstance(logit_bias, dict) else list(logit_bias)
        if len(rows) != n:
            raise ValueError(f"logit_bias has {len(rows)} entries for {n} prompts: give one map for all, or one "
                             "per prompt (None for none)")
        rows = [None if not r else check_logit_bias(r, self.vocab) for r in rows]
        return None if not any(rows) else rows

    def constraint_for(self, *, response_format: dict | None = None, regex: str | None = None,
                       choice: Sequence[str] | None = None) -> constrain.TokenTables | None:
        """The tables of a constraint (`specjax.constrain.from_request`, compiled once and cached), or
        None for none; needs the model's tokenizer."""
        if response_format is None and regex is None and choice is None:
            return None
        if self.tokenizer is None:
            raise ValueError("a constraint (response_format, regex, choice) needs the model's tokenizer")
        return constrain.from_request(self.tokenizer, response_format=response_format, regex=regex,
                                      choice=None if choice is None else list(choice))
