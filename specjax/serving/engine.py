"""Host side of offline decoding: the methods' assets, the compile cache, decoders and batches; its text
side (tokenizing, validation, bucketing) is `specjax.serving.prompts.Prompts`.

The Engine decides nothing about decoding itself: it builds a `specjax.Decoder` (proposer from the
registry, acceptance rule, sampling method, cache length from `decoder.cache_length`) and `Inputs`
(per-row arrays, keys from the seed and each row's global index), and runs the jitted programs of
`specjax.core.decoder`. Programs are compiled ahead of time (`jit(...).lower(...).compile()`) and kept in
a cache keyed by everything that shapes them: the program, the `Decoder`, and the tree structure,
shapes, dtypes and shardings of the arguments. Everything else is an array, so a second prompt in
the same bucket reuses the program.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import jax
from flax import nnx

from specjax import constrain, memory, sharding
from specjax.core import decoder as core
from specjax.core.constraint import PoolSpec
from specjax.core.decoder import Decoder, Inputs, window_of
from specjax.core.logprobs import check_top
from specjax.core.sampling import Sampling
from specjax.methods import registry
from specjax.methods.config import SpecConfig
from specjax.methods.predict.options import prediction_cap
from specjax.serving.batch import (Batch, GenerateOptions, Result, _positive_int, _prompt_list,  # noqa: F401 (re-exported)
                                   _values)
from specjax.serving.prompts import Prompts

DEFAULT_BUCKETS = (32, 64, 128, 256, 512, 1024, 2048, 4096)


class Engine:
    """Decodes batches of prompts with one model; owns the compile cache.

    With `mesh=` (`specjax.sharding.make_mesh`) the target and the methods' assets are placed on it by
    their logical axes and every program runs sharded (batch rows over `data`, tensor parallel over `model`);
    results are read back through one replicated view, so every process sees every row.

    Its text side, `encode`, `encode_predictions`, `check`, `bucket_for`, `stop_ids`, `logit_biases` and
    `constraint_for`, are the methods of `self.prompts` (`specjax.serving.prompts.Prompts`).

    Example:
      >>> eng = Engine.load("smollm2-135m")
      >>> eng.generate(["What is JAX?"], chat=True, max_new_tokens=32)[0].text
    """

    def __init__(self, model: nnx.Module, tokenizer=None, *, buckets: Sequence[int] = DEFAULT_BUCKETS,
                 name: str = "custom", weights_id: str | None = None, mesh=None, assets: dict | None = None):
        self.mesh = sharding.check_mesh(mesh)  # None: one device, today's programs unchanged
        model = sharding.place_module(model, self.mesh)  # params placed once, by their logical axes
        self.model = model
        self.config = model.config
        self.name = name
        # the text side (`specjax.serving.prompts`): tokenizing and checking every request's input
        self.prompts = p = Prompts(tokenizer, vocab=self.config.vocab_size, max_seq_len=self.config.max_seq_len,
                                   buckets=buckets)
        self.buckets, self.encode, self.encode_predictions, self.logit_biases = (
            p.buckets, p.encode, p.encode_predictions, p.logit_biases)
        self.check, self.bucket_for, self.stop_ids, self.constraint_for = p.check, p.bucket_for, p.stop_ids, p.constraint_for
        self.graphdef, self.params = nnx.split(model)
        self.assets = registry.Assets(target=model, name=name, weights_id=weights_id)
        self._compiled: dict[tuple, object] = {}
        self.compile_count = 0
        self.compile_rss_bytes = 0  # what compiling `programs()` added to the process's resident set
        self.weights_id = weights_id
        for method, asset in (assets or {}).items():  # {method: its asset}, e.g. {"medusa": LoadedHeads(...)}
            self.set_asset(method, asset)

    @classmethod
    def load(cls, name_or_path: str = "smollm2-135m", *, dtype: str = "float32",
             assets: dict[str, str] | None = None, mesh=None, weights_arith: str = "exact", **kw) -> "Engine":
        """Loads a registry model, and the assets of some methods through their records.

        Args:
          dtype: the compute dtype ("float32", "bfloat16"); a draft model loads in it too.
          assets: {method: what its record loads}, e.g. {"medusa": "default"} (the heads shipped
            for the model), {"eagle": DIR} (`specjax train-heads --kind eagle`), {"draft": NAME}.
          mesh: a `("data", "model")` mesh (`specjax.sharding.make_mesh("data=4,model=2")`) to run
            on: weights tensor-parallel over `model`, batch rows over `data`; None = one device.
          weights_arith: "exact" (HF's numbers) or "q8" (llama.cpp's arithmetic for GGUF weights kept
            packed; `specjax.models.loader.load`).
        """
        from specjax.models import loader

        lm = loader.load(name_or_path, dtype=dtype, weights_arith=weights_arith)
        eng = cls(lm.model, lm.tokenizer, name=lm.config.name, weights_id=lm.weights_id, mesh=mesh, **kw)
        for method, path in (assets or {}).items():
            eng.load_asset(method, path)
        return eng

    # ---- assets: what proposers are built from, each through its method's record ----------------
    def load_asset(self, method: str, path: str = "default") -> None:
        """Loads `method`'s asset from `path` ("default": the one shipped for this model) through its
        record (`Record.load`) and sets it (`set_asset`); a record that finds nothing to load (no
        warm start shipped) leaves the method without one."""
        rec = registry.record(method)
        if rec.load is None:
            raise ValueError(f"method {method!r} loads no asset of its own")
        asset = rec.load(self, path)
        if asset is not None:
            self.set_asset(method, asset)

    def set_asset(self, method: str, asset) -> None:
        """Sets `method`'s asset (what its record's `build` reads from `Assets.methods`), checked
        against the target and placed on the mesh by its record (`Record.fit`)."""
        rec = registry.record(method)
        self.assets.methods[method] = asset if rec.fit is None else rec.fit(asset, self)

    def asset(self, method: str):
        """`method`'s loaded asset, or None."""
        return self.assets.methods.get(method)

    def asset_modules(self) -> list:
        """The weights the loaded assets hold, each with whether it keeps a KV cache of its own (a
        draft model): what `specjax.sharding.memory_report` plans beside the target."""
        return registry.modules(self.assets)

    def resolve(self, spec: SpecConfig) -> SpecConfig:
        """`spec` with what it names in the loaded assets filled in (`Record.resolve`: Medusa's
        `tree="heads"`, the tree tuned for the loaded heads)."""
        return registry.resolve(spec, self.assets)

    def tuned(self, method: str, *, tree: bool = False, **overrides) -> SpecConfig:
        """The `SpecConfig` tuned for the loaded assets of `method` on their machine (its chain, or
        with `tree` its tree; see its record's `tuned`); `overrides` (not None) replace tuned fields."""
        fields = registry.tuned(method, self.assets, tree=tree)
        if fields is None:
            raise ValueError(f"method {method!r} has no tuned settings: give its options")
        fields.update({k: v for k, v in overrides.items() if v is not None})
        return SpecConfig.make(method, **fields)

    # ---- decoders ------------------------------------------------------------------------------
    def proposer(self, spec: SpecConfig):
        """The static proposer and its params for `spec` ((None, None) for plain decoding)."""
        return registry.build(spec, self.assets)

    def build_decoder(self, spec: SpecConfig, *, sampling: Sampling | str = "greedy",
                cache_length: int | None = None, prompt_bucket: int | None = None,
                max_new_tokens: int | None = None, headroom: int = 0, built: tuple | None = None):
        """The `Decoder` for `spec` and its proposer params.

        Give `cache_length`, or `prompt_bucket` and `max_new_tokens` to size it with
        `specjax.core.decoder.cache_length` (`headroom`: a wider window that shares this cache). `built`: the
        `(proposer, params)` that `proposer(spec)` returned, to build them once per call.
        """
        proposer, pparams = self.proposer(spec) if built is None else built
        if cache_length is None:
            window = 1 if proposer is None else window_of(proposer)
            cache_length = core.cache_length(prompt_bucket, max_new_tokens, max(window, headroom))
        dec = Decoder(cache_length=cache_length, proposer=proposer, sampling=sampling,
                      acceptance=registry.acceptance_rule(spec) if proposer is not None else None, mesh=self.mesh)
        return dec, pparams

    @property
    def tokenizer(self):
        """The model's tokenizer (None: token ids only); `prompts` reads it."""
        return self.prompts.tokenizer

    @tokenizer.setter
    def tokenizer(self, tokenizer) -> None:
        self.prompts.tokenizer = tokenizer

    # ---- compile cache -------------------------------------------------------------------------
    def program(self, fn, decoder, *args, weights: bool = True, **statics):
        """The compiled `fn(graphdef, params, *args, static=decoder, **statics)` and the seconds spent
        compiling it now (0 when cached). `weights=False`: `fn(*args, **statics)`, a program that
        reads no weights (a slot operation); call it without them."""
        leaves, treedef = jax.tree.flatten(args)
        key = (fn, decoder, weights, tuple(sorted(statics.items())), treedef,
               tuple((x.shape, x.dtype, getattr(x, "sharding", None)) for x in leaves))
        if key in self._compiled:
            return self._compiled[key], 0.0
        t0, rss0 = time.perf_counter(), memory.rss_bytes()
        kw = dict(statics) if decoder is None else dict(statics, static=decoder)
        model = (self.graphdef, self.params) if weights else ()
        self._compiled[key] = fn.lower(*model, *args, **kw).compile()  # the decoder traces for its mesh
        self.compile_count += 1
        self.compile_rss_bytes += memory.rss_bytes() - rss0
        return self._compiled[key], time.perf_counter() - t0

    def programs(self) -> list:
        """The compiled programs this engine keeps (`program`'s cache)."""
        return list(self._compiled.values())

    # ---- generation ----------------------------------------------------------------------------
    def start(self, prompts: Sequence[str | Sequence[int]], opts: GenerateOptions, *,
              chat: bool = False, batch_size: int | None = None, spec: SpecConfig = SpecConfig(),
              sampling_config: Sampling | None = None, row_offset: int = 0,
              cache_length: int | None = None, built: tuple | None = None,
              prediction: Sequence | None = None, constraint: constrain.TokenTables | None = None,
              logit_bias: Sequence | None = None, logprobs: int | None = None) -> "Batch":
        """Validates, pads and compiles; returns a `Batch` ready to prefill and decode.

        Row r's random stream is `fold_in(key(opts.seed), row_offset + r)`. Every check runs before
        anything is compiled, so bad input fails fast. `built`: `proposer(spec)`'s result, reused.
        `prediction`: each prompt's predicted output (see `generate`). `constraint`: the tables every
        row's answer follows (`constraint_for`), or None. `logit_bias`: each prompt's (see `generate`).
        `logprobs`: top alternatives recorded per token (see `generate`).
        """
        batch_size = _positive_int("batch_size", batch_size, none_means="one row per prompt")
        ids = self.check(prompts, opts, chat=chat)
        b = batch_size or self.rows_for(len(ids))
        if len(ids) > b:
            raise ValueError(f"{len(ids)} prompts for batch_size={b}: split them (see generate)")
        sharding.check_batch(b, self.mesh)
        bucket = self.bucket_for(max(len(x) for x in ids))
        predicted = self.encode_predictions(prediction, len(ids))
        cap = prediction_cap([spec])
        if predicted is not None and cap is not None and max(len(p or ()) for p in predicted) > cap:
            raise ValueError(f"a prediction of {max(len(p or ()) for p in predicted)} tokens exceeds "
                             f"prediction_cap={cap}: shorten it, or raise the cap "
                             "(SpecConfig.make('predict', prediction_cap=N), --prediction-cap N)")
        dec, pparams = self.build_decoder(spec, sampling=sampling_config or opts.sampling, cache_length=cache_length,
                                    prompt_bucket=bucket, max_new_tokens=opts.max_new_tokens, built=built)
        if constraint is not None or dec.constraints is not None:  # a pool of one, sized to the constraint
            dec = dataclasses.replace(dec, constraints=self.pool_for(constraint))  # merged with a proposer's
        if logprobs is not None:
            dec = dataclasses.replace(dec, logprobs=logprobs)  # checked by the Decoder
        if constraint is not None and not self.stop_ids(opts):
            raise ValueError("a constrained answer needs a stop token to end it: give stop_ids (the model's EOS)")
        pick = lambda v: v if len(_values(v)) == 1 else list(v)
        biases = self.logit_biases(logit_bias, len(ids))
        inputs = Inputs.create(ids, bucket=bucket, batch_size=b, max_new_tokens=opts.max_new_tokens,
                               temperature=pick(opts.temperature), top_k=pick(opts.top_k),
                               top_p=pick(opts.top_p), stop_ids=self.stop_ids(opts), seed=opts.seed,
                               row_ids=range(row_offset, row_offset + b),
                               prediction=predicted if cap is not None else None, prediction_bucket=cap,
                               constraint=[int(constraint is not None)] * len(ids), logit_bias=biases,
                               logit_bias_width=None if biases is None else core.round_up_pow2(
                                   max(1, *(len(x or ()) for x in biases))))
        inputs = sharding.place_inputs(inputs, self.mesh)
        pparams = sharding.place_pparams(pparams, self.mesh)
        parts = core.constraint_parts(dec, () if constraint is None else (constraint,), inputs)
        return Batch(self, dec, pparams, inputs, n_real=len(ids), method=spec.method, predictions=predicted,
                     parts=parts, constraint=constraint)

    def pool_for(self, tables) -> PoolSpec:
        """A pool of one constraint slot sized to `tables` (rounded up to powers of two, so constraints
        of similar sizes share programs); the smallest pool for None."""
        s, c = (1, 1) if tables is None else tables.next_state.shape
        return PoolSpec(vocab=self.model.config.vocab_size, capacity=1, states=core.round_up_pow2(s),
                        classes=core.round_up_pow2(c))

    def rows_for(self, n: int) -> int:
        """Rows of a batch for n prompts: n, rounded up to a multiple of the mesh's data axis."""
        dp = 1 if self.mesh is None else self.mesh.shape["data"]
        return -(-n // dp) * dp

    def generate(self, prompts: Sequence[str | Sequence[int]], *, chat: bool = False,
                 batch_size: int | None = None, spec: SpecConfig = SpecConfig(),
                 prediction: Sequence | None = None, response_format: dict | None = None,
                 regex: str | None = None, choice: Sequence[str] | None = None,
                 logit_bias: dict | Sequence | None = None, logprobs: int | None = None, **kw) -> list[Result]:
        """Generates for every prompt, in batches of `batch_size` (default: all at once).

        Args:
          prompts: strings (tokenized here) or lists of token ids.
          chat: wrap each string prompt in the model's chat template as a user turn.
          batch_size: rows per compiled batch; the last batch is padded. On a mesh it must be a
            multiple of the `data` axis (default: the prompts, padded up to one).
          spec: speculation method and K (`SpecConfig`); the default is the plain loop.
          prediction: each prompt's predicted output (OpenAI's Predicted Outputs): a string, token ids
            or None, one per prompt. Method "predict" drafts from it; it never changes the answer.
            Each result reports the prediction tokens the answer used (`Result.prediction`).
          response_format, regex, choice: a constraint every answer follows, inside the loop (one of
            them): OpenAI's `{"type": "json_schema", "json_schema": {"schema": {...}}}` or
            `{"type": "json_object"}` (compact JSON), a regular expression the whole answer matches,
            or a list of strings the answer is one of. The answer ends at a stop token once complete.
          logit_bias: OpenAI's logit_bias (token id -> a value in [-100, 100], added to the target's
            logits at every position, speculative ones included), one map for every prompt or one
            per prompt (None for none).
          logprobs: record each generated token's log-probability under the target (before
            logit_bias, a constraint and temperature) and the `logprobs` most likely tokens at its
            position, 0..20 (`Result.logprobs`); None records nothing.
          **kw: `GenerateOptions` fields: max_new_tokens, temperature, top_k, top_p (one value or one
            per prompt), seed, stop_ids. Prompt i draws the random stream of global row i.
        """
        opts = GenerateOptions(**kw)
        prompts = _prompt_list(prompts)
        batch_size = _positive_int("batch_size", batch_size, none_means="all prompts in one batch")
        if not prompts:
            raise ValueError("no prompts given")
        b = batch_size or len(prompts)
        ids = self.check(prompts, opts, chat=chat)  # every prompt tokenized once, validated before compiling
        predicted = self.encode_predictions(prediction, len(ids))
        constraint = self.constraint_for(response_format=response_format, regex=regex, choice=choice)
        biases = self.logit_biases(logit_bias, len(ids))
        logprobs = None if logprobs is None else check_top(logprobs, "logprobs")
        sharding.check_batch(batch_size or self.rows_for(b), self.mesh)
        built = self.proposer(spec)  # validates the method (heads present, k in range, ...), once per call
        results: list[Result] = []
        for i in range(0, len(ids), b):
            sub = dataclasses.replace(opts, **{
                n: tuple(_values(getattr(opts, n))[i:i + b]) for n in ("temperature", "top_k", "top_p")
                if len(_values(getattr(opts, n))) > 1})
            results.extend(self.start(ids[i:i + b], sub, batch_size=batch_size and b,  # ids: not again
                                      spec=spec, row_offset=i, built=built,
                                      prediction=None if predicted is None else predicted[i:i + b],
                                      constraint=constraint,
                                      logit_bias=None if biases is None else biases[i:i + b],
                                      logprobs=logprobs).run())
        return results
