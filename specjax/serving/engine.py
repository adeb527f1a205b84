"""Host side of offline decoding: tokenizing, validation, bucketing, the compile cache, timing, streaming.

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
import json
import operator
import pathlib
import time
import warnings
from typing import Iterator, Sequence

import jax
import numpy as np
from flax import nnx

from specjax import memory, sharding, telemetry
from specjax.core import sampling
from specjax.methods.config import SpecConfig
from specjax.core.decoder import (MAX_STOP_IDS, RUN_TO_END, Decoder, Inputs, State, decode_program, new_tokens,
                                  prefill_program, window_of)
from specjax.core import decoder as core
from specjax.methods import registry
from specjax.methods.medusa.proposer import LoadedHeads, heads_tree
from specjax.core.sampling import Sampling
from specjax.core.tree import HEADS_TREE, validate_tree
from specjax.telemetry import SpecCounters

DEFAULT_BUCKETS = (32, 64, 128, 256, 512, 1024, 2048, 4096)


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
                    k=self.k, **self.counters.to_dict())


class Engine:
    """Decodes batches of prompts with one model; owns the compile cache.

    With `mesh=` (`specjax.sharding.make_mesh`) the target, draft and heads are placed on it by their
    logical axes and every program runs sharded (batch rows over `data`, tensor parallel over `model`);
    results are read back through one replicated view, so every process sees every row.

    Example:
      >>> eng = Engine.load("smollm2-135m")
      >>> eng.generate(["What is JAX?"], chat=True, max_new_tokens=32)[0].text
    """

    def __init__(self, model: nnx.Module, tokenizer=None, *, buckets: Sequence[int] = DEFAULT_BUCKETS,
                 name: str = "custom", draft: nnx.Module | None = None, draft_tokenizer=None,
                 heads: nnx.Module | None = None, weights_id: str | None = None, mesh=None):
        self.mesh = sharding.check_mesh(mesh)  # None: one device, today's programs unchanged
        model = sharding.place_module(model, self.mesh)  # params placed once, by their logical axes
        self.model = model
        self.config = model.config
        self.tokenizer = tokenizer
        self.name = name
        self.buckets = tuple(b for b in sorted(buckets) if b <= self.config.max_seq_len) or (
            self.config.max_seq_len,)
        self.graphdef, self.params = nnx.split(model)
        self.assets = registry.Assets(target=model, name=name, weights_id=weights_id)
        self._compiled: dict[tuple, object] = {}
        self.compile_count = 0
        self.compile_rss_bytes = 0  # what compiling `programs()` added to the process's resident set
        self.weights_id = weights_id
        if draft is not None:
            self.set_draft(draft, draft_tokenizer)
        if heads is not None:
            self.set_heads(heads)

    @classmethod
    def load(cls, name_or_path: str = "smollm2-135m", *, dtype: str = "float32",
             draft_model: str | None = None, heads: str | None = None, eagle: str | None = None,
             mesh=None, **kw) -> "Engine":
        """Loads a registry model, optionally a draft model with the same vocabulary and Medusa heads.

        Args:
          mesh: a `("data", "model")` mesh (`specjax.sharding.make_mesh("data=4,model=2")`) to run
            on: weights tensor-parallel over `model`, batch rows over `data`; None = one device.
          heads: a heads directory written by `specjax train-heads`, or "default" for the heads
            shipped with the model (`specjax.models.heads_io.shipped_heads_dir`).
          eagle: an EAGLE head directory (`specjax train-heads --kind eagle`), or "default" for the
            one shipped with the model.
        """
        from specjax.models import loader

        lm = loader.load(name_or_path, dtype=dtype)
        eng = cls(lm.model, lm.tokenizer, name=lm.config.name, weights_id=lm.weights_id, mesh=mesh, **kw)
        if draft_model is not None:
            d = loader.load(draft_model, dtype=dtype)
            eng.set_draft(d.model, d.tokenizer)
        if heads is not None:
            eng.load_heads(heads)
        if eagle is not None:
            eng.load_eagle(eagle)
        return eng

    def _shipped_or(self, path: str, find, none_is: str, kind_flag: str, flag: str) -> str | pathlib.Path:
        """`path`, or for "default" the directory shipped for this model (`find(name)`)."""
        if path != "default":
            return path
        found = find(self.name)
        if found is None:
            raise ValueError(f"{none_is} shipped for model {self.name!r}: train with `specjax train-heads "
                             f"{kind_flag}--model {self.name} --out DIR` and pass {flag} DIR")
        return found

    def load_eagle(self, path: str) -> None:
        """Loads an EAGLE head from a directory ("default": the one shipped for this model)."""
        from specjax.models import eagle_io

        path = self._shipped_or(path, eagle_io.shipped_eagle_dir, "no EAGLE head is", "--kind eagle ", "--eagle")
        head, ids, manifest = eagle_io.load_head(path, model_name=self.name, weights_id=self.weights_id)
        f = pathlib.Path(path) / "tuning.json"  # written by `specjax tune-heads --eagle`
        self.set_eagle(head, ids, manifest, tuning=json.loads(f.read_text()) if f.is_file() else None)

    def set_eagle(self, head: nnx.Module, draft_ids, manifest: dict | None = None,
                  tuning: dict | None = None) -> None:
        """Sets the EAGLE head (`specjax.models.eagle.EagleHead`) its method builds from, its draft
        vocabulary (token ids, most frequent first) and its tuned settings (`Engine.tuned`)."""
        from specjax.methods.eagle.proposer import EagleProposer

        ids = tuple(int(t) for t in np.asarray(draft_ids).ravel())
        EagleProposer.from_head(head, ids, self.model, k=1)  # raises if it does not fit the target
        head = sharding.place_module(head, self.mesh)
        self.assets.eagle = registry.LoadedEagle(module=head, ids=ids, manifest=dict(manifest or {}),
                                                 tuning=tuning)

    @property
    def eagle(self) -> "registry.LoadedEagle | None":
        return self.assets.eagle

    def load_asset(self, method: str, path: str = "default") -> None:
        """Loads `method`'s asset from `path` ("default": the one shipped for this model) through its
        record (`Record.load`)."""
        rec = registry.record(method)
        if rec.load is None:
            raise ValueError(f"method {method!r} loads no asset of its own")
        rec.load(self, path)

    def set_asset(self, method: str, asset) -> None:
        """Sets `method`'s own asset (what its record's `build` reads from `Assets.methods`)."""
        registry.record(method)
        self.assets.methods[method] = asset

    # ---- assets: what proposers are built from ----------------------------------------------
    @property
    def draft(self) -> nnx.Module | None:
        return self.assets.draft

    @property
    def heads(self) -> LoadedHeads | None:
        return self.assets.heads

    def load_heads(self, path: str) -> None:
        """Loads Medusa heads from a directory ("default": the ones shipped for this model)."""
        from specjax.models import heads_io

        path = self._shipped_or(path, heads_io.shipped_heads_dir, "no Medusa heads are", "", "--heads")
        heads, manifest = heads_io.load_heads(path, model_name=self.name, weights_id=self.weights_id)
        extra = heads_io.load_extras(path, heads.config.vocab_size)  # vocab.json, tree.json: checked
        self.set_heads(heads, manifest, vocab_subset=extra["vocab"], tree=extra["tree"])

    def set_heads(self, heads: nnx.Module, manifest: dict | None = None,
                  vocab_subset: Sequence[int] | np.ndarray | None = None,
                  tree: Sequence[Sequence[int]] | None = None) -> None:
        """Sets the Medusa heads (`specjax.models.heads.MedusaHeads`) their method builds from.

        Args:
          heads: the heads.
          manifest: their manifest (what they were trained for), kept for telemetry.
          vocab_subset: token ids the shared-LM-head heads may propose (the frequent tokens);
            None = the whole vocabulary. See `MedusaParams`.
          tree: the candidate tree tuned for these heads (`SpecConfig(tree="heads")`).
        """
        from specjax.methods import MedusaProposer

        vocab = None if vocab_subset is None else tuple(int(t) for t in np.asarray(vocab_subset).ravel())
        if tree is not None:
            tree = tuple(tuple(int(r) for r in p) for p in tree)
            validate_tree(tree)
        MedusaProposer.from_heads(heads, self.model, vocab_subset=vocab, tree=tree)  # raises if unfit
        heads = sharding.place_module(heads, self.mesh)
        self.assets.heads = LoadedHeads(module=heads, vocab=vocab, tree=tree, manifest=dict(manifest or {}))

    def set_draft(self, draft: nnx.Module, tokenizer=None) -> None:
        """Sets the draft model its method builds from; its vocabulary must be the target's."""
        dc = draft.config
        if dc.vocab_size != self.config.vocab_size:
            raise ValueError(
                f"draft model vocabulary ({dc.vocab_size} tokens) differs from the target's "
                f"({self.config.vocab_size}); a draft must share the target's tokenizer")
        if tokenizer is not None and self.tokenizer is not None:
            probe = "Hello, world! 12345 def f(x): return x"
            if tokenizer.encode(probe, add_bos=False) != self.tokenizer.encode(probe, add_bos=False):
                raise ValueError("draft model tokenizer encodes text differently from the target's; "
                                 "a draft must share the target's tokenizer")
        if draft.num_params > self.model.num_params:
            warnings.warn(f"draft model ({draft.num_params / 1e6:.0f}M params) is larger than its target "
                          f"({self.model.num_params / 1e6:.0f}M): speculation will be slower than plain")
        self.assets.draft = sharding.place_module(draft, self.mesh)

    def resolve(self, spec: SpecConfig) -> SpecConfig:
        """`spec` with `tree="heads"` replaced by the tree tuned for the loaded heads."""
        if spec.tree != HEADS_TREE:
            return spec
        return dataclasses.replace(spec, tree=heads_tree(self.heads))

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

    # ---- input handling ------------------------------------------------------------------------
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
            bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
            if bad:
                raise ValueError(f"prompt {i} has token ids {bad[:4]} outside [0, {self.config.vocab_size})")
            out.append(ids)
        return out

    def bucket_for(self, length: int) -> int:
        for b in self.buckets:
            if length <= b:
                return b
        raise ValueError(
            f"prompt of {length} tokens is longer than the largest bucket ({self.buckets[-1]}); "
            "shorten the prompt or pass larger `buckets=` (up to the model's max_seq_len "
            f"{self.config.max_seq_len})")

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
            if len(x) + opts.max_new_tokens > self.config.max_seq_len:
                raise ValueError(
                    f"prompt ({len(x)} tokens) + max_new_tokens ({opts.max_new_tokens}) exceeds the "
                    f"model's context of {self.config.max_seq_len}; lower max_new_tokens")
        n = len(ids)
        for name in ("temperature", "top_k", "top_p"):
            v = _values(getattr(opts, name))
            if len(v) not in (1, n):
                raise ValueError(f"{name} has {len(v)} values for {n} prompts: give one, or one per prompt")
        return ids

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
              cache_length: int | None = None, built: tuple | None = None) -> "Batch":
        """Validates, pads and compiles; returns a `Batch` ready to prefill and decode.

        Row r's random stream is `fold_in(key(opts.seed), row_offset + r)`. Every check runs before
        anything is compiled, so bad input fails fast. `built`: `proposer(spec)`'s result, reused.
        """
        batch_size = _positive_int("batch_size", batch_size, none_means="one row per prompt")
        ids = self.check(prompts, opts, chat=chat)
        b = batch_size or self.rows_for(len(ids))
        if len(ids) > b:
            raise ValueError(f"{len(ids)} prompts for batch_size={b}: split them (see generate)")
        sharding.check_batch(b, self.mesh)
        bucket = self.bucket_for(max(len(x) for x in ids))
        dec, pparams = self.build_decoder(spec, sampling=sampling_config or opts.sampling, cache_length=cache_length,
                                    prompt_bucket=bucket, max_new_tokens=opts.max_new_tokens, built=built)
        pick = lambda v: v if len(_values(v)) == 1 else list(v)
        inputs = Inputs.create(ids, bucket=bucket, batch_size=b, max_new_tokens=opts.max_new_tokens,
                               temperature=pick(opts.temperature), top_k=pick(opts.top_k),
                               top_p=pick(opts.top_p), stop_ids=self.stop_ids(opts), seed=opts.seed,
                               row_ids=range(row_offset, row_offset + b))
        inputs = sharding.place_inputs(inputs, self.mesh)
        pparams = sharding.place_pparams(pparams, self.mesh)
        return Batch(self, dec, pparams, inputs, n_real=len(ids), method=spec.method)

    def rows_for(self, n: int) -> int:
        """Rows of a batch for n prompts: n, rounded up to a multiple of the mesh's data axis."""
        dp = 1 if self.mesh is None else self.mesh.shape["data"]
        return -(-n // dp) * dp

    def generate(self, prompts: Sequence[str | Sequence[int]], *, chat: bool = False,
                 batch_size: int | None = None, spec: SpecConfig = SpecConfig(), **kw) -> list[Result]:
        """Generates for every prompt, in batches of `batch_size` (default: all at once).

        Args:
          prompts: strings (tokenized here) or lists of token ids.
          chat: wrap each string prompt in the model's chat template as a user turn.
          batch_size: rows per compiled batch; the last batch is padded. On a mesh it must be a
            multiple of the `data` axis (default: the prompts, padded up to one).
          spec: speculation method and K (`SpecConfig`); the default is the plain loop.
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
        sharding.check_batch(batch_size or self.rows_for(b), self.mesh)
        built = self.proposer(spec)  # validates the method (heads present, k in range, ...), once per call
        results: list[Result] = []
        for i in range(0, len(ids), b):
            sub = dataclasses.replace(opts, **{
                n: tuple(_values(getattr(opts, n))[i:i + b]) for n in ("temperature", "top_k", "top_p")
                if len(_values(getattr(opts, n))) > 1})
            results.extend(self.start(ids[i:i + b], sub, batch_size=batch_size and b,  # ids: not again
                                      spec=spec, row_offset=i, built=built).run())
        return results


class Batch:
    """One fixed-shape batch: prefill, then decode to the end or in streaming chunks."""

    def __init__(self, engine: Engine, decoder: Decoder, pparams, inputs: Inputs, *, n_real: int,
                 method: str = "none"):
        self.engine, self.decoder, self.pparams, self.inputs = engine, decoder, pparams, inputs
        self.n_real, self.method = n_real, method
        self.compile_s = 0.0
        self._prefill = self._compile(prefill_program, pparams, inputs)
        abstract = jax.eval_shape(lambda *a: prefill_program(*a, static=decoder),
                                  engine.graphdef, engine.params, pparams, inputs)
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
        self.state = jax.block_until_ready(self._prefill(self.engine.params, self.pparams, self.inputs))
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
        return [Result(tokens=toks, text=tok.decode(toks, skip_special=True) if tok else "",
                       target_forwards=int(fwd[r]), ttft_s=self.ttft_s, wall_s=self.ttft_s + self.decode_s,
                       compile_s=self.compile_s, stop_reason=telemetry.stop_reason(toks, stops[r], max_new[r]),
                       method=self.method, k=k, counters=SpecCounters.from_stats(stats, r))
                for r, toks in enumerate(self.new_tokens())]
