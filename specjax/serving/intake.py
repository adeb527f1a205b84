"""A continuous-batching host's intake: every check a request passes before it queues, and its rows.

`Intake.request` validates a submitted request against the engine (prompt, sampling values, context)
and the host's limits (its options, prediction buffer, constraint pool, logit_bias width, logprobs),
compiles its constraint through the engine's cache, and returns the `Request` with its `Inputs` built
once at the core's boundary (`Inputs.create`), so that bad input fails at submit, before any work is
lost, and an insert validates nothing again. Nothing compiles here but a request's constraint tables.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from specjax.core import sampling
from specjax.core.decoder import Inputs, check_max_new_tokens
from specjax.core.logprobs import check_top
from specjax.methods.config import SpecConfig
from specjax.serving.batch import GenerateOptions
from specjax.serving.constraints import FLAGS, ConstraintError, ConstraintLimits
from specjax.serving.controller import PLAIN
from specjax.serving.options import OptionSet
from specjax.serving.requests import Request, _placeholder_request


class Intake:
    """Checks the requests of a host of `slots` rows serving `options`.

    Args:
      opts: each request's defaults; its max_new_tokens bounds each request's.
      chat: wrap string prompts in the chat template.
      constraint_pool: the largest constraint a request may bring (None: none).
      logit_bias: the most logit_bias entries a request may bring (OpenAI's token id -> value); every
        row then carries that many, added to the target's logits at every position
        (`specjax.core.sampling.biased`). 0: none, and a biased request is refused.
      logprobs: the most alternatives per token a request may ask for with its logprobs (0..20);
        every row then records its tokens' log-probabilities and that many top tokens
        (`Decoder.logprobs`). None: none recorded, and a request for logprobs is refused.
    """

    def __init__(self, engine, opts: GenerateOptions, options: OptionSet, *, slots: int, chat: bool,
                 constraint_pool: ConstraintLimits | None, logit_bias: int, logprobs: int | None):
        self.engine, self.opts, self.options, self.b, self.chat = engine, opts, options, slots, chat
        self.constraint_pool = constraint_pool
        if isinstance(logit_bias, bool) or int(logit_bias) != logit_bias or logit_bias < 0:
            raise ValueError(f"logit_bias={logit_bias}: the most entries a request may bring, an integer >= 0")
        self.logit_bias = int(logit_bias) or None  # rows' logit_bias width (None: no row carries one)
        self.logprobs = None if logprobs is None else check_top(logprobs, "logprobs")
        self.prediction_cap = options.prediction_cap  # rows' prediction buffer (None: none)

    def request(self, rid: int, prompt: str | Sequence[int], *, bucket: int | None, task: str | None = None,
                arrival: float | None = None, opt_out: bool = False, contribute: bool = True,
                max_new_tokens: int | None = None, seed: int | None = None, temperature: float | None = None,
                top_k: int | None = None, top_p: float | None = None, speculation: SpecConfig | None = None,
                tenant: int = 0, stop_ids: Sequence[int] = (), stream: int | None = None,
                prediction: str | Sequence[int] | None = None, response_format: dict | None = None,
                regex: str | None = None, choice: Sequence[str] | None = None, constraint: Any = None,
                logit_bias: dict | None = None, top_logprobs: int | None = None) -> Request:
        """Request `rid`, checked, with its inputs (`Scheduler.submit` says what each field means).
        `bucket`: the host's prompt bucket once its cache length is fixed (None: not yet)."""
        o = self.opts
        m = check_max_new_tokens(o.max_new_tokens if max_new_tokens is None else max_new_tokens,
                                 most=o.max_new_tokens, why="the scheduler's GenerateOptions.max_new_tokens sizes the cache")
        if arrival is not None and not arrival >= 0:
            raise ValueError(f"arrival={arrival}: must be >= 0 seconds (or None)")
        sp = dict(temperature=o.temperature if temperature is None else temperature,
                  top_k=o.top_k if top_k is None else top_k, top_p=o.top_p if top_p is None else top_p)
        (ids,) = self.engine.check([prompt], dataclasses.replace(o, **sp), chat=self.chat)
        if sp["temperature"] > 0 and o.sampling.greedy:
            raise ValueError(f"temperature={sp['temperature']} in a greedy scheduler: create it with "
                             "GenerateOptions(temperature > 0) to compile the sampled programs")
        if bucket is not None and self.engine.bucket_for(len(ids)) > bucket:
            raise ValueError(f"prompt of {len(ids)} tokens exceeds this scheduler's bucket of "
                             f"{bucket}; pass max_prompt_tokens= when creating it")
        speculation = self._speculation(opt_out, speculation)
        stops = tuple(dict.fromkeys([*self.engine.stop_ids(o), *map(int, stop_ids)]))
        (predicted,) = self.engine.encode_predictions([prediction], 1)
        cap = self.prediction_cap
        if predicted is not None and cap is not None and len(predicted) > cap:
            raise ValueError(f"a prediction of {len(predicted)} tokens exceeds prediction_cap={cap} of this "
                             "scheduler's predict option: shorten it, or raise the cap")
        tables = self.check_constraint(response_format=response_format, regex=regex, choice=choice,
                                       constraint=constraint, stop_ids=stops)
        bias = self.check_logit_bias(logit_bias)
        if top_logprobs is not None and (self.logprobs is None or check_top(top_logprobs) > self.logprobs):
            raise ValueError(f"top_logprobs={top_logprobs}: this host records at most {self.logprobs} alternatives "
                             "per token (Scheduler(logprobs=N); a server: --logprobs N)")
        req = Request(id=rid, ids=ids, max_new_tokens=int(m), task=task, arrival=arrival, opt_out=opt_out,
                      contribute=contribute and not opt_out, seed=o.seed if seed is None else seed,
                      speculation=speculation, tenant=tenant,
                      stop_ids=stops, stream=None if stream is None else int(stream), prediction=predicted,
                      constraint=tables, logit_bias=bias, top_logprobs=top_logprobs, **sp)
        req.inputs = self.inputs(req)  # validated once, at the core's boundary; reused at insert
        return req

    def _speculation(self, opt_out: bool, speculation: SpecConfig | None) -> SpecConfig | None:
        """The option a request names, checked and resolved (None: any)."""
        options = self.options.options
        if opt_out and PLAIN not in options:
            raise ValueError("opt_out needs the plain loop: create the scheduler with with_plain=True")
        if speculation is None:
            return None
        if not isinstance(speculation, SpecConfig):
            raise ValueError(f"speculation={speculation!r}: give a SpecConfig, one of this scheduler's options")
        resolved = self.engine.resolve(speculation)
        if resolved not in options:
            raise ValueError(f"speculation {speculation.label}: this scheduler runs "
                             f"{', '.join(o.label for o in options)}")
        return resolved

    def check_logit_bias(self, bias: dict | None) -> dict[int, float] | None:
        """A request's logit_bias checked (`sampling.check_logit_bias`) against the vocabulary and the
        host's width; None for none (or an empty one)."""
        if not bias:
            return None
        bias = sampling.check_logit_bias(bias, self.engine.config.vocab_size)
        most = self.logit_bias or 0
        if len(bias) > most:
            raise ValueError(f"logit_bias has {len(bias)} entries; this host takes at most {most} "
                             "(Scheduler(logit_bias=N); a server: --logit-bias N)")
        return bias

    def check_constraint(self, *, response_format: dict | None = None, regex: str | None = None,
                         choice: Sequence[str] | None = None, constraint: Any = None,
                         stop_ids: Sequence[int] = ()) -> Any:
        """A request's constraint tables (None: free), compiled through the engine's cache and checked
        against the host's pool; a server calls it first, off its event loop (it reads only settings).
        `stop_ids`: the request's own stop tokens besides the host's.

        Raises:
          ConstraintError (a ValueError naming the field): two constraints, a malformed one, no pool,
            one larger than the pool, or no stop token to end the answer.
        """
        given = [n for n, v in (("response_format", response_format), ("regex", regex), ("choice", choice),
                                ("constraint", constraint)) if v is not None and v != {"type": "text"}]
        if not given:
            return None
        field = given[0]
        if len(given) > 1:
            raise ConstraintError(field, f"{' and '.join(given)} given together: give one constraint")
        if self.constraint_pool is None:
            raise ConstraintError(field, "this scheduler has no constraint pool; create it with Scheduler("
                                         "constraint_pool=ConstraintLimits(states=..., classes=...)), or start the "
                                         f"server with one ({FLAGS})")
        if not (*self.engine.stop_ids(self.opts), *stop_ids):
            raise ConstraintError(field, "a constrained answer needs a stop token to end it; give stop_ids "
                                         "(the model's EOS), or a tokenizer that has one")
        try:
            tables = constraint if constraint is not None else self.engine.constraint_for(
                response_format=response_format, regex=regex, choice=choice)
            self.constraint_pool.check(tables, vocab=self.engine.config.vocab_size)
        except ValueError as e:
            raise ConstraintError(field, str(e)) from None
        return tables

    def inputs(self, req: Request, bucket: int | None = None) -> Inputs:
        """The request as a batch of one at its prompt bucket (validates its values)."""
        return Inputs.create([req.ids], bucket=bucket or self.engine.bucket_for(len(req.ids)),
                             max_new_tokens=req.max_new_tokens, temperature=req.temperature, top_k=req.top_k,
                             top_p=req.top_p, stop_ids=req.stop_ids or self.engine.stop_ids(self.opts),
                             seed=req.seed, row_ids=[max(req.id, 0) if req.stream is None else req.stream],
                             contribute=req.contribute, tenant=req.tenant,
                             prediction=None if self.prediction_cap is None else [req.prediction],
                             prediction_bucket=self.prediction_cap, constraint=req.pool_slot,
                             logit_bias=None if self.logit_bias is None else [req.logit_bias],
                             logit_bias_width=self.logit_bias)

    def placeholder(self, bucket: int) -> Inputs:
        """A one-token request done at its insert, contributing nothing: what an insert program at
        prompt bucket `bucket` compiles and warms on."""
        return self.inputs(_placeholder_request(), bucket)

    def placeholders(self, *, max_new: int) -> Inputs:
        """One-token rows for every slot: done at once with max_new 1 (the empty batch), still running
        with a large max_new and no stop ids (the calibration batch)."""
        return Inputs.create([[0]] * self.b, bucket=1, max_new_tokens=max_new, prediction_bucket=self.prediction_cap,
                             logit_bias_width=self.logit_bias)
