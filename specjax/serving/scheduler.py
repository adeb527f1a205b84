"""Continuous batching at chunk granularity, for the plain and the speculative loops alike.

Requests arrive (all at once, N closed-loop clients, or Poisson at a given rate) and occupy the
slots of one fixed-shape batch. The batch decodes in chunks of `chunk` target steps with the same
compiled loops `Engine.generate` uses; at each chunk boundary the host reads the new tokens, retires
finished rows, and refills their slots: a batch-1 prefill of the next request at its own prompt
bucket and the batch's cache length, scattered into the batch state. The batch itself (its state,
the compiled slot operations and loops, the host's copy of the lengths) is the core's
`specjax.core.slots.RunningBatch`; the scheduler keeps queueing, timing, packing and the controller, and
reads one replicated view per operation, so it runs on a mesh as on one device. Nothing else of the
batch moves, so the other rows continue exactly as if alone: a row's tokens depend only on its own
prompt, key and position (see `state.step_keys`).

Between chunks the speculation option may change (the adaptive `Controller`): the `DecodeState` is
shared by every option, and only the proposer state differs; prompt lookup keeps none, which makes
switching free. Each speculative option keeps its own proposer state (leaves with the batch on axis
0, initialised per row at insertion); chunks of other options leave it stale (a Medusa hidden state
for one step, a draft model's cache for good), which costs acceptance, never correctness, so `auto`
mixes only stateless or self-correcting proposers by default. When prompt lookup is one of auto's
options, each chunk's new text is also replayed through it on the host (`ngram.replay`), so the
controller learns what prompt lookup would have kept whatever option ran. Every program (empty
batch, insert per bucket, release, move, take / put and one loop per option and batch size, the
views) compiles once in `prepare` (the `RunningBatch`, through `Engine.program`, so
`Engine.compile_count` tracks them).

With `constraint_pool=ConstraintLimits(...)` the batch carries a pool of one constraint per slot
(`specjax.serving.constraints`, `specjax.core.constraint`): `submit(response_format=, regex=, choice=)`
compiles a request's constraint (through the engine's cache) and checks it fits; at insert the request
takes a free pool slot, its tables are uploaded into it (no compile), and its row carries the slot
wherever packing moves it; the slot is freed when the request ends. Free requests beside it decode as
without a pool.

The scheduler is not thread-safe (slot operations donate the batch state): a server runs it in one
engine thread and sends it submits and cancels as messages (`specjax.serving.server`). A request that fails
at admission ends "failed" alone; after an error inside a chunk, `reset_batch` fails the running
requests and starts an empty batch. `history=` bounds the request list and the chunk log.

Example:
  >>> sched = Scheduler(eng, slots=4, spec="auto", opts=GenerateOptions(max_new_tokens=64))
  >>> for p in prompts:
  ...     sched.submit(p, task="qa")
  >>> done = sched.run()
  >>> done[0].tokens, done[0].ttft_s, done[0].counters.to_dict()
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from specjax import memory, sharding, telemetry
from specjax.core import sampling
from specjax.core.constraint import met as constraint_met
from specjax.core.decoder import cache_length, check_max_new_tokens
from specjax.core.logprobs import check_top, entries
from specjax.methods.config import SpecConfig
from specjax.serving import controller as policy
from specjax.serving.constraints import FLAGS, ConstraintError, ConstraintLimits, PoolSlots
from specjax.serving.controller import PLAIN, Controller, ControllerConfig, CostModel, Plan
from specjax.serving.replays import Replays
from specjax.core.decoder import Decoder, Inputs
from specjax.core.slots import RunningBatch, Slots
from specjax.core.state import DecodeState
from specjax.serving.engine import Engine, GenerateOptions
from specjax.methods import registry
from specjax.methods.predict.options import prediction_cap
from specjax.core import shared as shared_state
from specjax.core.ngram_table import TableConfig
from specjax.serving.requests import (Request, RowSnapshot, SchedulerSnapshot, Status,  # noqa: F401 (re-exported)
                                      _placeholder_request, poisson_arrivals)
from specjax.telemetry import StopReason


class Scheduler:
    """Serves many requests through one fixed-shape batch of `slots` rows.

    Args:
      engine: the `Engine` (model, compile cache, proposers).
      slots: rows of the batch (the concurrency).
      spec: a fixed `SpecConfig` (plain by default), or "auto" for the adaptive controller.
      controller: the controller's settings for spec="auto" (default `ControllerConfig()`).
      opts: generation options; max_new_tokens sizes the cache and bounds each request's budget,
        and its sampling values are each request's defaults. A temperature > 0 compiles the
        sampled programs (`submit` may then give each request its own temperature, top-k, top-p).
      chunk: target steps per chunk; slots are refilled and K may change between chunks.
      chat: wrap string prompts in the chat template.
      max_prompt_tokens: the longest prompt to accept; default: the longest one submitted before
        the first step (it fixes the cache length).
      batch_sizes: batch sizes a chunk may run at (each <= slots; slots is always one). With more
        than one, running rows are kept packed at the front (a finished row's slot takes the last
        running row) and each chunk runs on the smallest size that holds them, so a light load pays
        for a small batch, and "auto" compares options at the cost measured for that size: a verify
        step that is cheap at batch 1 may cost several plain steps at batch 16.
      ngram_table: slots of the cross-request n-gram table that every committed token of every
        request updates and prompt lookup consults (`specjax.core.ngram_table`). Every option runs as
        its record serves it (`registry.serving`: prompt lookup turns its table on); the options'
        batch-shared state (`Proposer.shared`: the n-gram table, token recycling's matrix) lives in
        the batch state, so every option's chunks (plain included) feed it, and slot refills keep
        it. None: each method's serving default; 0: no n-gram table.
      with_plain: with a fixed speculative `spec`, also compile the plain loop, so that a request
        may opt out of speculation (auto always has it).
      history: keep only the last `history` requests in `requests` and chunks in `chunk_log`
        (a server's bound; None: all, for offline runs that read them afterwards).
      clock: seconds; `time.perf_counter` by default.
      constraint_pool: the largest constraint a request may bring (`ConstraintLimits`: automaton states
        and token classes); the batch then carries a pool of one constraint per slot, compiled into
        every program. None: no pool, and a constrained request is refused at submit.
      costs: for "auto", the cost models (`Scheduler.costs`) of an earlier scheduler of the same
        options, slots and batch sizes on this machine, used instead of calibrating again (repeated
        runs of one configuration then pay the calibration once).
      logit_bias: the most logit_bias entries a request may bring (OpenAI's token id -> value);
        every row then carries that many, added to the target's logits at every position
        (`specjax.core.sampling.biased`). 0: none, and a biased request is refused at submit.
      logprobs: the most alternatives per token a request may ask for with its logprobs (0..20);
        every row then records its tokens' log-probabilities and that many top tokens
        (`Decoder.logprobs`). None: none recorded, and a request for logprobs is refused at submit.
    """

    def __init__(self, engine: Engine, *, slots: int, spec: SpecConfig | str = SpecConfig(),
                 controller: ControllerConfig | None = None, opts: GenerateOptions = GenerateOptions(),
                 chunk: int = 8, chat: bool = False, max_prompt_tokens: int | None = None,
                 ngram_table: int | None = None,
                 batch_sizes: Sequence[int] | None = None, with_plain: bool = False,
                 history: int | None = None, clock: Callable[[], float] = time.perf_counter,
                 costs: dict[int, CostModel] | None = None, constraint_pool: ConstraintLimits | None = None,
                 logit_bias: int = 0, logprobs: int | None = None):
        if int(slots) != slots or slots < 1:
            raise ValueError(f"slots (concurrency) = {slots}: must be an integer >= 1")
        if int(chunk) != chunk or chunk < 1:
            raise ValueError(f"chunk={chunk}: must be an integer >= 1")
        opts.validate()
        self.engine, self.b, self.opts, self.chunk, self.chat = engine, int(slots), opts, int(chunk), chat
        bad = [x for x in (batch_sizes or ()) if int(x) != x or not 1 <= x <= self.b]
        if bad:
            raise ValueError(f"batch_sizes {list(batch_sizes)}: each must be an integer in [1, slots={self.b}]")
        self.sizes = tuple(sorted({int(x) for x in (batch_sizes or ())} | {self.b}))
        self.clock = clock
        resolve = engine.resolve
        if isinstance(spec, str):
            if spec != "auto":
                raise ValueError(f"spec={spec!r}: give a SpecConfig or 'auto'")
            ccfg = controller or ControllerConfig()  # its options resolved: one key per option
            self.ccfg = dataclasses.replace(ccfg, extra=tuple(map(resolve, ccfg.extra)))
            self.specs = {o: o for o in self.ccfg.options if o != PLAIN}
        else:
            self.ccfg = None
            spec = resolve(spec)
            self.specs = {} if spec.method == "none" else {spec: spec}
        self.options: tuple[SpecConfig, ...] = ((PLAIN,) if self.ccfg or not self.specs or with_plain else ()) + tuple(self.specs)
        self.fixed: SpecConfig = next(iter(self.specs), PLAIN)  # a fixed spec's option
        served = {o: registry.serving(s, ngram_table) for o, s in self.specs.items()}
        if ngram_table and served == self.specs:
            raise ValueError("ngram_table needs prompt lookup among the options (spec ngram or auto)")
        self.specs = served
        # built once (raises before compiling: heads missing, k too large, ...)
        self._built = {o: engine.proposer(s) for o, s in self.specs.items()}
        # every option's batch-shared state, one part per name: each option's program carries all
        self.shared = shared_state.union(x for p, _ in self._built.values() if p is not None for x in p.shared)
        self.table = next((x for x in self.shared if x.name == TableConfig.name), None)
        if constraint_pool is not None and not isinstance(constraint_pool, ConstraintLimits):
            raise TypeError(f"constraint_pool={constraint_pool!r}: give a ConstraintLimits(states=..., classes=...) "
                            "or None")
        self.constraint_pool = constraint_pool
        if constraint_pool is not None:  # one pool slot per row: every running request can hold one
            pool = constraint_pool.pool(vocab=engine.config.vocab_size, capacity=self.b)
            self.shared = shared_state.union((*self.shared, pool))
        self._pool_slots = PoolSlots(self.b)  # which request holds which pool slot
        self.prediction_cap = prediction_cap(self.specs.values())  # rows' prediction buffer (None: none)
        if isinstance(logit_bias, bool) or int(logit_bias) != logit_bias or logit_bias < 0:
            raise ValueError(f"logit_bias={logit_bias}: the most entries a request may bring, an integer >= 0")
        self.logit_bias = int(logit_bias) or None  # rows' logit_bias width (None: no row carries one)
        self.logprobs = None if logprobs is None else check_top(logprobs, "logprobs")
        self.sc = opts.sampling
        self.max_prompt_tokens = max_prompt_tokens
        if history is not None and (int(history) != history or history < 1):
            raise ValueError(f"history={history}: must be an integer >= 1 (or None: keep all)")
        self.requests: list[Request] = [] if history is None else collections.deque(maxlen=int(history))
        self.live: dict[int, Request] = {}  # queued and running requests by id
        self._next_id = 0
        self.queue: list[Request] = []
        self.slots: list[Request | None] = [None] * self.b
        self.controller: Controller | None = None
        self.cost: CostModel | None = None  # at the full batch; `costs` per batch size
        self.costs: dict[int, CostModel] = {}
        self.batch: RunningBatch | None = None  # the batch in flight, from `prepare`
        self.chunk_log: list[telemetry.ChunkRecord] = (  # every chunk (or the last `history`): what ran, why, for whom
            [] if history is None else collections.deque(maxlen=int(history)))
        # auto: the options replayed on the host over the text other options commit
        self.replays = Replays(self.specs.values() if self.ccfg is not None and self.ccfg.replay_ngram else (),
                               lambda: self.controller.observe)
        self._t0 = None
        if costs is not None and (self.ccfg is None or set(costs) != set(self.sizes)):
            raise ValueError(f"costs for batch sizes {sorted(costs)}: give them to an 'auto' scheduler with "
                             f"batch sizes {list(self.sizes)} (an earlier one's Scheduler.costs)")
        self._given_costs = costs

    # ---- requests --------------------------------------------------------------------------
    def submit(self, prompt: str | Sequence[int], *, task: str | None = None,
               arrival: float | None = None, opt_out: bool = False, contribute: bool = True,
               max_new_tokens: int | None = None,
               seed: int | None = None, temperature: float | None = None, top_k: int | None = None,
               top_p: float | None = None, speculation: SpecConfig | None = None, tenant: int = 0,
               stop_ids: Sequence[int] = (), stream: int | None = None,
               prediction: str | Sequence[int] | None = None, response_format: dict | None = None,
               regex: str | None = None, choice: Sequence[str] | None = None, constraint: Any = None,
               logit_bias: dict | None = None, top_logprobs: int | None = None) -> int:
        """Queues a request; returns its id. Validates it now (nothing compiles here).

        The request draws the random stream `fold_in(key(seed), id)`: its own, whatever batch it
        lands in. Sampling values default to the scheduler's options. `opt_out`: never speculated
        on; `contribute=False` (implied by opt_out): its text never enters the n-gram table.
        `speculation`: the one option (a `SpecConfig`) of `options` it may speculate with (chunks
        while it runs use that option, or plain when running requests name different ones).
        `tenant`: the scope of the n-gram table it reads and writes (the table never proposes one
        tenant's text to another). `stop_ids`: stop tokens besides the scheduler's. `stream`: the
        row index of its random stream instead of its id (a server gives 0 to a request that
        names its seed, so that the same seed samples the same text, as `Engine.generate` does
        for a single prompt). `prediction`: its predicted output (text or token ids), which a
        predict option drafts from (one longer than its `prediction_cap` is refused); whatever runs,
        the request's usage counts it (`specjax.methods.predict.usage`).
        `response_format` (OpenAI's json_schema / json_object), `regex` or `choice`: the constraint its
        answer follows (one of them; compiled here through `Engine.constraint_for`, cached), or
        `constraint`: tables already compiled (`specjax.constrain.TokenTables`; a server compiles
        them off its event loop). They need the scheduler's `constraint_pool` and a stop token.
        `logit_bias`: token id -> value in [-100, 100], added to the target's logits at every
        position; at most the scheduler's `logit_bias` entries. `top_logprobs`: record each token's
        log-probability and that many alternatives (`Request.logprobs`; at most the scheduler's
        `logprobs`); None: none.
        """
        m = check_max_new_tokens(self.opts.max_new_tokens if max_new_tokens is None else max_new_tokens,
                                 most=self.opts.max_new_tokens,
                                 why="the scheduler's GenerateOptions.max_new_tokens sizes the cache")
        if arrival is not None and not arrival >= 0:
            raise ValueError(f"arrival={arrival}: must be >= 0 seconds (or None)")
        o = self.opts
        sp = dict(temperature=o.temperature if temperature is None else temperature,
                  top_k=o.top_k if top_k is None else top_k, top_p=o.top_p if top_p is None else top_p)
        (ids,) = self.engine.check([prompt], dataclasses.replace(o, **sp), chat=self.chat)
        if sp["temperature"] > 0 and self.sc.greedy:
            raise ValueError(f"temperature={sp['temperature']} in a greedy scheduler: create it with "
                             "GenerateOptions(temperature > 0) to compile the sampled programs")
        if self.batch is not None and self.engine.bucket_for(len(ids)) > self.bucket:
            raise ValueError(f"prompt of {len(ids)} tokens exceeds this scheduler's bucket of "
                             f"{self.bucket}; pass max_prompt_tokens= when creating it")
        if opt_out and PLAIN not in self.options:
            raise ValueError("opt_out needs the plain loop: create the scheduler with with_plain=True")
        if speculation is not None and not isinstance(speculation, SpecConfig):
            raise ValueError(f"speculation={speculation!r}: give a SpecConfig, one of this scheduler's options")
        speculation = None if speculation is None else self.engine.resolve(speculation)
        if speculation is not None and speculation not in self.options:
            raise ValueError(f"speculation {speculation.label}: this scheduler runs "
                             f"{', '.join(o.label for o in self.options)}")
        stops = tuple(dict.fromkeys([*self.engine.stop_ids(self.opts), *map(int, stop_ids)]))
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
        seed = self.opts.seed if seed is None else seed
        req = Request(id=self._next_id, ids=ids, max_new_tokens=int(m), task=task, arrival=arrival,
                      opt_out=opt_out, contribute=contribute and not opt_out, seed=seed,
                      speculation=speculation, tenant=tenant,
                      stop_ids=stops, stream=None if stream is None else int(stream), prediction=predicted,
                      constraint=tables, logit_bias=bias, top_logprobs=top_logprobs, **sp)
        req.inputs = self._inputs(req)  # validated once, at the core's boundary (Inputs.create); reused at insert
        self._next_id += 1
        self.requests.append(req)
        self.live[req.id] = req
        self.queue.append(req)
        return req.id

    def check_logit_bias(self, bias: dict | None) -> dict[int, float] | None:
        """A request's logit_bias checked (`sampling.check_logit_bias`) against the vocabulary and this
        scheduler's width; None for none (or an empty one)."""
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
        against this scheduler's pool; `submit` calls it, and a server calls it first, off its event loop
        (it reads only settings). `stop_ids`: the request's own stop tokens besides the scheduler's.

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

    def cancel(self, rid: int) -> None:
        """Cancels a request: a queued one never runs; a running one frees its slot now. Not
        thread-safe: call it between steps, from the thread that steps (a server's engine thread)."""
        req = self.live.get(rid)
        if req is None:  # finished, failed, cancelled or unknown
            return
        if req.status is Status.QUEUED:
            self.queue.remove(req)
            req.inputs = None
        elif req.status is Status.RUNNING:
            self.batch.release(req.slot)
            self.slots[req.slot] = None
            if self.controller:
                self.controller.remove_row(req.id)
            self._pack()
        else:
            return
        self._free_constraint(req)
        self.replays.end(req)
        req.status, req.finished_s, req.stop_reason = Status.CANCELLED, self.now(), StopReason.CANCELLED
        self.live.pop(req.id, None)

    def fail(self, req: Request, error: str) -> None:
        """Ends one request with an error (its slot, if it had one, is already free)."""
        req.status, req.finished_s, req.stop_reason, req.error = Status.FAILED, self.now(), StopReason.ERROR, error
        req.inputs = None
        self.live.pop(req.id, None)
        self.replays.end(req)
        self._free_constraint(req)
        if self.controller is not None:
            self.controller.remove_row(req.id)

    def _free_constraint(self, req: Request) -> None:
        """Frees the pool slot an ended request held (its row, done, is never masked again)."""
        self._pool_slots.free(req.id)
        req.constraint = None  # history keeps no tables

    def reset_batch(self, error: str) -> list[Request]:
        """After an error inside a chunk (the device's, or the host's while it read the chunk): fails
        every running request with `error` and starts a fresh, empty batch (the donated state may be
        gone; the shared method state starts empty). Queued requests stay queued. Returns the failed ones."""
        waiting = {r.id for r in self.queue}
        failed = [r for r in self.live.values() if r.id not in waiting]  # running, or mid-admission
        for r in failed:
            self.fail(r, error)
        self.slots = [None] * self.b
        self._pool_slots.clear()  # the fresh batch's pool is empty
        self.batch.reset()
        return failed

    def now(self) -> float:
        return 0.0 if self._t0 is None else self.clock() - self._t0

    def start_clock(self) -> None:
        """Starts the clock that `arrival` and every request time count from (the first `step`
        does it otherwise); a server calls it once, so that arrivals are given as they happen."""
        if self._t0 is None:
            self._t0 = self.clock()

    # ---- programs --------------------------------------------------------------------------
    def prepare(self) -> None:
        """Fixes the cache length, compiles every program (`slots.RunningBatch`) and (for "auto")
        calibrates the cost model.

        Runs at the first `step` if not called; call it first to keep compile time out of timings.
        """
        if self.batch is not None:
            return
        longest = self.max_prompt_tokens or max([len(r.ids) for r in self.requests] or [1])
        self.bucket = self.engine.bucket_for(longest)
        built = {o: self.engine.build_decoder(s, sampling=self.sc, prompt_bucket=self.bucket, built=self._built[o],
                                              max_new_tokens=self.opts.max_new_tokens) for o, s in self.specs.items()}
        self.cache_length = max([d.cache_length for d, _ in built.values()] +
                                [cache_length(self.bucket, self.opts.max_new_tokens, 1)])
        self.decoders = {o: dataclasses.replace(d, cache_length=self.cache_length, shared=self.shared,
                                                logprobs=self.logprobs) for o, (d, _) in built.items()}
        mesh = self.engine.mesh
        self.decoders[PLAIN] = Decoder(cache_length=self.cache_length, sampling=self.sc, shared=self.shared,
                                       mesh=mesh, logprobs=self.logprobs)
        self._key = {PLAIN: None, **{o: i for i, o in enumerate(self.specs)}}  # the batch's name of an option
        ops = Slots(base=self.decoders[PLAIN], decoders=tuple(self.decoders[o] for o in self.specs))
        self.batch = RunningBatch(ops, params=self.engine.params, compile=self.engine.program,
                                  pparams=tuple(sharding.place_pparams(built[o][1], mesh) for o in self.specs),
                                  empty=self._placeholders(max_new=1), sizes=self.sizes,
                                  loops=tuple(self._key[o] for o in self.options))
        for p in sorted({self.engine.bucket_for(len(r.ids)) for r in self.queue}):
            self._insert_program(p)
        if self.ccfg is not None:
            # timings differ per host: process 0's calibration is everyone's, or hosts would diverge
            self.costs = self._given_costs or sharding.broadcast_from_0(
                {size: self.calibrate(size=size) for size in self.sizes})
            self.cost = self.costs[self.b]
            self.controller = Controller(self.ccfg, self.cost)

    @property
    def state(self) -> DecodeState | None:
        """The batch's decode state (None before `prepare`)."""
        return None if self.batch is None else self.batch.state

    @property
    def pstates(self) -> dict:
        """Each speculative option's proposer state."""
        return {} if self.batch is None else dict(zip(self.specs, self.batch.pstates))

    @property
    def compile_s(self) -> float:
        """Seconds this scheduler spent compiling."""
        return 0.0 if self.batch is None else self.batch.compile_s

    def warm(self) -> None:
        """Runs every compiled program once on placeholder rows, so that first-run costs (allocation,
        caches: ~0.9 s for an insert program here) stay out of timed runs and first requests; "auto"
        runs its loops while it calibrates."""
        if all(r is None for r in self.slots):
            self.batch.warm_inserts()
        if self.costs:
            return
        for size in self.sizes:
            self.calibrate(steps=1, repeats=1, size=size)

    def compile_buckets(self) -> None:
        """Compiles the insert program of every prompt bucket up to the scheduler's, so that no
        request compiles anything when it arrives (a server's warm-up)."""
        self.prepare()
        for p in self.engine.buckets:
            if p <= self.bucket:
                self._insert_program(p)

    def _placeholders(self, *, max_new: int) -> Inputs:
        """One-token rows: done at once with max_new 1 (the empty batch), still running with a large
        max_new and no stop ids (the calibration batch)."""
        return Inputs.create([[0]] * self.b, bucket=1, max_new_tokens=max_new, prediction_bucket=self.prediction_cap,
                             logit_bias_width=self.logit_bias)

    def _insert_program(self, p: int):
        """The insert at prompt bucket `p`, compiled on a placeholder request (done at once)."""
        return self.batch.compile_insert(self._inputs(_placeholder_request(), p))

    def _inputs(self, req: Request, bucket: int | None = None) -> Inputs:
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

    def calibrate(self, steps: int = 4, repeats: int = 3, *, size: int | None = None) -> CostModel:
        """Seconds per target step of every option at batch size `size` (default: all slots), on this
        machine: `controller.calibrate` on forks of the running batch (the same programs)."""
        return policy.calibrate(self.batch, {o: self._key[o] for o in self.options},
                                {o: self.decoders[o].window for o in self.options},
                                self._placeholders(max_new=self.cache_length), cache_length=self.cache_length,
                                steps=steps, repeats=repeats, size=size or self.b)

    # ---- the serving loop --------------------------------------------------------------------
    def run(self, *, on_chunk: Callable[["Scheduler"], None] | None = None) -> list[Request]:
        """Steps until every submitted request has finished or been cancelled; returns all of them."""
        self.prepare()
        while self.step():
            if on_chunk is not None:
                on_chunk(self)
        return self.requests

    def step(self) -> bool:
        """Admits arrived requests into free slots, then decodes one chunk.

        Returns False when nothing is running and nothing is queued.
        """
        self.admit()
        active = [r for r in self.slots if r is not None]
        if not active:
            if not self.queue:
                return False
            wait = min(r.arrival for r in self.queue) - self.now()  # all queued ones are in the future
            time.sleep(max(0.0, wait))
            return True
        size = self.batch_size_for(active)
        plan = self.plan(active, size=size)
        self._decode_chunk(plan, active, size)
        return True

    def admit(self, *, on_insert: Callable[[Request], None] | None = None) -> None:
        """Admits arrived requests into free slots: each gets its first token from its prefill.
        `step` does this before its chunk; a server calls it first, with `on_insert` called after
        each request's prefill (or failure), to stream every first token as soon as it exists."""
        self.prepare()
        if self._t0 is None:
            self._t0 = self.clock()
        self._admit(on_insert)

    def batch_size_for(self, active: Sequence[Request]) -> int:
        """The smallest batch size that holds every running row (they are packed at the front)."""
        top = 1 + max(r.slot for r in active)
        return next(x for x in self.sizes if x >= top)

    def plan(self, active: Sequence[Request], *, size: int | None = None) -> Plan:
        """The next chunk's option (`specjax.serving.controller.plan`: the policy), the controller comparing options
        at the cost measured for batch size `size`; every process runs process 0's choice."""
        if self.controller is not None:
            self.controller.cost = self.costs.get(size or self.b, self.cost)
        p = policy.plan(active, controller=self.controller, fixed=self.fixed, plain=PLAIN in self.options)
        return p if self.controller is None else sharding.broadcast_from_0(p)

    def _admit(self, on_insert: Callable[[Request], None] | None = None) -> None:
        free = [i for i, r in enumerate(self.slots) if r is None]
        while free:
            now = self.now()
            ready = [r for r in self.queue if r.arrival is None or r.arrival <= now]
            if not ready:
                return
            req = ready[0]
            self.queue.remove(req)
            try:
                self._insert(free[0], req, now)
            except Exception as e:  # late bad input, or its prefill failed: this request alone
                if self.slots[free[0]] is req or any(x.is_deleted() for x in jax.tree.leaves(self.batch.state)):
                    raise  # it failed after taking the slot or the donated batch: see reset_batch
                self.fail(req, f"{type(e).__name__}: {e}")
            else:
                if req.status is Status.RUNNING:
                    free.pop(0)
            if on_insert is not None:
                on_insert(req)

    def _insert(self, slot: int, req: Request, now: float) -> None:
        req.arrived_s = now if req.arrival is None else req.arrival
        inputs = req.inputs if req.inputs is not None else self._inputs(req)
        if req.constraint is not None:
            inputs = self._with_pool_slot(req, inputs)
        view = self.batch.insert(slot, inputs)
        req.inputs = None  # inserted: its arrays are the batch's now (history keeps no device buffers)
        t = self.now()
        req.status, req.slot = Status.RUNNING, slot
        req.tokens = [int(view.tokens[slot, len(req.ids)])]
        self._record_logprobs(req, view, len(req.ids))
        req.emissions.append((t, 1))
        self.slots[slot] = req
        if self.controller is not None:
            self.controller.add_row(req.id, task=req.task, opt_out=req.opt_out)
        self.replays.start(req)
        if view.done[slot]:
            self._finish(req, t, 0)

    def _with_pool_slot(self, req: Request, inputs: Inputs) -> Inputs:
        """Takes a free pool slot for a constrained request, uploads its tables there (no compile) and
        returns its inputs naming that slot; the row keeps it in `DecodeState.constraint`."""
        req.pool_slot = self._pool_slots.take(req.id)
        self.batch.upload(req.pool_slot, req.constraint)
        return inputs.replace(constraint=jnp.asarray([req.pool_slot], jnp.int32))

    def _decode_chunk(self, plan: Plan, active: list[Request], size: int) -> None:
        o = plan.option
        t0, start = self.clock(), self.now()
        chunk = self.batch.run(self._key[o], self.chunk, size=size)
        t, seconds = self.now(), self.clock() - t0
        if self.controller is not None:  # what a step of this option costs here, as it runs
            self.controller.observe_chunk(o, seconds, chunk.steps)
        tasks: dict[str, int] = {}
        for r in active:
            tasks[str(r.task)] = tasks.get(str(r.task), 0) + 1
        self.chunk_log.append(telemetry.ChunkRecord(
            start_s=start, seconds=seconds, option=o.label, reason=plan.reason,
            expected_gain=float(plan.gain), rows=len(active), tasks=tasks, queued=len(self.queue),
            batch_size=size, steps=chunk.steps))
        label, done, forwards = o.label, chunk.view.done, chunk.view.row_forwards
        for req in active:
            i = req.slot
            new = chunk.new_tokens(i)
            if new:
                req.tokens += new
                req.emissions.append((t, len(new)))
                self._record_logprobs(req, chunk.view, chunk.before[i])
            req.chunks[label] = req.chunks.get(label, 0) + 1
            counters = chunk.counters(i)
            if counters.num_drafts:
                req.counters.merge(counters)
                if self.controller is not None:
                    self.controller.observe(req.id, o.kind, counters.accepted_tokens_per_pos, counters.num_drafts)
            self.replays.chunk(req, ran=o.kind)
            if done[i]:
                self._finish(req, t, int(forwards[i]))
        self._pack()

    def _record_logprobs(self, req: Request, view, start: int) -> None:
        """Appends the log-probabilities of the row's tokens from column `start` on, when it asked."""
        if req.top_logprobs is not None:
            n = req.top_logprobs
            got = entries(view.logprobs, req.slot, int(start), int(view.lengths[req.slot]))
            req.logprobs += [e._replace(top=e.top[:n]) for e in got]

    def _pack(self) -> None:
        """With several batch sizes: moves the last running rows into the free slots before them."""
        if len(self.sizes) == 1:
            return
        while True:
            free = [i for i, r in enumerate(self.slots) if r is None]
            busy = [i for i, r in enumerate(self.slots) if r is not None]
            if not free or not busy or free[0] > busy[-1]:
                return
            src, dst = busy[-1], free[0]
            self.batch.move(src, dst)
            req = self.slots[src]
            self.slots[dst], self.slots[src], req.slot = req, None, dst

    def _finish(self, req: Request, t: float, forwards: int) -> None:
        stops = req.stop_ids or self.engine.stop_ids(self.opts)
        req.stop_reason = telemetry.stop_reason(req.tokens, stops, req.max_new_tokens, met=req.constraint is None or
                                                constraint_met(req.constraint, req.tokens, stops))
        req.status, req.finished_s, req.target_forwards = Status.FINISHED, t, forwards
        self.slots[req.slot] = None
        self.live.pop(req.id, None)
        if self.controller is not None:
            self.controller.remove_row(req.id)
        self.replays.end(req)
        self._free_constraint(req)

    # ---- reporting ---------------------------------------------------------------------------
    def snapshot(self) -> SchedulerSnapshot:
        """What the scheduler holds now, read-only (`SchedulerSnapshot`): queue depth, the row in each
        slot, the requests alive, the last chunk. Callable from any thread (a server's event loop
        reads it while the engine thread steps): it copies the slot list and reads each length in one
        step, so every value is one the scheduler had, though two values may be a chunk boundary apart."""
        rows = tuple(None if r is None else RowSnapshot(slot=i, request=r.id, status=r.status, tokens=len(r.tokens),
                                                        task=r.task, tenant=r.tenant)
                     for i, r in enumerate(list(self.slots)))
        log = self.chunk_log
        return SchedulerSnapshot(slots=self.b, queued=len(self.queue), live=len(self.live), rows=rows,
                                 last_chunk=log[-1] if log else None)

    def request(self, rid: int) -> Request | None:
        """The record of request `rid` while it is queued or running (None after: see `requests`)."""
        return self.live.get(rid)

    def device_parts(self) -> dict[str, object]:
        """The arrays of each part of `specjax.memory.PARTS` this scheduler keeps: the target's
        weights, the draft weights (its options' proposer params; what the target also holds, as
        Medusa's LM head, counts as weights), the caches (the batch state and the proposers' states,
        the batch-shared state apart), then each batch-shared state by name."""
        shared = dict(self.batch.state.shared.parts)
        state = self.batch.state.replace(shared=self.batch.state.shared.replace(parts={}))
        return dict(weights=self.engine.params, draft_weights=self.batch.pparams,
                    caches=(state, self.batch.pstates), **shared)

    def memory(self, *, measured: bool = True) -> memory.Report:
        """What this scheduler keeps (`specjax.memory.Report`): its arrays by part, the programs its
        engine has compiled and what compiling them added, and (`measured`) the process now. Call it
        from the thread that steps (the batch state is donated at every step), after `prepare`."""
        return memory.report(self.device_parts(), programs=self.engine.programs(),
                             program_rss_bytes=self.engine.compile_rss_bytes, measured=measured)
