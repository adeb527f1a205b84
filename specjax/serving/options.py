"""The options a continuous-batching host serves, and the batch that runs them.

`OptionSet.resolve` turns a fixed `SpecConfig` or "auto" (with its `ControllerConfig`) into the
options a chunk may run: plain and the speculative ones, each as its record serves it
(`registry.serving`), their proposers built once (so a missing asset or a K too large fails before
any compile), and the batch-shared state every option's program carries (`Proposer.shared`, the
constraint pool). `OptionSet.build` fixes the cache length and builds one `Decoder` per option and
the `RunningBatch` (a `specjax.core.slots.BatchEngine`) that compiles and runs them; `Built.calibrate`
times every option on forks of that batch (`controller.calibrate`, beside the cost model).

The Scheduler holds one of each and decides nothing here: it queues, admits, runs chunks and packs.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from specjax import sharding
from specjax.core import shared as shared_state
from specjax.core.decoder import Decoder, Inputs, cache_length
from specjax.core.ngram_table import TableConfig
from specjax.core.sampling import Sampling
from specjax.core.slots import BARE, BatchEngine, RunningBatch, Slots
from specjax.methods import registry
from specjax.methods.config import SpecConfig
from specjax.methods.predict.options import prediction_cap
from specjax.serving import controller as policy
from specjax.serving.constraints import ConstraintLimits
from specjax.serving.controller import PLAIN, ControllerConfig, CostModel


@dataclasses.dataclass(frozen=True)
class Built:
    """The options built for one cache length: a `Decoder` per option (plain included), each option's
    name in the batch (None: plain; `BARE`: auto's plain, without upkeep), and the batch in flight."""

    decoders: dict[SpecConfig, Decoder]
    keys: dict[SpecConfig, int | str | None]
    cache_length: int
    batch: BatchEngine

    def calibrate(self, busy: Inputs, *, steps: int = 4, repeats: int = 3, size: int) -> CostModel:
        """Seconds per target step of every option at batch size `size` on this machine
        (`controller.calibrate` on forks of the batch prefilled with `busy`: the same programs)."""
        return policy.calibrate(self.batch, self.keys, {o: d.window for o, d in self.decoders.items()}, busy,
                                cache_length=self.cache_length, steps=steps, repeats=repeats, size=size)

    def device_parts(self, params) -> dict[str, object]:
        """The arrays of each part of `specjax.memory.PARTS` a host of this batch keeps: the target's
        weights (`params`), the draft weights (the options' proposer params; what the target also holds,
        as Medusa's LM head, counts as weights), the caches (the batch state and the proposers' states,
        the batch-shared state apart), then each batch-shared state by name."""
        state = self.batch.state
        rest = state.replace(shared=state.shared.replace(parts={}))
        return dict(weights=params, draft_weights=self.batch.pparams, caches=(rest, self.batch.pstates),
                    **dict(state.shared.parts))


@dataclasses.dataclass(frozen=True)
class OptionSet:
    """What a host may run: `options` (plain first when it is one), each speculative option's served
    spec (`specs`), their built proposers, and the batch-shared state all of them carry.

    Attributes:
      ccfg: auto's controller settings, its options resolved (None: a fixed spec).
      specs: each speculative option -> the spec its record serves (`registry.serving`).
      options: every option a chunk may run.
      built: each speculative option's `(proposer, params)`.
      shared: the batch-shared state specs (`specjax.core.shared`), the constraint pool included.
      prediction_cap: the rows' prediction buffer of a predict option (None: none).
    """

    ccfg: ControllerConfig | None
    specs: dict[SpecConfig, SpecConfig]
    options: tuple[SpecConfig, ...]
    built: dict[SpecConfig, tuple]
    shared: tuple
    prediction_cap: int | None

    @property
    def fixed(self) -> SpecConfig:
        """A fixed spec's option (plain when it is plain; auto's first speculative one)."""
        return next(iter(self.specs), PLAIN)

    @property
    def table(self) -> TableConfig | None:
        """The cross-request n-gram table's spec among the shared state, or None."""
        return next((x for x in self.shared if x.name == TableConfig.name), None)

    @classmethod
    def resolve(cls, engine, spec: SpecConfig | str, *, controller: ControllerConfig | None = None,
                ngram_table: int | None = None, with_plain: bool = False,
                constraint_pool: ConstraintLimits | None = None, slots: int) -> "OptionSet":
        """The options of a host of `slots` rows.

        Args:
          spec: a fixed `SpecConfig` (plain by default), or "auto" for the adaptive controller.
          controller: the controller's settings for spec="auto" (default `ControllerConfig()`).
          ngram_table: slots of the cross-request n-gram table that every committed token of every
            request updates and prompt lookup consults (`specjax.core.ngram_table`). Every option runs
            as its record serves it (`registry.serving`: prompt lookup turns its table on); the
            options' batch-shared state (`Proposer.shared`: the n-gram table, token recycling's
            matrix) lives in the batch state: every option's chunks feed it (plain too, but for
            auto's: `build`), and slot refills keep it. None: each method's serving default; 0: no
            n-gram table.
          with_plain: with a fixed speculative `spec`, also compile the plain loop, so that a request
            may opt out of speculation (auto always has it).
          constraint_pool: the largest constraint a request may bring (`ConstraintLimits`: automaton
            states and token classes); the batch then carries a pool of one constraint per slot,
            compiled into every program. None: no pool, and a constrained request is refused.
        """
        if isinstance(spec, str):
            if spec != "auto":
                raise ValueError(f"spec={spec!r}: give a SpecConfig or 'auto'")
            ccfg = controller or ControllerConfig()  # its options resolved: one key per option
            ccfg = dataclasses.replace(ccfg, extra=tuple(map(engine.resolve, ccfg.extra)))
            specs = {o: o for o in ccfg.options if o != PLAIN}
        else:
            ccfg, spec = None, engine.resolve(spec)
            specs = {} if spec.method == "none" else {spec: spec}
        options = ((PLAIN,) if ccfg or not specs or with_plain else ()) + tuple(specs)
        served = {o: registry.serving(s, ngram_table) for o, s in specs.items()}
        if ngram_table and served == specs:
            raise ValueError("ngram_table needs prompt lookup among the options (spec ngram or auto)")
        built = {o: engine.proposer(s) for o, s in served.items()}  # raises before compiling
        shared = shared_state.union(x for p, _ in built.values() if p is not None for x in p.shared)
        if constraint_pool is not None and not isinstance(constraint_pool, ConstraintLimits):
            raise TypeError(f"constraint_pool={constraint_pool!r}: give a ConstraintLimits(states=..., classes=...) "
                            "or None")
        if constraint_pool is not None:  # one pool slot per row: every running request can hold one
            pool = constraint_pool.pool(vocab=engine.config.vocab_size, capacity=slots)
            shared = shared_state.union((*shared, pool))
        return cls(ccfg=ccfg, specs=served, options=options, built=built, shared=shared,
                   prediction_cap=prediction_cap(served.values()))

    def build(self, engine, *, bucket: int, max_new_tokens: int, sampling: Sampling, logprobs: int | None,
              empty: Inputs, sizes: tuple[int, ...], batch: Callable[..., BatchEngine] = RunningBatch) -> Built:
        """Every option's `Decoder` at one cache length (the longest any option needs for prompts up to
        `bucket` and `max_new_tokens`), and the batch that compiles and runs them (`batch`: its class,
        `RunningBatch`; `empty`: its placeholder rows; `sizes`: the batch sizes a chunk may run at).

        Auto's plain option runs bare (`Slots.bare`): when auto judges that speculation does not pay,
        a plain chunk costs what the plain loop alone costs, and the batch-shared state learns from
        speculative chunks and prompts only. A fixed spec's plain loop (opted-out requests) feeds it."""
        built = {o: engine.build_decoder(s, sampling=sampling, prompt_bucket=bucket, built=self.built[o],
                                         max_new_tokens=max_new_tokens) for o, s in self.specs.items()}
        length = max([d.cache_length for d, _ in built.values()] + [cache_length(bucket, max_new_tokens, 1)])
        decoders = {o: dataclasses.replace(d, cache_length=length, shared=self.shared, logprobs=logprobs)
                    for o, (d, _) in built.items()}
        base = Decoder(cache_length=length, sampling=sampling, shared=self.shared, mesh=engine.mesh, logprobs=logprobs)
        ops = Slots(base=base, decoders=tuple(decoders[o] for o in self.specs))
        keys = {PLAIN: None if self.ccfg is None else BARE, **{o: i for i, o in enumerate(self.specs)}}
        decoders[PLAIN] = base if self.ccfg is None else ops.bare
        running = batch(ops, params=engine.params, compile=engine.program, empty=empty, sizes=sizes,
                        pparams=tuple(sharding.place_pparams(built[o][1], engine.mesh) for o in self.specs),
                        loops=tuple(keys[o] for o in self.options))
        return Built(decoders=decoders, keys={o: keys[o] for o in self.options}, cache_length=length, batch=running)
