"""Token recycling's memory: the target's top-k after each token, kept in the batch's shared state.

Every verify step computes the target's whole distribution at every window position and keeps one
token of it. Token recycling (Luo et al., 2024, arXiv 2408.08696) keeps the rest: `first[v]` holds
the `k` tokens the target ranked highest the last time it scored a position holding token v, and
drafts are read from it by gathers (`specjax.methods.recycle.proposer`). Here, beside it, a
second-order table holds the top-k after the last two tokens (hashed `(prev, cur)`, like the
n-gram table), read first.

Writes (`RecycleSpec.update`, after every commit, `specjax.core.shared`): every scored position of
every active, contributing row, rejected window nodes included, and every prompt position at
prefill. Duplicate keys in one commit resolve deterministically: the accepted path beats rejected
nodes, then the later position, then the higher row (`shared.winners`).

Scope: tenant t writes matrix `t % tenants` and tags each row (and table entry) with t; a row reads
only entries its own tenant wrote, else the warm start (`RecycleParams`, read-only, from the model's
own answers to public prompts: no tenant's text). So one tenant's text never drafts for another.

Every stored row comes whole from one `lax.top_k`, so its k tokens are distinct: siblings drafted
from one row never repeat a token (what the lossless tree rule needs).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp
import numpy as np
from flax import struct
from jaxtyping import Array, Int

from specjax import sharding
from specjax.core.shared import Observed, winners

_M1, _M2, _SALT = np.uint32(0x9E3779B1), np.uint32(0x7FEB352D), np.uint32(0x85EBCA6B)


def pair_slot(prev: Array, cur: Array, tenant: Array, size: int) -> Array:
    """The second-order table's slot of `(prev, cur)` in `tenant`'s scope (tenant 0: no salt)."""
    h = prev.astype(jnp.uint32) * _M1 + cur.astype(jnp.uint32)
    h = h ^ (tenant.astype(jnp.uint32) * _SALT)
    h = (h ^ (h >> 16)) * _M2
    h = (h ^ (h >> 15)) * _M1
    return ((h ^ (h >> 16)) % np.uint32(size)).astype(jnp.int32)


@struct.dataclass
class RecycleState(sharding.Logical):
    """The live matrix and second-order table (batch-shared, replicated on a mesh)."""

    first: Int[Array, "T V K"]  # per tenant scope: the top-k after each token
    first_owner: Int[Array, "T V"]  # the tenant that wrote the row (-1: none)
    keys: Int[Array, "Z 2"]  # (prev, cur) of each second-order entry (-1: empty)
    owner: Int[Array, "Z"]
    second: Int[Array, "Z K"]

    def logical_axes(self):
        return dict(first=(), first_owner=(), keys=(), owner=(), second=())


@struct.dataclass
class RecycleParams(sharding.Logical):
    """The warm start, read-only (the proposer's params): the matrix and second-order table written
    by `specjax warm-recycle` from the target's own answers, or placeholders (cold)."""

    first: Int[Array, "V Kt"]
    keys: Int[Array, "Z 2"]
    second: Int[Array, "Z Kt"]

    def logical_axes(self):
        return dict(first=(), keys=(), second=())

    @classmethod
    def cold(cls, vocab: int, k: int) -> "RecycleParams":
        """No warm start: every row the distinct placeholder tokens 0..k-1, no second-order entry."""
        return cls(first=jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (vocab, k)),
                   keys=jnp.full((1, 2), -1, jnp.int32), second=jnp.zeros((1, k), jnp.int32))

    @property
    def k(self) -> int:
        return self.first.shape[1]


@dataclasses.dataclass(frozen=True, kw_only=True)
class RecycleSpec:
    """The shape of the live state: a `specjax.core.shared.SharedSpec` named "recycle".

    Attributes:
      vocab: V, the target's vocabulary.
      k: candidates per token (the target's top-k read at each scored position).
      order: 2 keeps the second-order table; 1 the matrix alone.
      table: Z, the second-order table's slots.
      tenants: T, matrices side by side (tenant t uses `t % T`).
    """

    name: ClassVar[str] = "recycle"
    vocab: int
    k: int = 8
    order: int = 2
    table: int = 1 << 16
    tenants: int = 1

    @property
    def top_k(self) -> int:
        return self.k

    @property
    def slots(self) -> int:
        return self.table if self.order == 2 else 1

    @property
    def nbytes(self) -> int:
        return 4 * (self.tenants * self.vocab * (self.k + 1) + self.slots * (self.k + 3))

    def init(self) -> RecycleState:
        t, v, k, z = self.tenants, self.vocab, self.k, self.slots
        return RecycleState(first=jnp.zeros((t, v, k), jnp.int32), first_owner=jnp.full((t, v), -1, jnp.int32),
                            keys=jnp.full((z, 2), -1, jnp.int32), owner=jnp.full((z,), -1, jnp.int32),
                            second=jnp.zeros((z, k), jnp.int32))

    def merge(self, other: "RecycleSpec") -> "RecycleSpec":
        if other.vocab != self.vocab:
            raise ValueError(f"two recycling matrices of vocabularies {self.vocab} and {other.vocab} in one batch")
        return RecycleSpec(vocab=self.vocab, k=max(self.k, other.k), order=max(self.order, other.order),
                           table=max(self.table, other.table), tenants=max(self.tenants, other.tenants))

    def update(self, state: RecycleState, seen: Observed) -> RecycleState:
        """Writes the target's top-k at every position `seen` scored (see the module docstring)."""
        b, w = seen.scored.shape
        t, v, k = self.tenants, self.vocab, self.k
        top = seen.top[..., :k].reshape(b * w, k)
        tenant = jnp.broadcast_to(seen.tenant[:, None], (b, w)).reshape(-1)
        prio = (seen.order * b + jnp.arange(b)[:, None] + 1).reshape(-1)
        ok = seen.mask.reshape(-1)
        cur, prev = seen.scored.reshape(-1), seen.prev.reshape(-1)
        row = (tenant % t) * v + jnp.clip(cur, 0, v - 1)
        at = winners(row, prio, ok, t * v)
        first = state.first.reshape(t * v, k).at[at].set(top, mode="drop").reshape(t, v, k)
        first_owner = state.first_owner.reshape(-1).at[at].set(tenant, mode="drop").reshape(t, v)
        state = state.replace(first=first, first_owner=first_owner)
        if self.order == 1:
            return state
        z = self.slots
        at = winners(pair_slot(prev, cur, tenant, z), prio, ok & (prev >= 0), z)
        return state.replace(keys=state.keys.at[at].set(jnp.stack([prev, cur], axis=-1), mode="drop"),
                             owner=state.owner.at[at].set(tenant, mode="drop"),
                             second=state.second.at[at].set(top, mode="drop"))

    def rows(self, state: RecycleState, warm: RecycleParams, prev: Int[Array, "B N"], cur: Int[Array, "B N"],
             tenant: Int[Array, "B"]) -> Int[Array, "B N K"]:
        """The k candidates after each `(prev, cur)` (prev -1: unknown), for the row's tenant: its
        own second-order entry, else the warm one, else its own matrix row, else the warm row."""
        t = (tenant % self.tenants)[:, None]
        ten = tenant[:, None]
        cur = jnp.clip(cur, 0, self.vocab - 1)
        own = state.first_owner[t, cur] == ten
        out = jnp.where(own[..., None], state.first[t, cur], warm.first[cur, : self.k])
        if self.order == 1:
            return out
        pair = jnp.stack([prev, cur], axis=-1)
        ws = pair_slot(prev, cur, jnp.zeros_like(prev), warm.keys.shape[0])
        hit = (prev >= 0) & jnp.all(warm.keys[ws] == pair, axis=-1)
        out = jnp.where(hit[..., None], warm.second[ws, : self.k], out)
        ls = pair_slot(prev, cur, jnp.broadcast_to(ten, prev.shape), self.slots)
        hit = (prev >= 0) & jnp.all(state.keys[ls] == pair, axis=-1) & (state.owner[ls] == ten)
        return jnp.where(hit[..., None], state.second[ls], out)
