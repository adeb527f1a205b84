"""Slot operations on a running batch: what continuous batching does to the decode state, in the core.

A batch of B rows (slots) decodes in chunks; between chunks a host inserts a new request into a free
row, releases a cancelled one, moves the last running row forward (packing), runs a chunk on the first
`size` rows only (`take` / `put`), and reads what it needs back (`view`). The shape follows MaxText's
`MaxEngine` (prefill, insert, generate on a static object), with speculation: one shared `DecodeState`
for every option and one proposer state per speculative option (`Slots.decoders`), all prefilled at
once, so that the option may change between chunks.

Every operation is a pure function of arrays here (no host reads) and a jitted program below (with the
batch state donated, `slots=` static), compiled once per shape by `Engine.program`. On the decoders'
mesh (`Decoder.mesh`, one for every option) the outputs are pinned to the loop carry's layout
(`sharding.constrain_carry`), so a state that went through any of them is a valid argument of every
compiled program again, and `view` returns a replicated copy that every process reads whole, in one
transfer.

`RunningBatch` (below) holds a batch in flight: the state, every compiled program and the host's copy
of the lengths (what `BatchEngine` declares); a continuous-batching host
(`specjax.serving.scheduler.Scheduler`) keeps only its queue, its timing and its controller.

Example (the operations alone, what `RunningBatch` runs per request and per chunk):
  >>> slots = Slots(base=Decoder(cache_length=S), decoders=(ngram_decoder,))
  >>> state, pstates = slots.prefill(model, pparams, empty_inputs)        # B placeholder rows, done
  >>> state, pstates = slots.insert(model, pparams, state, pstates, 0, request_inputs)
  >>> state = slots.release(state, 0)
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from typing import Any, Callable, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct
from jaxtyping import Array, Bool, Int

from specjax import sharding
from specjax.core import constraint
from specjax.core.constraint import Pool, PoolSpec
from specjax.core.decoder import decode_program
from specjax.core.decoder import Decoder, Inputs, State, Stats
from specjax.core.logprobs import Logprobs
from specjax.models.transformer import Transformer
from specjax.core.state import AnyArray, DecodeState, insert_row, rows_map
from specjax.telemetry import SpecCounters


@struct.dataclass
class HostView:
    """What the host reads of a batch after a chunk or an insert, read back in one transfer (device
    arrays inside the view program, numpy after `jax.device_get`)."""

    tokens: Int[AnyArray, "B S"]
    lengths: Int[AnyArray, "B"]
    done: Bool[AnyArray, "B"]
    row_forwards: Int[AnyArray, "B"]
    forwards: Int[AnyArray, ""]
    stats: Stats | None = None
    logprobs: Logprobs | None = None  # the rows' recorded log-probabilities (`Decoder.logprobs`), or None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Slots:
    """The static description of a batch's slot operations (hashable: a static jit argument).

    Attributes:
      base: the plain decoder: the shared decode state (cache length, sampling, shared method state).
      decoders: one decoder per speculative option, in the order of the proposer states (each with
        the base's cache length).
    """

    base: Decoder
    decoders: tuple[Decoder, ...] = ()

    def __post_init__(self):
        bad = [d for d in self.decoders if d.cache_length != self.base.cache_length]
        if bad:
            raise ValueError(f"every option's decoder must have the base's cache_length "
                             f"{self.base.cache_length}, got {bad[0].cache_length}")
        if any(d.mesh != self.base.mesh for d in self.decoders):
            raise ValueError("every option's decoder must run on the base's mesh (Decoder.mesh)")
        if any(d.logprobs != self.base.logprobs for d in self.decoders):
            raise ValueError("every option's decoder must record the base's logprobs (Decoder.logprobs)")

    @property
    def window(self) -> int:
        """The widest verify window of the options: every one writes into the shared cache."""
        return max(d.window for d in (self.base, *self.decoders))

    @property
    def mesh(self):
        """The mesh every option's decoder runs on (None: one device)."""
        return self.base.mesh

    @property
    def bare(self) -> Decoder:
        """The plain decoder without the methods' upkeep: the batch-shared method state is carried
        but sees none of its commits (a constraint pool still masks). What a host runs while
        speculation does not pay: a plain step that costs what the plain loop alone costs."""
        return dataclasses.replace(self.base, shared=())

    def prefill(self, model: Transformer, pparams: tuple, inputs: Inputs,
                parts: dict | None = None) -> tuple[DecodeState, tuple]:
        """Prefills the rows once for every option: the shared decode state, and each option's
        proposer state from the same target pass. `parts`: the batch-shared method state the
        prompts are shown to (None: empty)."""
        state, hidden = self.base.prefill_target(model, inputs, parts, window=self.window)
        pstates = tuple(d.init_proposer(pp, state, inputs, hidden) for d, pp in zip(self.decoders, pparams))
        return self._pinned((state, pstates))

    def _pinned(self, tree):
        """`tree` in the loop carry's layout on this mesh."""
        return sharding.constrain_carry(tree, self.mesh)

    def insert(self, model: Transformer, pparams: tuple, state: DecodeState, pstates: tuple,
               slot: Int[Array, ""], inputs: Inputs) -> tuple[DecodeState, tuple]:
        """Prefills one request (a batch of one at the batch's cache length) into row `slot`; the
        other rows and the batch's step counter do not change, and the batch-shared method state
        (the n-gram table, token recycling's matrix) sees the request's prompt."""
        row, new = self.prefill(model, pparams, inputs, parts=state.shared.parts)
        state = insert_row(state, row, slot)
        state = state.replace(shared=state.shared.replace(parts=row.shared.parts))
        return self._pinned((state, tuple(insert_row(ps, n, slot) for ps, n in zip(pstates, new))))

    def insert_bare(self, model: Transformer, state: DecodeState, slot: Int[Array, ""],
                    inputs: Inputs) -> DecodeState:
        """`insert` by the bare decoder (`bare`): the target's prefill alone. The batch-shared state
        does not see the prompt and no proposer state is built: row `slot` keeps its previous
        proposer states, stale, so a host runs only `bare` or plain chunks while the row runs."""
        row, _ = self.bare.prefill_target(model, inputs, state.shared.parts, window=self.window)
        return self._pinned(insert_row(state, row, slot))

    def upload(self, state: DecodeState, slot: Int[Array, ""], one: Pool) -> DecodeState:
        """Puts the packed constraint `one` (`PoolSpec.pack`) into pool slot `slot` of the batch's
        constraint pool (`specjax.core.constraint`); a request inserted with that slot is masked by it.
        Rows that use the slot's previous constraint must be done (the host keeps track)."""
        pool = constraint.upload(state.shared.parts[PoolSpec.name], slot, one)
        return self._pinned(state.replace(shared=state.shared.replace(parts={**state.shared.parts, PoolSpec.name: pool})))

    def release(self, state: DecodeState, slot: Int[Array, ""]) -> DecodeState:
        """Marks row `slot` done (a cancelled request): the loop spends no more steps on it."""
        return self._pinned(state.replace(done=state.done.at[slot].set(True)))

    def move(self, state: DecodeState, pstates: Any, src: Int[Array, ""],
             dst: Int[Array, ""]) -> tuple[DecodeState, Any]:
        """Moves row `src` (the decode state and every proposer state) to row `dst` and leaves `src`
        done: keeps the running rows packed at the front, so a chunk can run on the smallest batch
        that holds them (`take`)."""
        take = lambda tree: rows_map(lambda x: x[src][None], tree)
        state, pstates = insert_row(state, take(state), dst), insert_row(pstates, take(pstates), dst)
        return self._pinned((state.replace(done=state.done.at[src].set(True)), pstates))

    def take(self, state: DecodeState, pstate: Any, size: int) -> tuple[DecodeState, Any]:
        """The first `size` rows of the state and of one option's proposer state (the batch's
        `Shared` part whole)."""
        head = lambda tree: rows_map(lambda x: x[:size], tree)
        return self._pinned((head(state), head(pstate)))

    def put(self, state: DecodeState, pstate: Any, sub: DecodeState, sub_pstate: Any) -> tuple[DecodeState, Any]:
        """Writes a chunk run on the first rows (`take`) back into the batch, with the steps it ran
        and the shared method state it updated."""
        put = lambda big, small: big.at[: small.shape[0]].set(small)
        state = rows_map(put, state, sub, shared_from=1)
        return self._pinned((state, rows_map(put, pstate, sub_pstate)))

    def view(self, state: DecodeState, stats: Stats | None = None) -> HostView:
        """What the host needs of the batch (tokens, lengths, done, forwards, the chunk's counters),
        replicated on the mesh: every process reads every row."""
        view = HostView(tokens=state.tokens, lengths=state.lengths, done=state.done,
                        row_forwards=state.row_forwards, forwards=state.forwards, stats=stats,
                        logprobs=state.logprobs)
        return sharding.constrain_replicated(view, self.mesh)


# ---- jitted programs (compiled by `Engine.program`, donating the batch) -------------------------


@functools.partial(jax.jit, static_argnames=("graphdef", "slots"))
def prefill_program(graphdef, params, pparams, inputs: Inputs, *, slots: Slots):
    return slots.prefill(nnx.merge(graphdef, params), pparams, inputs)


@functools.partial(jax.jit, static_argnames=("graphdef", "slots"), donate_argnames=("state", "pstates"))
def insert_program(graphdef, params, pparams, state, pstates, slot, inputs: Inputs, *, slots: Slots):
    return slots.insert(nnx.merge(graphdef, params), pparams, state, pstates, slot, inputs)


@functools.partial(jax.jit, static_argnames=("graphdef", "slots"), donate_argnames=("state",))
def insert_bare_program(graphdef, params, state, slot, inputs: Inputs, *, slots: Slots):
    return slots.insert_bare(nnx.merge(graphdef, params), state, slot, inputs)


@functools.partial(jax.jit, static_argnames=("slots",), donate_argnames=("state",))
def upload_program(state, slot, one: Pool, *, slots: Slots):
    return slots.upload(state, slot, one)


@functools.partial(jax.jit, static_argnames=("slots",), donate_argnames=("state",))
def release_program(state, slot, *, slots: Slots):
    return slots.release(state, slot)


@functools.partial(jax.jit, static_argnames=("slots",), donate_argnames=("state", "pstates"))
def move_program(state, pstates, src, dst, *, slots: Slots):
    return slots.move(state, pstates, src, dst)


@functools.partial(jax.jit, static_argnames=("size", "slots"))
def take_program(state, pstate, *, size: int, slots: Slots):
    return slots.take(state, pstate, size)


@functools.partial(jax.jit, static_argnames=("slots",), donate_argnames=("state", "pstate"))
def put_program(state, pstate, sub, sub_pstate, *, slots: Slots):
    return slots.put(state, pstate, sub, sub_pstate)


@functools.partial(jax.jit, static_argnames=("slots",))
def view_program(state, stats, *, slots: Slots):
    return slots.view(state, stats)


# ---- a running batch: the state, its compiled programs and the host's copy --------------------

Compiler = Callable[..., tuple[Any, float]]
"""How a `RunningBatch` compiles: `Engine.program(fn, static, *args, weights=, **statics)`, which
returns the compiled program and the seconds spent (so that the host counts every program)."""


@dataclasses.dataclass(frozen=True)
class Chunk:
    """One chunk as the host reads it: the view after it (numpy; `stats` has the chunk's `size`
    rows), each row's length before it, and the batch's steps it ran."""

    view: HostView
    before: np.ndarray
    steps: int

    def new_tokens(self, row: int) -> list[int]:
        """The tokens row `row` committed in this chunk."""
        return self.view.tokens[row, self.before[row]: self.view.lengths[row]].tolist()

    def counters(self, row: int) -> SpecCounters:
        """Row `row`'s speculation counters over this chunk (empty past the chunk's rows)."""
        if row >= self.view.stats.drafted.shape[0]:
            return SpecCounters()
        return SpecCounters.from_stats(self.view.stats, row)


BARE = "bare"
"""A running batch's name for the bare plain loop (`Slots.bare`: no method upkeep), beside None (the
plain loop that feeds the batch-shared state) and each speculative option's index."""


class BatchEngine(Protocol):
    """What a continuous-batching host drives (`specjax.serving.scheduler.Scheduler`): a batch in flight
    and its operations, every program compiled before the first request. `RunningBatch` is the one
    this library builds (`specjax.serving.options.OptionSet.build`); a test may give its own.
    Options are the batch's names for them (None: plain; `BARE`: plain without upkeep)."""

    state: DecodeState
    pstates: tuple
    pparams: tuple
    compile_s: float

    def compile_insert(self, inputs: Inputs) -> Any: ...  # the insert at the bucket of `inputs`

    def warm_inserts(self) -> None: ...

    def insert(self, slot: int, inputs: Inputs, *, bare: bool = False) -> HostView: ...  # into row `slot`

    def upload(self, pool_slot: int, tables) -> None: ...  # a constraint's tables into the pool

    def release(self, slot: int) -> None: ...

    def move(self, src: int, dst: int) -> None: ...

    def run(self, o: int | str | None, steps: int, *, size: int | None = None) -> Chunk: ...

    def fork(self, inputs: Inputs) -> "BatchEngine": ...  # the same programs on other rows

    def reset(self) -> HostView: ...  # every row a placeholder, done


class RunningBatch:
    """A batch in flight for a continuous-batching host (`specjax.serving.scheduler`): the shared decode
    state and one proposer state per speculative option, the compiled slot operations and loops,
    and the host's copy of each row's length and of the batch's step counter.

    Every program compiles here, through `compile` (`Engine.program`, so a host counts them): the
    empty batch, release, move, take / put and one loop per option and batch size, the views, and
    an insert per prompt bucket (`compile_insert`). After that no operation compiles. Each
    operation donates the state and reads the host view back in one transfer, so a host needs no
    other read and runs on a mesh as on one device. Not thread-safe (donation): one thread steps it.

    Options are indices into `slots.decoders`, None for the plain loop (the base decoder) and `BARE`
    for the plain loop without upkeep (`Slots.bare`). With `BARE` among the loops every prompt bucket
    also compiles a bare insert (`insert(bare=True)`): the target's prefill alone.

    Args:
      slots: the static slot operations.
      params: the target's weights (every weight-reading program's first argument).
      pparams: each speculative option's proposer params, on the mesh, in `slots.decoders`' order.
      compile: the compiler (`Engine.program`).
      empty: B placeholder rows, done at once (`max_new_tokens=1`): the empty batch; fixes B.
      loops: the options whose loops compile (None: plain; `BARE`: plain without upkeep).
      sizes: the batch sizes a chunk may run at (the first rows only: `take` / `put`); B always.
    """

    def __init__(self, slots: Slots, *, params, pparams: tuple, compile: Compiler, empty: Inputs,
                 loops: tuple[int | str | None, ...], sizes: tuple[int, ...] = ()):
        self.slots, self.params, self.pparams, self._compiler = slots, params, tuple(pparams), compile
        self.b = int(empty.prompts.shape[0])
        self.sizes = tuple(sorted(set(sizes) | {self.b}))
        self.loops = tuple(loops)
        self.compile_s = 0.0
        self._empty = self.place(empty)
        self._prefill = self._compile(prefill_program, self.pparams, self._empty, slots=slots)
        self.state, self.pstates = self._prefill(self.params, self.pparams, self._empty)
        self._views = {None: self._compile(view_program, self.state, None, weights=False, slots=slots)}
        self.read()
        self._release = self._compile(release_program, self.state, np.int32(0), weights=False, slots=slots)
        spec = slots.base.constraints
        self._upload = None if spec is None else self._compile(
            upload_program, self.state, np.int32(1), self._packed(spec.init()), weights=False, slots=slots)
        self._move = (self._compile(move_program, self.state, self.pstates, np.int32(0), np.int32(0),
                                    weights=False, slots=slots) if len(self.sizes) > 1 else None)
        self._inserts: dict[int, tuple[Any, Inputs]] = {}
        self._bare_inserts: dict[int, Any] = {}
        self._takes, self._puts, self._loops = {}, {}, {}
        stop_at = sharding.abstract_carry(jax.ShapeDtypeStruct((), jnp.int32), self.mesh)
        for size in self.sizes:
            for o in self.loops:
                st, ps = self.state, self.pstate(o)
                if size != self.b:
                    self._takes[o, size] = self._compile(take_program, st, ps, size=size, weights=False, slots=slots)
                    st, ps = jax.eval_shape(functools.partial(take_program, size=size, slots=slots), st, ps)
                    st, ps = sharding.abstract_carry((st, ps), self.mesh)  # eval_shape drops shardings
                    self._puts[o, size] = self._compile(put_program, self.state, self.pstate(o), st, ps,
                                                        weights=False, slots=slots)
                s = State(decode=st, proposer=ps, stats=self._zero_stats(o, size))
                self._loops[o, size] = self._compile(decode_program, self.pp(o), s, stop_at,
                                                     static=self.decoder(o))
                self._views[o, size] = self._compile(view_program, self.state, s.stats, weights=False, slots=slots)

    @property
    def window(self) -> int:
        """The widest verify window of the options: every one writes into the shared cache."""
        return max(d.window for d in (self.base, *self.decoders))

    @property
    def mesh(self):
        return self.slots.mesh

    def decoder(self, o: int | str | None) -> Decoder:
        return self.slots.base if o is None else self.slots.bare if o == BARE else self.slots.decoders[o]

    def pp(self, o: int | str | None):
        """Option `o`'s proposer params (None for plain)."""
        return self.pparams[o] if isinstance(o, int) else None

    def pstate(self, o: int | str | None):
        """Option `o`'s proposer state (None for plain)."""
        return self.pstates[o] if isinstance(o, int) else None

    def place(self, tree):
        """Host rows (inputs, counters) on the mesh by the carry's layout: split over `data` where the
        rows divide it, else replicated (a request's batch-of-one prefill); as is without a mesh."""
        if self.mesh is None:
            return tree
        return jax.tree.map(sharding.put, tree, sharding.carry_shardings(tree, self.mesh))

    def _zero_stats(self, o: int | str | None, size: int) -> Stats:
        return self.place(Stats.zeros(size, self.decoder(o).depth, self.decoder(o).nodes))

    def _compile(self, fn, *args, static=None, **statics):
        prog, seconds = self._compiler(fn, static, *args, **statics)
        self.compile_s += seconds
        return prog

    # ---- operations --------------------------------------------------------------------------
    def read(self, stats: Stats | None = None, *, key=None) -> HostView:
        """The host view of the batch (and of a chunk's counters), in one replicated transfer; it
        also refreshes `lengths` and `forwards`, the host's copy."""
        view = jax.device_get(self._views[key](self.state, stats))
        self.lengths, self.forwards = view.lengths.copy(), int(view.forwards)
        return view

    def reset(self) -> HostView:
        """An empty batch: every row a placeholder, done (the shared method state starts empty)."""
        self.state, self.pstates = self._prefill(self.params, self.pparams, self._empty)
        return self.read()

    def fork(self, inputs: Inputs) -> "RunningBatch":
        """A second batch of the same programs, prefilled from `inputs` (B rows; the shapes of the
        empty batch's): what a host times its options on without touching this one."""
        other = copy.copy(self)
        other.state, other.pstates = self._prefill(self.params, self.pparams, self.place(inputs))
        other.read()
        return other

    def compile_insert(self, inputs: Inputs):
        """Compiles the insert of a request at the prompt bucket of `inputs` (a batch of one, kept to
        warm the program with: `warm_inserts`), and its bare insert with `BARE` among the loops;
        returns the program."""
        bucket = int(inputs.prompts.shape[1])
        if bucket not in self._inserts:
            inputs = self.place(inputs)
            prog = self._compile(insert_program, self.pparams, self.state, self.pstates, np.int32(0), inputs,
                                 slots=self.slots)
            self._inserts[bucket] = (prog, inputs)
            if BARE in self.loops:
                self._bare_inserts[bucket] = self._compile(insert_bare_program, self.state, np.int32(0), inputs,
                                                           slots=self.slots)
        return self._inserts[bucket][0]

    @property
    def insert_buckets(self) -> list[int]:
        return sorted(self._inserts)

    def insert(self, slot: int, inputs: Inputs, *, bare: bool = False) -> HostView:
        """Prefills a request (a batch of one) into row `slot`; returns the view (its first token is
        `tokens[slot, lengths[slot] - 1]`). Compiles the bucket's insert if `compile_insert` did not.
        `bare`: the bare insert (`Slots.insert_bare`; needs `BARE` among the loops): the row then
        runs only plain and `BARE` chunks until it is done."""
        prog = self.compile_insert(inputs)
        if bare:
            if BARE not in self.loops:
                raise ValueError("a bare insert needs the bare loop: build the batch with BARE among its loops")
            bucket = int(inputs.prompts.shape[1])
            self.state = self._bare_inserts[bucket](self.params, self.state, np.int32(slot), self.place(inputs))
        else:
            self.state, self.pstates = prog(self.params, self.pparams, self.state, self.pstates, np.int32(slot),
                                            self.place(inputs))
        return self.read()

    def warm_inserts(self) -> None:
        """Runs each compiled insert (and bare insert) once into row 0 with the placeholder it was
        compiled on (done at once with max_new_tokens 1, contributing nothing to shared method state):
        first-run costs (allocation, caches) stay out of the first requests. Call it on an empty batch."""
        for bucket in self.insert_buckets:
            self.insert(0, self._inserts[bucket][1])
            if bucket in self._bare_inserts:
                self.insert(0, self._inserts[bucket][1], bare=True)
        jax.block_until_ready(self.state)

    @staticmethod
    def _packed(pool: Pool) -> Pool:
        """A one-slot pool of the shapes `PoolSpec.pack` gives (numpy)."""
        return Pool(**{f: np.asarray(getattr(pool, f))[:1] for f in ("token_class", "next_state", "accepting", "forced")})

    def upload(self, pool_slot: int, tables) -> None:
        """Puts a constraint's tables (`specjax.constrain.TokenTables`) into pool slot `pool_slot`
        (1..capacity) of the batch's constraint pool; insert requests with `constraint=pool_slot`.

        Raises:
          ValueError: the batch carries no pool, the slot is not one of it, or the tables do not fit.
        """
        spec = self.slots.base.constraints
        if spec is None:
            raise ValueError("this batch carries no constraint pool: build its decoders with Decoder(constraints=PoolSpec(...))")
        if not 1 <= pool_slot <= spec.capacity:
            raise ValueError(f"constraint pool slot {pool_slot}: must be in [1, {spec.capacity}]")
        one = spec.pack(np.asarray(tables.token_class), np.asarray(tables.next_state), np.asarray(tables.accepting),
                        None if tables.forced is None else np.asarray(tables.forced))
        self.state = self._upload(self.state, np.int32(pool_slot), self.place(one))

    def release(self, slot: int) -> None:
        """Marks row `slot` done (a cancelled request)."""
        self.state = self._release(self.state, np.int32(slot))

    def move(self, src: int, dst: int) -> None:
        """Moves row `src` to row `dst` (packing; needs more than one batch size)."""
        self.state, self.pstates = self._move(self.state, self.pstates, np.int32(src), np.int32(dst))
        self.lengths[dst] = self.lengths[src]

    def run(self, o: int | str | None, steps: int, *, size: int | None = None) -> Chunk:
        """Runs option `o` on the first `size` rows (default: all) until the batch's step counter has
        gone `steps` further or every row is done; returns what the host reads of it."""
        size = size or self.b
        before, start = self.lengths.copy(), self.forwards
        st, ps = self.state, self.pstate(o)
        if size != self.b:
            st, ps = self._takes[o, size](st, ps)
        s = State(decode=st, proposer=ps, stats=self._zero_stats(o, size))
        s = self._loops[o, size](self.params, self.pp(o), s, np.int32(start + steps))
        if size != self.b:
            self.state, ps = self._puts[o, size](self.state, self.pstate(o), s.decode, s.proposer)
        else:
            self.state, ps = s.decode, s.proposer
        if isinstance(o, int):
            self.pstates = self.pstates[:o] + (ps,) + self.pstates[o + 1:]
        view = self.read(s.stats, key=(o, size))
        return Chunk(view=view, before=before, steps=int(view.forwards) - start)
