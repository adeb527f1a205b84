"""What a call of the offline Engine runs and returns: its options (`GenerateOptions`), one
fixed-shape batch (`Batch`: prefill, then decode to the end or in streaming chunks, through the
Engine's compile cache) and each prompt's `Result`."""

from __future__ import annotations

import dataclasses
import operator
import time
from typing import Any, Iterator, Sequence

import jax
import numpy as np

from specjax import sharding, telemetry
from specjax.core import decoder as core
from specjax.core import sampling
from specjax.core.constraint import met as constraint_met
from specjax.core.decoder import (MAX_STOP_IDS, RUN_TO_END, Decoder, Inputs, State, decode_program, new_tokens,
                                  prefill_program, token_logprobs)
from specjax.core.logprobs import TokenLogprob
from specjax.core.sampling import Sampling
from specjax.methods.predict.usage import prediction_usage
from specjax.telemetry import SpecCounters


def _values(x) -> list:
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _prompt_list(prompts) -> list:
    """`prompts` as a list; one string (which would decode one prompt per character) is refused."""
    if isinstance(prompts, (str, bytes)):
        raise ValueError(f"prompts is one string: pass a list of prompts, e.g. [{prompts[:40]!r}]")
    try:
        return list(prompts)
    except TypeError:
        raise ValueError(f"prompts={prompts!r}: pass a list of prompts (strings or lists of token ids)") from None


def _positive_int(name: str, value, *, none_means: str | None = None) -> int | None:
    """`value` as an int >= 1 (None passes when `none_means` says what it means)."""
    if value is None and none_means is not None:
        return None
    try:
        ok = operator.index(value) >= 1 and not isinstance(value, bool)
    except TypeError:
        ok = False
    if not ok:
        alt = f" (or None: {none_means})" if none_means else ""
        raise ValueError(f"{name}={value!r}: must be an integer >= 1{alt}")
    return operator.index(value)


@dataclasses.dataclass(frozen=True, kw_only=True)
class GenerateOptions:
    """Per-call values; none of them changes a compiled program's shape except through buckets.

    temperature, top_k and top_p may be one value or one per prompt (rows of one batch differ
    without a recompile). max_new_tokens values up to the same power of two share one program.
    """

    max_new_tokens: int = 128
    temperature: float | tuple[float, ...] = 0.0
    top_k: int | tuple[int, ...] = 0
    top_p: float | tuple[float, ...] = 1.0
    seed: int = 0
    stop_ids: tuple[int, ...] | None = None  # default: the tokenizer's stop tokens

    def validate(self) -> None:
        core.check_max_new_tokens(self.max_new_tokens)
        for t in _values(self.temperature):
            sampling.validate(t, 0, 1.0)
        for k in _values(self.top_k):
            sampling.validate(0.0, k, 1.0)
        for p in _values(self.top_p):
            sampling.validate(0.0, 0, p)
        if self.stop_ids is not None and len(self.stop_ids) > MAX_STOP_IDS:
            raise ValueError(f"{len(self.stop_ids)} stop tokens: at most {MAX_STOP_IDS} are supported")

    @property
    def sampling(self) -> Sampling:
        """The static sampling method: `Sample()` when any row has temperature > 0, else `Greedy()`."""
        return sampling.Sample() if max(_values(self.temperature)) > 0 else sampling.Greedy()


@dataclasses.dataclass
class Result:
    """One prompt's generation. Rows of one batch share the batch's times."""

    tokens: list[int]  # generated ids, the stop token included when one ended the row
    text: str
    target_forwards: int  # target forward passes after prefill while the row was active
    ttft_s: float
    wall_s: float  # generation time, compile excluded
    compile_s: float
    stop_reason: telemetry.StopReason  # a StrEnum, equal to "stop_token" | "max_new_tokens" | "cache_full"
    method: str = "none"
    k: int = 0  # the most drafts a step can accept: the chain length, or the tree's depth
    counters: SpecCounters = dataclasses.field(default_factory=SpecCounters)
    prediction: tuple[int, int] | None = None  # (accepted, rejected) prediction tokens, when one was given
    logprobs: list[TokenLogprob] | None = None  # each token's log-probability and top tokens, when recorded

    @property
    def new_tokens(self) -> int:
        return len(self.tokens)

    @property
    def tau(self) -> float:
        return telemetry.tau(self.new_tokens, self.target_forwards)

    @property
    def tok_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else float("nan")

    def to_dict(self) -> dict:
        """The JSON record: generation facts, then the speculation counters."""
        return dict(tokens=self.tokens, text=self.text, new_tokens=self.new_tokens,
                    target_forwards=self.target_forwards, tau=self.tau, ttft_s=round(self.ttft_s, 6),
                    wall_s=round(self.wall_s, 6), tok_per_s=round(self.tok_per_s, 3),
                    compile_s=round(self.compile_s, 3), stop_reason=self.stop_reason, method=self.method,
                    k=self.k, **self.counters.to_dict(),
                    **({} if self.prediction is None else dict(accepted_prediction_tokens=self.prediction[0],
                                                               rejected_prediction_tokens=self.prediction[1])),
                    **({} if self.logprobs is None else dict(logprobs=[dict(logprob=e.logprob, top=[list(t) for t in e.top]) for e in self.logprobs])))


class Batch:
    """One fixed-shape batch of an `Engine` (`Engine.start`; its compile cache, weights and tokenizer):
    prefill, then decode to the end or in streaming chunks."""

    def __init__(self, engine: Any, decoder: Decoder, pparams, inputs: Inputs, *, n_real: int,
                 method: str = "none", predictions: Sequence | None = None, parts: dict | None = None,
                 constraint: Any = None):
        self.engine, self.decoder, self.pparams, self.inputs = engine, decoder, pparams, inputs
        self.n_real, self.method = n_real, method
        self.predictions = predictions  # each row's prediction ids (None: none), for the usage counts
        self.parts = parts  # the batch-shared state the prefill starts from (a constraint pool), or None
        self.constraint = constraint  # the host tables every row's answer follows, or None
        self.compile_s = 0.0
        self._prefill = self._compile(prefill_program, pparams, inputs, parts)
        abstract = jax.eval_shape(lambda *a: prefill_program(*a, static=decoder),
                                  engine.graphdef, engine.params, pparams, inputs, parts)
        abstract = sharding.abstract_carry(abstract, engine.mesh)  # eval_shape drops shardings
        stop_at = sharding.abstract_carry(jax.ShapeDtypeStruct((), np.int32), engine.mesh)
        self._loop = self._compile(decode_program, pparams, abstract, stop_at)
        self.state: State | None = None
        self._view = None  # (state, its host copy)
        self.ttft_s = 0.0
        self.decode_s = 0.0

    def _compile(self, fn, *args):
        prog, seconds = self.engine.program(fn, self.decoder, *args)
        self.compile_s += seconds
        return prog

    def prefill(self) -> State:
        t0 = time.perf_counter()
        self.state = jax.block_until_ready(self._prefill(self.engine.params, self.pparams, self.inputs, self.parts))
        self.ttft_s = time.perf_counter() - t0
        return self.state

    def view(self):
        """Numpy copies of what the host reads of the state (tokens, lengths, done, counters), read
        back once per state through one replicated view (`specjax.sharding.host_view`)."""
        if self._view is None or self._view[0] is not self.state:
            s = self.state.decode
            keep = s.replace(cache=None, keys=None, shared=s.shared.replace(parts={}), sampling=None,
                             contribute=None)
            self._view = (self.state, sharding.host_view((keep, self.state.stats), self.engine.mesh))
        return self._view[1]

    def decode(self, steps: int | None = None) -> State:
        """Runs the loop until all rows are done, or for at most `steps` forwards."""
        steps = _positive_int("steps", steps, none_means="run to the end")
        forwards = int(self.view()[0].forwards)
        stop_at = np.int32(RUN_TO_END if steps is None else forwards + steps)
        t0 = time.perf_counter()
        self.state = jax.block_until_ready(self._loop(self.engine.params, self.pparams, self.state, stop_at))
        self.decode_s += time.perf_counter() - t0
        return self.state

    @property
    def finished(self) -> bool:
        return bool(np.all(self.view()[0].done[: self.n_real]))

    def run(self) -> list[Result]:
        self.prefill()
        if not self.finished:
            self.decode()
        return self.results()

    def stream(self, chunk: int = 8) -> Iterator[list[list[int]]]:
        """Yields, per chunk of decode steps, the new token ids of each row."""
        return self._stream(_positive_int("chunk", chunk))  # checked now, not at the first next()

    def _stream(self, chunk: int) -> Iterator[list[list[int]]]:
        self.prefill()
        seen = self.view()[0].prompt_lengths
        while True:
            lengths, toks = self.view()[0].lengths, self.view()[0].tokens
            yield [toks[r, seen[r]: lengths[r]].tolist() for r in range(self.n_real)]
            seen = lengths
            if self.finished:
                return
            self.decode(chunk)

    def new_tokens(self) -> list[list[int]]:
        return new_tokens(self.view()[0])[: self.n_real]  # the host copy: no second read

    def results(self) -> list[Result]:
        s, stats = self.view()
        stops, max_new, fwd = s.stop_ids, s.max_new, s.row_forwards
        tok = self.engine.tokenizer
        k = self.decoder.depth
        lps = None if s.logprobs is None else token_logprobs(s)
        return [Result(tokens=toks, text=tok.decode(toks, skip_special=True) if tok else "",
                       target_forwards=int(fwd[r]), ttft_s=self.ttft_s, wall_s=self.ttft_s + self.decode_s,
                       compile_s=self.compile_s, stop_reason=telemetry.stop_reason(
                           toks, stops[r], max_new[r], met=self.constraint is None or constraint_met(self.constraint, toks, stops[r])),
                       method=self.method, k=k, counters=SpecCounters.from_stats(stats, r),
                       prediction=self._prediction_usage(r, toks),
                       logprobs=None if lps is None else lps[r])
                for r, toks in enumerate(self.new_tokens())]

    def _prediction_usage(self, row: int, tokens: list[int]) -> tuple[int, int] | None:
        pred = None if self.predictions is None else self.predictions[row]
        return None if pred is None else prediction_usage(pred, tokens)
