"""The cache coordinator: decode state (the while-loop carry) and the commits every path shares.

Invariant: row b has committed `lengths[b]` tokens (prompt + generated) in `tokens[b]`; the
cache holds K/V for positions `< lengths[b] - 1`. The last committed token is fed at the next
step, at position `lengths[b] - 1`, alone (plain) or followed by K drafts (speculative).

A `DecodeState` is per-row arrays (batch-leading) plus one `Shared` part that belongs to the batch:
its step counter and the methods' batch-shared state (`specjax.core.shared`: the cross-request
n-gram table, token recycling's matrix), which persists across the requests a running batch serves.
Slot operations (`rows_map`, `insert_row`) move rows and never slice the shared part; the Decoder
updates it after every commit (`specjax.core.shared.update`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jaxtyping import Array, Bool, Float, Int, Key

from specjax.core import tree
from specjax.core.logprobs import Logprobs, scored
from specjax.models.kv_cache import KVCache
from specjax.core.ngram_table import NgramTable, TableConfig
from specjax.core.sampling import SamplingParams

# A state's arrays: on device, or their numpy copies in a host view (`engine.Batch.view`).
AnyArray = Array | np.ndarray


@struct.dataclass
class Shared:
    """What the rows of a batch share: the batch's step counter and each method's shared state."""

    forwards: Int[AnyArray, ""]  # target forward passes after prefill (loop control)
    parts: dict = struct.field(default_factory=dict)  # name -> arrays of a `specjax.core.shared.SharedSpec`


@struct.dataclass
class DecodeState:
    tokens: Int[AnyArray, "B S"]  # token at each position: prompt, then generated
    lengths: Int[AnyArray, "B"]  # committed tokens per row
    prompt_lengths: Int[AnyArray, "B"]
    max_new: Int[AnyArray, "B"]  # per-row budget of new tokens
    done: Bool[AnyArray, "B"]
    cache: KVCache | None  # None (and sampling, keys) only in a host view (engine.Batch.view)
    sampling: SamplingParams | None
    stop_ids: Int[AnyArray, "B E"]  # per-row stop tokens, padded with -1
    keys: Key[Array, "B"] | None  # PRNG keys, one stream per row
    row_forwards: Int[AnyArray, "B"]  # target forwards while each row was still active
    shared: Shared  # the batch's part: step counter and the methods' shared state
    contribute: Bool[AnyArray, "B"] | None = None  # rows whose text may enter shared state (None: all)
    tenant: Int[AnyArray, "B"] | None = None  # each row's scope of shared state (None: tenant 0)
    constraint: Int[AnyArray, "B"] | None = None  # each row's slot in the constraint pool (0: free)
    automaton: Int[AnyArray, "B"] | None = None  # its automaton state after the committed tokens
    logprobs: Logprobs | None = None  # each committed token's log-probabilities (None: not recorded)

    @property
    def forwards(self) -> Int[AnyArray, ""]:
        return self.shared.forwards

    @property
    def table(self) -> NgramTable | None:
        """The cross-request n-gram table, when the batch carries one."""
        return self.shared.parts.get(TableConfig.name)

    @property
    def num_new(self) -> Int[AnyArray, "B"]:
        return self.lengths - self.prompt_lengths

    @property
    def capacity(self) -> int:
        return self.tokens.shape[1]


def step_keys(state: DecodeState, salt: int = 0) -> Array:
    """Per-row keys for this step: row key folded with the row's position and a salt.

    Keys depend on a row's own position, not on its batch neighbours or on the step count,
    so a row samples the same stream whatever batch it is in.
    """
    fold = lambda k, p: jax.random.fold_in(jax.random.fold_in(k, p), salt)
    return jax.vmap(fold)(state.keys, state.lengths)


def last_tokens(state: DecodeState) -> Int[Array, "B"]:
    """The committed token not yet in the cache (fed at position lengths - 1)."""
    return jnp.take_along_axis(state.tokens, state.lengths[:, None] - 1, axis=1)[:, 0]


def is_stop(tokens: Int[Array, "B W"], stop_ids: Int[Array, "B E"]) -> Bool[Array, "B W"]:
    return jnp.any(tokens[:, :, None] == stop_ids[:, None, :], axis=-1)


def commit(
    state: DecodeState, new: Int[Array, "B W"], num: Int[Array, "B"], window: int,
    scores: Logprobs | None = None,
) -> tuple[DecodeState, Int[Array, "B"]]:
    """Appends the first `num[b]` tokens of `new[b]` to each active row (and their `scores`, when the
    state records log-probabilities).

    Cuts the row at its first stop token (kept) and at its max_new budget, then marks rows
    done that stopped, spent their budget, or have no room left for another `window`-token
    step. Returns the new state and how many tokens each row actually took.
    """
    w = new.shape[1]
    j = jnp.arange(w)[None, :]
    stop = is_stop(new, state.stop_ids) & (j < num[:, None])
    first_stop = jnp.where(stop.any(axis=1), jnp.argmax(stop, axis=1) + 1, w)
    budget = state.max_new - state.num_new
    take = jnp.minimum(jnp.minimum(num, first_stop), budget)
    take = jnp.where(state.done, 0, jnp.maximum(take, 0))
    cols = state.lengths[:, None] + j
    rows = jnp.arange(new.shape[0])[:, None]
    kept = j < take[:, None]

    def put(buf, vals):  # buf [B, S, ...] gets vals [B, W, ...] at the taken columns
        tail = (1,) * (buf.ndim - 2)
        old = jnp.take_along_axis(buf, jnp.minimum(cols, state.capacity - 1).reshape(cols.shape + tail), axis=1)
        return buf.at[rows, cols].set(jnp.where(kept.reshape(kept.shape + tail), vals, old), mode="drop")

    tokens = put(state.tokens, new)
    logprobs = state.logprobs
    if logprobs is not None:
        if scores is None:
            raise ValueError("this state records log-probabilities: give commit the new tokens' scores (scores_of)")
        logprobs = jax.tree.map(put, logprobs, scores)
    lengths = state.lengths + take
    stopped = (stop & kept).any(axis=1)
    done = (
        state.done
        | stopped
        | (lengths - state.prompt_lengths >= state.max_new)
        | (lengths + window > state.capacity)
    )
    return state.replace(tokens=tokens, lengths=lengths, done=done, logprobs=logprobs), take


def scores_of(state: DecodeState, logits: Float[Array, "B W V"], tokens: Int[Array, "B W"]) -> Logprobs | None:
    """What `commit` records of `tokens` drawn from `logits` (None when the state records nothing)."""
    return None if state.logprobs is None else scored(logits, tokens, state.logprobs.top)


def tick(state: DecodeState) -> DecodeState:
    """Counts one target forward: the batch's, and each still-active row's."""
    return state.replace(shared=state.shared.replace(forwards=state.shared.forwards + 1),
                         row_forwards=state.row_forwards + (~state.done).astype(jnp.int32))


def commit_path(state: DecodeState, cache: KVCache, nodes: Int[Array, "B K"], accepted,
                topo: tree.AnyTopology, logits: Float[Array, "B W V"] | None = None) -> DecodeState:
    """Commits a verified window: the accepted path's tokens and K/V, then the next token (with their
    log-probabilities under the window's `logits`, when the state records them).

    `cache` is the verify pass's cache (K/V written at window slots). For a tree the accepted
    path's K/V move to consecutive slots (`KVCache.compact`); a chain's path already is consecutive.
    Nothing is rolled back: slots past the new length are never attended and get overwritten.
    """
    b = nodes.shape[0]
    window = jnp.concatenate([last_tokens(state)[:, None], nodes], axis=1)
    new = jnp.take_along_axis(window, accepted.path, axis=1)[:, 1:]  # the path's drafts [B, A]
    new = jnp.concatenate([new, accepted.next[:, None]], axis=1)
    new = new.at[jnp.arange(b), accepted.n].set(accepted.next)  # right after the kept prefix
    # token i of `new` was drawn from the logits at the path's slot i
    if logits is not None:
        logits = jnp.take_along_axis(logits, jnp.maximum(accepted.path, 0)[..., None], axis=1)
    scores = None if logits is None else scores_of(state, logits, new)
    if not topo.is_chain:
        cache = cache.compact(state.lengths - 1, accepted.path)
    state = tick(state.replace(cache=cache))
    return commit(state, new, accepted.n + 1, window=topo.width, scores=scores)[0]


def rows_map(fn, batch, *others, shared_from: int = 0):
    """`fn(leaf, *other_leaves)` over every per-row leaf of `batch` (batch-leading); a decode state's
    `Shared` part is never sliced: it is taken whole from `(batch, *others)[shared_from]`, and
    scalars elsewhere (a proposer's) keep `batch`'s values."""
    trees = (batch,) + others

    def leaf(x, *o):
        if isinstance(x, Shared):
            return (x, *o)[shared_from]
        return fn(x, *o) if x.ndim else x

    return jax.tree.map(leaf, *trees, is_leaf=lambda x: isinstance(x, Shared))


def insert_row(batch, row, slot: Int[Array, ""]):
    """Row `slot` of every batch-leading leaf of `batch` takes row 0 of the same leaf of `row`.

    The batch's `Shared` part (step counter, shared method state) is kept. This is
    what continuous batching needs: a request prefilled alone is scattered into a running batch;
    other rows do not move.
    """
    return rows_map(lambda big, small: big.at[slot].set(small[0]), batch, row)
