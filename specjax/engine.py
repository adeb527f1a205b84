"""Host side of decoding: validation, bucketing, compile cache, timing, streaming.

Everything that shapes a program (batch size, prompt bucket, cache length, sampling method)
is a key of the compile cache; everything else (prompt lengths, max_new_tokens, temperature,
top-k, top-p, seed) is an array, so a second prompt in the same bucket reuses the program.
Programs are compiled ahead of time (`jit(...).lower(...).compile()`), which is how compile
time is reported apart from generation time.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
import time
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax import decode, sampling, speculative
from specjax.config import SpecConfig
from specjax.config import HEADS_TREE, chain
from specjax.proposers import DraftModelProposer, MedusaProposer, NgramProposer
from specjax.sampling import SamplingConfig, SamplingParams
from specjax.speculative import SpecState, SpecStats
from specjax.state import DecodeState

DEFAULT_BUCKETS = (32, 64, 128, 256, 512, 1024, 2048, 4096)
MAX_STOP_IDS = 8


@dataclasses.dataclass(frozen=True, kw_only=True)
class GenerateOptions:
    """Per-call values; none of them changes a compiled program's shape except through buckets."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop_ids: tuple[int, ...] | None = None  # default: the tokenizer's stop tokens

    def validate(self) -> None:
        if int(self.max_new_tokens) != self.max_new_tokens or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens}: must be an integer >= 1")
        sampling.validate(self.temperature, self.top_k, self.top_p)
        if self.stop_ids is not None and len(self.stop_ids) > MAX_STOP_IDS:
            raise ValueError(f"{len(self.stop_ids)} stop tokens: at most {MAX_STOP_IDS} are supported")


@dataclasses.dataclass
class Result:
    """One prompt's generation. Rows of one batch share the batch's times."""

    tokens: list[int]  # generated ids, the stop token included when one ended the row
    text: str
    new_tokens: int
    target_forwards: int  # target forward passes after prefill while the row was active
    ttft_s: float
    wall_s: float  # generation time, compile excluded
    compile_s: float
    stop_reason: str  # "stop_token" | "max_new_tokens" | "cache_full"
    extra: dict = dataclasses.field(default_factory=dict)

    @property
    def tok_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else float("nan")


def round_up_pow2(n: int, minimum: int = 16) -> int:
    return max(minimum, 1 << (int(n) - 1).bit_length())


@functools.partial(
    jax.jit, static_argnames=("graphdef", "sampling_config", "cache_length", "window")
)
def _prefill(graphdef, params, prompts, prompt_lengths, max_new, sp, stop_ids, keys, *,
             sampling_config, cache_length, window):
    model = nnx.merge(graphdef, params)
    return decode.prefill(model, sampling_config, prompts, prompt_lengths, max_new, sp,
                          stop_ids, keys, cache_length, window)[0]


@functools.partial(jax.jit, static_argnames=("graphdef", "sampling_config"), donate_argnames=("state",))
def _plain_loop(graphdef, params, state, stop_at, *, sampling_config):
    model = nnx.merge(graphdef, params)
    return decode.plain_loop(model, sampling_config, state, stop_at)


@functools.partial(
    jax.jit,
    static_argnames=("graphdef", "proposer", "sampling_config", "cache_length", "window"),
)
def _spec_prefill(graphdef, params, pparams, prompts, prompt_lengths, max_new, sp, stop_ids, keys,
                  *, proposer, sampling_config, cache_length, window):
    model = nnx.merge(graphdef, params)
    state, hidden = decode.prefill(model, sampling_config, prompts, prompt_lengths, max_new, sp,
                                   stop_ids, keys, cache_length, window)
    pstate = proposer.init(pparams, state, prompts, hidden)
    return SpecState(decode=state, proposer=pstate, stats=SpecStats.zeros(prompts.shape[0], proposer.k))


@functools.partial(jax.jit, static_argnames=("graphdef", "proposer", "sampling_config"),
                   donate_argnames=("state",))
def _spec_loop(graphdef, params, pparams, state, stop_at, *, proposer, sampling_config):
    model = nnx.merge(graphdef, params)
    return speculative.spec_loop(model, proposer, pparams, sampling_config, state, stop_at)


class Engine:
    """Decodes batches of prompts with one model; owns the compile cache.

    Example:
      >>> eng = Engine.load("smollm2-135m")
      >>> eng.generate(["What is JAX?"], chat=True, max_new_tokens=32)[0].text
    """

    def __init__(self, model: nnx.Module, tokenizer=None, *, buckets: Sequence[int] = DEFAULT_BUCKETS,
                 name: str = "custom", draft: nnx.Module | None = None, draft_tokenizer=None,
                 heads: nnx.Module | None = None, weights_id: str | None = None):
        self.model = model
        self.config = model.config
        self.tokenizer = tokenizer
        self.name = name
        self.buckets = tuple(b for b in sorted(buckets) if b <= self.config.max_seq_len) or (
            self.config.max_seq_len,)
        self.graphdef, self.params = nnx.split(model)
        self._compiled: dict[tuple, object] = {}
        self.compile_count = 0
        self.weights_id = weights_id
        self.draft = None
        self.heads = None
        self.heads_manifest: dict = {}
        self.heads_vocab = None
        self.heads_tree = None
        if draft is not None:
            self.set_draft(draft, draft_tokenizer)
        if heads is not None:
            self.set_heads(heads)

    @classmethod
    def load(cls, name_or_path: str = "smollm2-135m", *, dtype: str = "float32",
             draft_model: str | None = None, heads: str | None = None, **kw) -> "Engine":
        """Loads a registry model, optionally a draft model with the same vocabulary and Medusa heads.

        Args:
          heads: a heads directory written by `specjax train-heads`, or "default" for the heads
            shipped with the model (`specjax.train_heads.checkpoint.shipped_heads_dir`).
        """
        from specjax.models import loader

        lm = loader.load(name_or_path, dtype=dtype)
        eng = cls(lm.model, lm.tokenizer, name=lm.config.name, weights_id=lm.weights_id, **kw)
        if draft_model is not None:
            d = loader.load(draft_model, dtype=dtype)
            eng.set_draft(d.model, d.tokenizer)
        if heads is not None:
            eng.load_heads(heads)
        return eng

    def load_heads(self, path: str) -> None:
        """Loads Medusa heads from a directory ("default": the ones shipped for this model)."""
        from specjax.train_heads import checkpoint

        if path == "default":
            found = checkpoint.shipped_heads_dir(self.name)
            if found is None:
                raise ValueError(f"no Medusa heads are shipped for model {self.name!r}: train some with "
                                 f"`specjax train-heads --model {self.name} --out DIR` and pass --heads DIR")
            path = found
        heads, manifest = checkpoint.load_heads(path, model_name=self.name, weights_id=self.weights_id)
        extra = {}
        for name in ("vocab", "tree"):  # optional, written by `specjax.train_heads.tune`
            f = pathlib.Path(path) / f"{name}.json"
            if f.is_file():
                extra[name] = json.loads(f.read_text())
        self.set_heads(heads, manifest, vocab_subset=extra.get("vocab"), tree=extra.get("tree"))

    def set_heads(self, heads: nnx.Module, manifest: dict | None = None,
                  vocab_subset: Sequence[int] | np.ndarray | None = None,
                  tree: Sequence[Sequence[int]] | None = None) -> None:
        """Sets the Medusa heads of `method="medusa"` (`specjax.train_heads.heads.MedusaHeads`).

        Args:
          heads: the heads.
          manifest: their manifest (what they were trained for), kept for telemetry.
          vocab_subset: token ids the shared-LM-head heads may propose (the frequent tokens);
            None = the whole vocabulary. See `MedusaProposer`.
          tree: the candidate tree tuned for these heads (`SpecConfig(tree="heads")`).
        """
        hc = heads.config
        if hc.dim != self.config.dim or hc.vocab_size != self.config.vocab_size:
            raise ValueError(
                f"Medusa heads are for dim {hc.dim} / vocab {hc.vocab_size}, the model has dim "
                f"{self.config.dim} / vocab {self.config.vocab_size}: train heads for this model")
        ids = None
        if vocab_subset is not None:
            ids = np.asarray(vocab_subset, np.int64)
            if ids.ndim != 1 or ids.size == 0 or ids.min() < 0 or ids.max() >= self.config.vocab_size:
                raise ValueError(f"vocab_subset must be a non-empty list of token ids in "
                                 f"[0, {self.config.vocab_size})")
            ids = jnp.asarray(ids, jnp.int32)
        self.heads = nnx.split(heads)
        self.heads_config = hc
        self.heads_manifest = dict(manifest or {})
        self.heads_vocab = ids
        self.heads_tree = None
        if tree is not None:
            self.heads_tree = SpecConfig(method="medusa", tree=tuple(tuple(p) for p in tree)).tree
            if max(len(p) for p in self.heads_tree) > hc.num_heads:
                raise ValueError(f"the heads' tree is deeper than their {hc.num_heads} heads")

    def resolve(self, spec: SpecConfig) -> SpecConfig:
        """`spec` with `tree="heads"` replaced by the tree tuned for the loaded heads."""
        if spec.tree != HEADS_TREE:
            return spec
        if self.heads is None or self.heads_tree is None:
            raise ValueError('tree="heads" needs heads that carry a tuned tree (tree.json beside them); '
                             "name a tree (chain4, small, medium) or give --k")
        return dataclasses.replace(spec, tree=self.heads_tree)

    def set_draft(self, draft: nnx.Module, tokenizer=None) -> None:
        """Sets the draft model of `method="draft"`; its vocabulary must be the target's."""
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
        if dc.num_params > self.config.num_params:
            import warnings

            warnings.warn(f"draft model ({dc.num_params / 1e6:.0f}M params) is larger than its target "
                          f"({self.config.num_params / 1e6:.0f}M): speculation will be slower than plain")
        self.draft = nnx.split(draft)

    def proposer(self, spec: SpecConfig):
        """The static proposer and its traced parameters for `spec`."""
        spec = self.resolve(spec)
        if spec.method == "ngram":
            return NgramProposer(k=spec.k, min_n=spec.ngram_min, max_n=spec.ngram_max), None
        if spec.method == "draft":
            if self.draft is None:
                raise ValueError("method 'draft' needs a draft model: Engine.load(..., draft_model=NAME) "
                                 "or --draft-model NAME")
            graphdef, params = self.draft
            return DraftModelProposer(k=spec.k, graphdef=graphdef), params
        if spec.method == "medusa":
            return self._medusa(spec)
        raise ValueError(f"method {spec.method!r} has no proposer")

    def _medusa(self, spec: SpecConfig):
        if self.heads is None:
            raise ValueError("method 'medusa' needs Medusa heads: Engine.load(..., heads='default' or DIR) "
                             "or --heads DIR")
        graphdef, params = self.heads
        m = self.heads_config.num_heads
        if spec.k > m:
            raise ValueError(f"medusa k={spec.k} (or tree depth) exceeds the {m} trained heads: use k <= {m}")
        ids = None if self.heads_config.own_projection else self.heads_vocab  # own projections: all tokens
        tree = spec.tree if spec.tree is not None else (chain(spec.k) if spec.typical else None)
        if tree is not None:
            ranks = 1 + max(p[-1] for p in tree)
            limit = self.config.vocab_size if ids is None else len(ids)
            if ranks > limit:
                raise ValueError(f"tree uses rank {ranks - 1}, beyond the {limit} tokens the heads can propose")
        tied = self.config.tie_embeddings
        weight = self.model.embed[...] if tied else self.model.lm_head[...]
        if ids is not None:
            weight = weight[ids] if tied else weight[:, ids]
        proposer = MedusaProposer(k=spec.k, graphdef=graphdef, tied=tied, tree=tree, typical=spec.typical)
        return proposer, (params, weight, ids, self.model.embed[...])

    # ---- input handling ------------------------------------------------------------------
    def encode(self, prompts: Sequence[str | Sequence[int]], *, chat: bool = False) -> list[list[int]]:
        """Token ids for each prompt (strings are tokenized, with the chat template if asked)."""
        out = []
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                if self.tokenizer is None:
                    raise ValueError("this Engine has no tokenizer: pass token ids, not strings")
                if chat:
                    p = self.tokenizer.apply_chat_template([{"role": "user", "content": p}])
                    ids = self.tokenizer.encode(p, add_bos=False)
                else:
                    ids = self.tokenizer.encode(p)
            else:
                ids = [int(t) for t in p]
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
            f"{self.config.max_seq_len})"
        )

    def _stop_ids(self, opts: GenerateOptions) -> tuple[int, ...]:
        if opts.stop_ids is not None:
            return tuple(opts.stop_ids)
        return tuple(getattr(self.tokenizer, "stop_ids", ()) or ())

    # ---- compile cache -------------------------------------------------------------------
    def _program(self, kind: str, fn, statics: dict, *args):
        """The compiled program and the seconds spent compiling it now (0 when cached)."""
        key = (kind, tuple(sorted(statics.items())),
               tuple((x.shape, x.dtype) for x in jax.tree.leaves(args)))
        if key in self._compiled:
            return self._compiled[key], 0.0
        t0 = time.perf_counter()
        self._compiled[key] = fn.lower(self.graphdef, self.params, *args, **statics).compile()
        self.compile_count += 1
        return self._compiled[key], time.perf_counter() - t0

    # ---- generation ----------------------------------------------------------------------
    def start(self, prompts: Sequence[str | Sequence[int]], opts: GenerateOptions, *,
              chat: bool = False, batch_size: int | None = None, spec: SpecConfig = SpecConfig(),
              sampling_config: SamplingConfig | None = None):
        """Validates, pads and compiles; returns a `Batch` ready to prefill and decode.

        Every check runs before anything is compiled, so bad input fails fast.
        """
        ids = self.check(prompts, opts, chat=chat)
        spec = self.resolve(spec)
        window = spec.window
        proposer = self.proposer(spec) if spec.method != "none" else None
        b = batch_size or len(ids)
        if len(ids) > b:
            raise ValueError(f"{len(ids)} prompts for batch_size={b}: split them (see generate)")
        longest = max(len(x) for x in ids)
        p = self.bucket_for(longest)
        s = p + round_up_pow2(opts.max_new_tokens) + window
        stops = self._stop_ids(opts)
        rows = ids + [ids[0]] * (b - len(ids))  # pad rows: finish after their first token
        prompts_np = np.zeros((b, p), np.int32)
        for r, x in enumerate(rows):
            prompts_np[r, : len(x)] = x
        stop_np = np.full((b, MAX_STOP_IDS), -1, np.int32)
        stop_np[:, : len(stops)] = stops
        max_new = np.array([opts.max_new_tokens] * len(ids) + [1] * (b - len(ids)), np.int32)
        sc = sampling_config or SamplingConfig(method="sample" if opts.temperature > 0 else "greedy")
        args = (
            jnp.asarray(prompts_np), jnp.asarray([len(x) for x in rows], jnp.int32),
            jnp.asarray(max_new), SamplingParams.create(b, opts.temperature, opts.top_k, opts.top_p),
            jnp.asarray(stop_np), jax.random.split(jax.random.key(opts.seed), b),
        )
        return Batch(self, args, n_real=len(ids), sampling_config=sc, cache_length=s, window=window,
                     spec=spec, proposer=proposer)

    def generate(self, prompts: Sequence[str | Sequence[int]], *, chat: bool = False,
                 batch_size: int | None = None, spec: SpecConfig = SpecConfig(), **kw) -> list[Result]:
        """Generates for every prompt, in batches of `batch_size` (default: all at once).

        Args:
          prompts: strings (tokenized here) or lists of token ids.
          chat: wrap each string prompt in the model's chat template as a user turn.
          batch_size: rows per compiled batch; the last batch is padded.
          spec: speculation method and K (`SpecConfig`); the default is the plain loop.
          **kw: `GenerateOptions` fields: max_new_tokens, temperature, top_k, top_p, seed, stop_ids.
        """
        opts = GenerateOptions(**kw)
        prompts = list(prompts)
        if not prompts:
            raise ValueError("no prompts given")
        b = batch_size or len(prompts)
        self.check(prompts, opts, chat=chat)  # every prompt is validated before anything compiles
        spec = self.resolve(spec)
        if spec.method != "none":
            self.proposer(spec)  # and the speculation method (heads present, k in range, ...)
        results: list[Result] = []
        for i in range(0, len(prompts), b):
            results.extend(self.start(prompts[i:i + b], opts, chat=chat, batch_size=b, spec=spec).run())
        return results

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
        return ids


class Batch:
    """One fixed-shape batch: prefill, then decode to the end or in streaming chunks."""

    def __init__(self, engine: Engine, args, *, n_real, sampling_config, cache_length, window,
                 spec: SpecConfig, proposer=None):
        self.engine, self.n_real, self.spec = engine, n_real, spec
        self.compile_s = 0.0
        statics = dict(sampling_config=sampling_config, cache_length=cache_length, window=window)
        loop_statics = dict(sampling_config=sampling_config)
        prefill_fn, loop_fn = _prefill, _plain_loop
        if proposer is not None:
            proposer, pparams = proposer
            args = (pparams,) + tuple(args)
            statics["proposer"] = loop_statics["proposer"] = proposer
            prefill_fn, loop_fn = _spec_prefill, _spec_loop
        self.args = args
        self.loop_args = args[:1] if proposer is not None else ()
        self._prefill = self._compile("prefill", prefill_fn, statics, *args)
        abstract = jax.eval_shape(functools.partial(prefill_fn, **statics),
                                  engine.graphdef, engine.params, *args)
        stop_at = jax.ShapeDtypeStruct((), jnp.int32)
        self._loop = self._compile("loop", loop_fn, loop_statics, *self.loop_args, abstract, stop_at)
        self.state: DecodeState | SpecState | None = None
        self.ttft_s = 0.0
        self.decode_s = 0.0

    def _compile(self, kind, fn, statics, *args):
        prog, seconds = self.engine._program(kind, fn, statics, *args)
        self.compile_s += seconds
        return prog

    def prefill(self) -> DecodeState:
        t0 = time.perf_counter()
        self.state = jax.block_until_ready(self._prefill(self.engine.params, *self.args))
        self.ttft_s = time.perf_counter() - t0
        return self.state

    def decode(self, steps: int | None = None) -> DecodeState:
        """Runs the loop until all rows are done, or for at most `steps` forwards."""
        forwards = int(self.decode_state.forwards)
        stop_at = jnp.asarray(np.iinfo(np.int32).max if steps is None else forwards + steps, jnp.int32)
        t0 = time.perf_counter()
        self.state = jax.block_until_ready(
            self._loop(self.engine.params, *self.loop_args, self.state, stop_at))
        self.decode_s += time.perf_counter() - t0
        return self.state

    @property
    def decode_state(self) -> DecodeState:
        return self.state.decode if isinstance(self.state, SpecState) else self.state

    @property
    def finished(self) -> bool:
        return bool(np.all(np.asarray(self.decode_state.done)[: self.n_real]))

    def run(self) -> list[Result]:
        self.prefill()
        if not self.finished:
            self.decode()
        return self.results()

    def stream(self, chunk: int = 8) -> Iterator[list[list[int]]]:
        """Yields, per chunk of decode steps, the new token ids of each row."""
        self.prefill()
        seen = np.asarray(self.decode_state.prompt_lengths)
        while True:
            lengths = np.asarray(self.decode_state.lengths)
            toks = np.asarray(self.decode_state.tokens)
            yield [toks[r, seen[r]: lengths[r]].tolist() for r in range(self.n_real)]
            seen = lengths
            if self.finished:
                return
            self.decode(chunk)

    def new_tokens(self) -> list[list[int]]:
        s = self.decode_state
        toks, lens, plen = (np.asarray(x) for x in (s.tokens, s.lengths, s.prompt_lengths))
        return [toks[r, plen[r]: lens[r]].tolist() for r in range(self.n_real)]

    def results(self) -> list[Result]:
        s = self.decode_state
        stops = np.asarray(s.stop_ids)
        max_new = np.asarray(s.max_new)
        fwd = np.asarray(s.row_forwards)
        out = []
        for r, toks in enumerate(self.new_tokens()):
            if toks and toks[-1] in stops[r]:
                reason = "stop_token"
            elif len(toks) >= max_new[r]:
                reason = "max_new_tokens"
            else:
                reason = "cache_full"
            tok = self.engine.tokenizer
            out.append(Result(
                tokens=toks, text=tok.decode(toks, skip_special=True) if tok else "",
                new_tokens=len(toks), target_forwards=int(fwd[r]), ttft_s=self.ttft_s,
                wall_s=self.ttft_s + self.decode_s, compile_s=self.compile_s, stop_reason=reason,
                extra=self._telemetry(r, len(toks), int(fwd[r])),
            ))
        return out

    def _telemetry(self, r: int, new_tokens: int, forwards: int) -> dict:
        """Speculation counters of row r; tau counts tokens per target forward after prefill."""
        out = {"method": self.spec.method}
        tau = (new_tokens - 1) / forwards if forwards else 1.0
        if not isinstance(self.state, SpecState):
            return {**out, "k": 0, "tau": tau}
        st = jax.tree.map(lambda x: np.asarray(x)[r], self.state.stats)
        return {**out, "k": self.spec.k, "tau": tau, "drafted": int(st.drafted),
                "accepted": int(st.accepted),
                "accepted_per_position": st.accepted_per_position.tolist(),
                "accept_hist": st.accept_hist.tolist()}
