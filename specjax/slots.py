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

Example (what `specjax.scheduler.Scheduler` does per request and per chunk):
  >>> slots = Slots(base=Decoder(cache_length=S), decoders=(ngram_decoder,))
  >>> state, pstates = slots.prefill(model, pparams, empty_inputs)        # B placeholder rows, done
  >>> state, pstates = slots.insert(model, pparams, state, pstates, 0, request_inputs)
  >>> state = slots.release(state, 0)
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
from flax import nnx, struct
from jaxtyping import Array, Bool, Int

from specjax import sharding
from specjax.core import Decoder, Inputs, Stats
from specjax.models.llama import Llama
from specjax.state import AnyArray, DecodeState, insert_row, rows_map


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


@dataclasses.dataclass(frozen=True, kw_only=True)
class Slots:
    """The static description of a batch's slot operations (hashable: a static jit argument).

    Attributes:
      base: the plain decoder: the shared decode state (cache length, sampling, n-gram table).
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

    @property
    def mesh(self):
        """The mesh every option's decoder runs on (None: one device)."""
        return self.base.mesh

    def prefill(self, model: Llama, pparams: tuple, inputs: Inputs) -> tuple[DecodeState, tuple]:
        """Prefills the rows once for every option: the shared decode state, and each option's
        proposer state from the same target pass."""
        state, hidden = self.base.prefill_target(model, inputs)
        pstates = tuple(d.init_proposer(pp, state, inputs, hidden) for d, pp in zip(self.decoders, pparams))
        return self._pinned((state, pstates))

    def _pinned(self, tree):
        """`tree` in the loop carry's layout on this mesh."""
        return sharding.constrain_carry(tree, self.mesh)

    def insert(self, model: Llama, pparams: tuple, state: DecodeState, pstates: tuple,
               slot: Int[Array, ""], inputs: Inputs) -> tuple[DecodeState, tuple]:
        """Prefills one request (a batch of one at the batch's cache length) into row `slot`; the
        other rows, the batch's step counter and the shared n-gram table do not change."""
        row, new = self.prefill(model, pparams, inputs)
        out = insert_row(state, row, slot), tuple(insert_row(ps, n, slot) for ps, n in zip(pstates, new))
        return self._pinned(out)

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
        """The first `size` rows of the state and of one option's proposer state (the shared
        n-gram table: the `Shared` part whole)."""
        head = lambda tree: rows_map(lambda x: x[:size], tree)
        return self._pinned((head(state), head(pstate)))

    def put(self, state: DecodeState, pstate: Any, sub: DecodeState, sub_pstate: Any) -> tuple[DecodeState, Any]:
        """Writes a chunk run on the first rows (`take`) back into the batch, with the steps it ran
        and the n-gram table it updated."""
        put = lambda big, small: big.at[: small.shape[0]].set(small)
        state = rows_map(put, state, sub, shared_from=1)
        return self._pinned((state, rows_map(put, pstate, sub_pstate)))

    def view(self, state: DecodeState, stats: Stats | None = None) -> HostView:
        """What the host needs of the batch (tokens, lengths, done, forwards, the chunk's counters),
        replicated on the mesh: every process reads every row."""
        view = HostView(tokens=state.tokens, lengths=state.lengths, done=state.done,
                        row_forwards=state.row_forwards, forwards=state.forwards, stats=stats)
        return sharding.constrain_replicated(view, self.mesh)


# ---- jitted programs (compiled by `Engine.program`, donating the batch) -------------------------


@functools.partial(jax.jit, static_argnames=("graphdef", "slots"))
def prefill_program(graphdef, params, pparams, inputs: Inputs, *, slots: Slots):
    return slots.prefill(nnx.merge(graphdef, params), pparams, inputs)


@functools.partial(jax.jit, static_argnames=("graphdef", "slots"), donate_argnames=("state", "pstates"))
def insert_program(graphdef, params, pparams, state, pstates, slot, inputs: Inputs, *, slots: Slots):
    return slots.insert(nnx.merge(graphdef, params), pparams, state, pstates, slot, inputs)


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
