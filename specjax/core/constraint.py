"""Structured-answer constraints on device: a batch-shared pool of token automata, and the masks.

A constraint (a regex, a JSON schema, a choice) is compiled on the host into a deterministic automaton
over token classes (`specjax.constrain`): `token_class[V]` (tokens with the same transition from every
state share a class), `next_state[S, C]` (-1: not allowed) and `accepting[S]`. A batch carries a
fixed-capacity pool of them (`PoolSpec`, a `specjax.core.shared.SharedSpec` named "constraint"), padded
to static sizes, so one compiled program serves every constraint; a host uploads a constraint into a
pool slot (`upload`) before inserting a request that uses it.

Each row carries its pool slot (`DecodeState.constraint`; 0 is the free slot, whose automaton has one
accepting state that allows every token) and its automaton state after its committed tokens
(`DecodeState.automaton`). The decoder masks the target's logits at every position it samples or
verifies, the bonus position included, in the plain loop too: the state at a window slot is the state
after the drafts on the path to it (`walk`), so position i's mask reads the drafts before i. A masked
token has logit `NEG_INF`: greedy argmax never picks it and its probability is 0 under every sampling
filter, so the lossless acceptance rules accept the drafts a constrained plain loop could emit and
draw corrections from the masked target distribution. Nothing is rolled back: an automaton state is a
function of the committed prefix.

Stop tokens end an answer, so a row's stop ids are allowed exactly in accepting states. A position
whose state is -1 (after a draft the automaton refuses: never on a kept path) allows every token, and
a dead state (not accepting and allowing no token: the compiler prunes them, hand-built tables may
hold one) allows the row's stop ids, so no row is ever all `NEG_INF`: such an answer ends at a stop
token in a state that does not accept it, and the host reports it (`telemetry.StopReason.
CONSTRAINT_UNMET`, `met`).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp
import numpy as np
from flax import struct
from jaxtyping import Array, Bool, Float, Int

from specjax.core import tree
from specjax.core.sampling import NEG_INF
from specjax.core.shared import Observed

FREE = 0  # the pool slot of an unconstrained row
AnyArray = Array | np.ndarray  # a pool on device, or one constraint packed on the host (`PoolSpec.pack`)


@struct.dataclass
class Pool:
    """The batch's automata: slot 0 free, slots 1..capacity the uploaded constraints (Cs = capacity + 1 slots,
    Sa automaton states, Ca token classes, Kc forced tokens per state)."""

    token_class: Int[AnyArray, "Cs V"]
    next_state: Int[AnyArray, "Cs Sa Ca"]  # int16: -1 not allowed
    accepting: Bool[AnyArray, "Cs Sa"]
    forced: Int[AnyArray, "Cs Sa Kc"]  # tokens the automaton forces from each state (-1 padded)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PoolSpec:
    """Static shape of the pool: a `specjax.core.shared.SharedSpec` (the batch's part "constraint").

    Attributes:
      vocab: V, the target's vocabulary (its logits' width).
      capacity: constraints the batch holds at once (slots 1..capacity; slot 0 is the free one).
      states: S, the most automaton states of one constraint.
      classes: C, the most token classes of one constraint.
      forced: F, the most forced tokens kept per state (the `forced` method's drafts).
    """

    name: ClassVar[str] = "constraint"
    top_k: ClassVar[int] = 0  # it reads no scores
    vocab: int
    capacity: int = 4
    states: int = 1024
    classes: int = 512
    forced: int = 8

    def __post_init__(self):
        for f in ("vocab", "capacity", "states", "classes", "forced"):
            v = getattr(self, f)
            if isinstance(v, bool) or int(v) != v or v < 1:
                raise ValueError(f"constraint pool {f}={v}: must be an integer >= 1")
        if self.states > np.iinfo(np.int16).max or self.classes > np.iinfo(np.int16).max:
            raise ValueError(f"constraint pool states={self.states}, classes={self.classes}: at most 32767 each "
                             "(the tables are int16)")

    @property
    def nbytes(self) -> int:
        g = self.capacity + 1
        return g * (self.vocab * 4 + self.states * self.classes * 2 + self.states + self.states * self.forced * 4)

    def init(self) -> Pool:
        """Every slot free: one accepting state, every token (class 0) back to it."""
        g = self.capacity + 1
        nxt = np.full((g, self.states, self.classes), -1, np.int16)
        nxt[:, 0, 0] = 0
        acc = np.zeros((g, self.states), bool)
        acc[:, 0] = True
        return Pool(token_class=jnp.zeros((g, self.vocab), jnp.int32), next_state=jnp.asarray(nxt),
                    accepting=jnp.asarray(acc), forced=jnp.full((g, self.states, self.forced), -1, jnp.int32))

    def update(self, pool: Pool, seen: Observed) -> Pool:
        """The pool is written by `upload` only; commits move the rows' own states."""
        return pool

    def merge(self, other: "PoolSpec") -> "PoolSpec":
        if other.vocab != self.vocab:
            raise ValueError(f"two constraint pools over vocabularies of {self.vocab} and {other.vocab} tokens")
        return dataclasses.replace(self, **{f: max(getattr(self, f), getattr(other, f))
                                            for f in ("capacity", "states", "classes", "forced")})

    def pack(self, token_class: np.ndarray, next_state: np.ndarray, accepting: np.ndarray,
             forced: np.ndarray | None = None) -> Pool:
        """One constraint's tables padded to this pool's sizes (numpy, a pool of one slot, for `upload`).

        Raises:
          ValueError: the constraint is larger than the pool, or its vocabulary wider than the target's.
        """
        s, c = next_state.shape
        if s > self.states or c > self.classes:
            raise ValueError(f"the constraint has {s} automaton states and {c} token classes; the pool holds at "
                             f"most {self.states} and {self.classes}: simplify it, or size the pool larger "
                             "(PoolSpec(states=..., classes=...))")
        if len(token_class) > self.vocab:
            raise ValueError(f"the constraint was compiled over {len(token_class)} tokens, the target has "
                             f"{self.vocab}: compile it with the target's tokenizer")
        tc = np.zeros((1, self.vocab), np.int32)
        tc[0, : len(token_class)] = token_class
        nxt = np.full((1, self.states, self.classes), -1, np.int16)
        nxt[0, :s, :c] = next_state
        acc = np.zeros((1, self.states), bool)
        acc[0, :s] = accepting
        ff = np.full((1, self.states, self.forced), -1, np.int32)
        if forced is not None:
            n = min(forced.shape[1], self.forced)
            ff[0, :s, :n] = forced[:, :n]
        return Pool(token_class=tc, next_state=nxt, accepting=acc, forced=ff)


def upload(pool: Pool, slot: Int[Array, ""], one: Pool) -> Pool:
    """`pool` with slot `slot` holding the packed constraint `one` (`PoolSpec.pack`)."""
    return Pool(**{f.name: getattr(pool, f.name).at[slot].set(getattr(one, f.name)[0])
                   for f in dataclasses.fields(Pool)})


def _slots(slot: Int[Array, "B"], like: Array) -> Array:
    """`slot` shaped to broadcast against a `[B, ...]` array."""
    return slot.reshape(slot.shape + (1,) * (like.ndim - 1))


def advance(pool: Pool, slot: Int[Array, "B"], state: Int[Array, "B *W"], token: Int[Array, "B *W"]) -> Int[Array, "B *W"]:
    """The automaton state after `token` from `state` in each row's constraint (-1: not allowed, or
    `state` is -1)."""
    v = pool.token_class.shape[1]
    g = _slots(slot, state)
    cls = pool.token_class[g, jnp.clip(token, 0, v - 1)]
    nxt = pool.next_state[g, jnp.maximum(state, 0), cls].astype(jnp.int32)
    return jnp.where((state >= 0) & (token >= 0) & (token < v), nxt, -1)


def walk(pool: Pool, slot: Int[Array, "B"], state: Int[Array, "B"], nodes: Int[Array, "B K"], topo) -> Int[Array, "B W"]:
    """The automaton state at every window slot: the root's is `state`, a node's the state after its
    token from its parent's (one level of the tree per pass; a chain is a tree of depth K)."""
    root = state[:, None]
    states = jnp.broadcast_to(root, (nodes.shape[0], nodes.shape[1] + 1))
    for _ in range(topo.max_depth):
        states = jnp.concatenate([root, advance(pool, slot, tree.at_parents(states, topo), nodes)], axis=1)
    return states


def allowed(pool: Pool, slot: Int[Array, "B"], states: Int[Array, "B W"], stop_ids: Int[Array, "B E"]) -> Bool[Array, "B W V"]:
    """The tokens each row may take at each window slot: its automaton's, with the row's stop ids
    allowed exactly in accepting states; every token where the state is -1."""
    b, v = slot.shape[0], pool.token_class.shape[1]
    g = slot[:, None]
    rows = pool.next_state[g, jnp.maximum(states, 0)] >= 0  # [B, W, C]
    classes = pool.token_class[slot]  # [B, V]
    ok = jnp.take_along_axis(rows, jnp.broadcast_to(classes[:, None, :], states.shape + (v,)), axis=2)
    stops = jnp.zeros((b, v), bool).at[jnp.arange(b)[:, None], jnp.where(stop_ids >= 0, stop_ids, v)].set(
        True, mode="drop")
    accepting = pool.accepting[g, jnp.maximum(states, 0)]  # [B, W]
    ok = jnp.where(stops[:, None, :], accepting[..., None], ok)
    # a dead state (live, but nothing allowed: a constraint the vocabulary cannot finish) ends the
    # answer: its stop ids (every token for a row without one) instead of an all-NEG_INF row
    dead = ~ok.any(axis=-1, keepdims=True) & (states >= 0)[..., None]  # [B, W, 1]
    ends = stops | ~stops.any(axis=-1, keepdims=True)  # [B, V]
    ok = jnp.where(dead, ends[:, None, :], ok)
    return ok | (states < 0)[..., None]


def met(tables, tokens: list[int], stop_ids) -> bool:
    """Whether an answer `tokens` (its stop token last, if it ended at one) walks the host tables
    `tables` (`specjax.constrain.TokenTables`, or any with `token_class`, `next_state`, `accepting`;
    start state 0) to an accepting state. False for an answer that ended in a dead state."""
    stops = {int(t) for t in stop_ids if t >= 0}
    body = tokens[:-1] if tokens and tokens[-1] in stops else tokens
    state, v = 0, len(tables.token_class)
    for t in body:
        if state < 0 or not 0 <= t < v:
            return False
        state = int(tables.next_state[state, tables.token_class[t]])
    return state >= 0 and bool(tables.accepting[state])


def mask(pool: Pool, slot: Int[Array, "B"], states: Int[Array, "B W"], stop_ids: Int[Array, "B E"],
         logits: Float[Array, "B W V"]) -> Float[Array, "B W V"]:
    """`logits` with the tokens `allowed` refuses set to `NEG_INF`."""
    ok = allowed(pool, slot, states, stop_ids)
    return jnp.where(ok, logits, jnp.asarray(NEG_INF, logits.dtype))
