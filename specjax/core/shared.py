"""Batch-shared method state: what a method declares, and what the core shows it after every commit.

Some methods learn from every row of a batch and keep what they learned across requests: prompt
lookup's cross-request n-gram table (`specjax.core.ngram_table`), token recycling's matrix of the
target's top-k predictions (`specjax.methods.recycle`). Such a method declares a `SharedSpec` (its
proposer's `shared`): a static, hashable description of

- its arrays (`init`): they live in the decode state's `Shared` part under the spec's `name`, are
  never sliced by a slot operation, and persist in a running batch across requests;
- its update (`update`): after each commit (a verify step, a plain step, a prefill) the core hands
  it one `Observed`: the committed text before and after, and the positions the target scored with
  the tokens it ranked highest there (`top_k` of them, when the spec asks for any);
- its scope per tenant: rows carry `contribute` (may their text enter shared state; the core
  clears `Observed.mask` where not) and `tenant` (whose scope they read and write): a spec keys what
  it stores by tenant, so one tenant's text never drafts for another;
- its size (`nbytes`), which hosts report.

A host that runs several options over one batch (the scheduler) gives every option's decoder the
union of their specs (`union`), so that every option's state has the same structure; two options
that declare the same `name` are merged (`merge`: the wider of the two).

Whatever a spec stores is a function of committed text and of the target's distributions at scored
positions, never of a step's own random draws, so drafts read from it are deterministic given the
context: greedy output stays equal to plain decoding and the lossless rules stay lossless.
"""

from __future__ import annotations

from typing import Any, Iterable, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, Bool, Int


@struct.dataclass
class Observed:
    """What one commit shows the batch's shared state (`SharedSpec.update`).

    W scored positions per row: a verify window (the pending token, then the drafted nodes), the
    one token of a plain step, or the prompt at prefill.
    """

    before: Any  # the rows' DecodeState before the commit (lengths: where new text starts)
    after: Any  # after it (tokens, lengths, contribute, tenant)
    scored: Int[Array, "B W"]  # the token at each position the target scored
    prev: Int[Array, "B W"]  # the token before it in its context (-1: none)
    mask: Bool[Array, "B W"]  # real positions of active, contributing rows
    order: Int[Array, "B W"]  # priority among a row's positions (higher wins a duplicate key)
    top: Int[Array, "B W Kt"] | None = None  # the target's top-Kt tokens at each scored position
    width: int = struct.field(pytree_node=False, default=1)  # the most tokens one row committed

    @property
    def tenant(self) -> Int[Array, "B"]:
        """Each row's scope (0 when the state carries none)."""
        t = self.after.tenant
        return jnp.zeros(self.after.lengths.shape, jnp.int32) if t is None else t.astype(jnp.int32)

    @property
    def contribute(self) -> Bool[Array, "B"]:
        c = self.after.contribute
        return jnp.ones(self.after.lengths.shape, bool) if c is None else c


@runtime_checkable
class SharedSpec(Protocol):
    """A method's batch-shared state, declared (static and hashable: it shapes the program).

    Attributes:
      name: its key in `Shared.parts`; two specs of one name describe one part (`merge`).
      top_k: how many of the target's top tokens it reads at each scored position (0: none).
    """

    name: str
    top_k: int

    def init(self) -> Any: ...  # the empty arrays (a pytree; a `sharding.Logical` on a mesh)

    def update(self, arrays: Any, seen: Observed) -> Any: ...

    def merge(self, other: "SharedSpec") -> "SharedSpec": ...

    @property
    def nbytes(self) -> int: ...


def union(specs: Iterable[SharedSpec]) -> tuple[SharedSpec, ...]:
    """One spec per name (merged), in name order: what every option of one batch carries."""
    out: dict[str, SharedSpec] = {}
    for s in specs:
        out[s.name] = s if s.name not in out else out[s.name].merge(s)
    return tuple(out[n] for n in sorted(out))


def covers(given: Iterable[SharedSpec], needed: Iterable[SharedSpec]) -> None:
    """Raises ValueError unless every spec in `needed` is in `given`, as wide or wider."""
    by_name = {s.name: s for s in given}
    for s in needed:
        if s.name not in by_name or by_name[s.name].merge(s) != by_name[s.name]:
            have = by_name.get(s.name)
            raise ValueError(f"the proposer reads shared state {s!r}, but the decoder carries {have!r}: give "
                             "Decoder(shared=...) the union of its options' specs (specjax.core.shared.union)")


def init(specs: Iterable[SharedSpec]) -> dict[str, Any]:
    return {s.name: s.init() for s in specs}


def update(specs: Iterable[SharedSpec], parts: dict[str, Any], seen: Observed) -> dict[str, Any]:
    """Every part after the commit `seen` shows (a part without a spec here is kept as it is)."""
    out = dict(parts)
    for s in specs:
        out[s.name] = s.update(parts[s.name], seen)
    return out


def top_k_needed(specs: Iterable[SharedSpec]) -> int:
    return max([s.top_k for s in specs], default=0)


def top_k(logits: Array, k: int) -> Int[Array, "... K"]:
    """The k highest tokens of each distribution, best first (ties: the lower id first)."""
    return jax.lax.top_k(logits, k)[1].astype(jnp.int32)


def chunked_top_k(head, hidden: Array, k: int, chunk: int = 64) -> Int[Array, "B T K"]:
    """`top_k(head(hidden), k)` over positions in chunks of `chunk`, so that the logits of a long
    prompt (`[B, T, V]`) are never all in memory at once."""
    b, t, d = hidden.shape
    c = min(chunk, t)
    n = -(-t // c)
    pad = jnp.pad(hidden, ((0, 0), (0, n * c - t), (0, 0)))
    parts = pad.reshape(b, n, c, d).transpose(1, 0, 2, 3)  # [n, B, c, D]
    tops = jax.lax.map(lambda h: top_k(head(h), k), parts)  # [n, B, c, K]
    return tops.transpose(1, 0, 2, 3).reshape(b, n * c, k)[:, :t]


def winners(slots: Int[Array, "N"], priority: Int[Array, "N"], ok: Bool[Array, "N"], size: int) -> Int[Array, "N"]:
    """Where each of N writes goes: its slot if it is the highest-priority `ok` write to that slot,
    else `size` (out of range: a scatter with mode="drop" skips it). Priorities must be unique and
    > 0 among `ok` writes, so one step's duplicate writes resolve the same way on every run."""
    order = jnp.where(ok, priority, 0)
    best = jnp.zeros((size,), jnp.int32).at[slots].max(order)
    return jnp.where(ok & (best[slots] == order), slots, size)
