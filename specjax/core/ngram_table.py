"""N-gram lookups on device: in a row's own context (`match`, prompt lookup), and in a
cross-request table: hashed n-gram -> the tokens that followed it.

Prompt lookup sees only a row's own text. Structured answers (configuration files, lists, code)
repeat what earlier answers said, so the loop state can carry a fixed-size table that every
committed token of every row updates, inside the jitted loop, and that a row consults when its own
context has no match. The scheduler keeps the table across requests (a slot refill leaves it
alone), so a request benefits from the answers before it.

Layout: `size` slots, each holding an n-gram (`max_n` token ids, left-padded with -1 for shorter n)
and the `width` tokens that followed it. An n-gram's slot is a multiplicative hash of its tokens
and n; a later write to the same slot evicts the earlier one (most recent wins). A write happens
once the n-gram's `width` followers are all committed: a step that commits positions p covers the
n-grams ending at p - width. Writes are resolved deterministically when one step writes a slot
twice (the later position wins, then the higher row), so the table is a function of the committed
text alone. Rows whose request opted out (`contribute` false) never write.

Tenancy: each row carries a tenant id (0 when none is given). An entry records the tenant that
wrote it (`owner`), the slot hash is salted with it, and a row reads only entries of its own
tenant: one tenant's text is never proposed to another. A server that means to share the table
gives every row the same tenant.

Every id the table holds is a committed token, or -1 in an empty key (never equal to a real
n-gram, so an empty slot's zero followers are never read): drafts from the table are in the
vocabulary by construction.

Drafts read from the table are a function of committed text (this row's and other rows'), never of
this step's randomness, so greedy output stays identical to plain decoding and sampling stays
lossless with the one-hot rule, whatever the table holds (collisions and eviction included).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp
import numpy as np
from flax import struct
from jaxtyping import Array, Bool, Int

from specjax import sharding
from specjax.core.shared import Observed

_MULT = np.uint32(0x9E3779B1)  # Knuth's multiplicative constant (golden ratio * 2^32)
_SALT = np.uint32(0x85EBCA6B)  # murmur3's mixing constant: spreads tenants over the slots


@dataclasses.dataclass(frozen=True, kw_only=True)
class TableConfig:
    """Static shape of the table: slots, followers kept per n-gram, n-gram lengths. A
    `specjax.core.shared.SharedSpec`: the batch's part named "ngram_table", written after every commit."""

    name: ClassVar[str] = "ngram_table"
    top_k: ClassVar[int] = 0  # it reads committed text only
    size: int = 1 << 16
    width: int = 8
    min_n: int = 2
    max_n: int = 3

    def __post_init__(self):
        if int(self.size) != self.size or self.size < 1:
            raise ValueError(f"n-gram table size={self.size}: must be an integer >= 1")
        if not 1 <= self.width <= 16:
            raise ValueError(f"n-gram table width={self.width}: must be in [1, 16]")
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"n-gram table n range [{self.min_n}, {self.max_n}]: need 1 <= min_n <= max_n")

    @property
    def nbytes(self) -> int:
        return self.size * (self.max_n + self.width + 1) * 4

    def init(self) -> "NgramTable":
        return NgramTable.empty(self)

    def update(self, table: "NgramTable", seen: Observed) -> "NgramTable":
        """Writes the n-grams whose followers this commit completed (see `add`)."""
        take = seen.after.lengths - seen.before.lengths
        return add(table, seen.after.tokens, seen.before.lengths, take, seen.width, seen.contribute, seen.tenant)

    def merge(self, other: "TableConfig") -> "TableConfig":
        """One table for both: the larger size and width, the wider range of n."""
        return TableConfig(size=max(self.size, other.size), width=max(self.width, other.width),
                           min_n=min(self.min_n, other.min_n), max_n=max(self.max_n, other.max_n))


@struct.dataclass
class NgramTable(sharding.Logical):
    keys: Int[Array, "Z Ng"]  # the n-gram, left-padded with -1; all -1 = empty
    follow: Int[Array, "Z Kf"]  # the tokens that followed it
    owner: Int[Array, "Z"] | None = None  # the tenant that wrote it (None: tenant 0 everywhere)
    min_n: int = struct.field(pytree_node=False, default=2)

    def logical_axes(self):
        return dict(keys=(), follow=(), owner=())  # shared by every row: replicated

    @classmethod
    def empty(cls, config: TableConfig) -> "NgramTable":
        return cls(keys=jnp.full((config.size, config.max_n), -1, jnp.int32),
                   follow=jnp.zeros((config.size, config.width), jnp.int32),
                   owner=jnp.zeros((config.size,), jnp.int32), min_n=config.min_n)

    @property
    def size(self) -> int:
        return self.keys.shape[0]

    @property
    def max_n(self) -> int:
        return self.keys.shape[1]

    @property
    def width(self) -> int:
        return self.follow.shape[1]


def _slot(grams: Int[Array, "... Ng"], n: int, size: int, tenant=None) -> Int[Array, "..."]:
    """Hash of the last n tokens of each gram (and of n, and of the tenant) to a slot."""
    h = jnp.full(grams.shape[:-1], np.uint32((n * int(_MULT)) % (1 << 32)), jnp.uint32)
    if tenant is not None:  # tenant 0 hashes as no tenant
        h = h ^ (jnp.broadcast_to(tenant, h.shape).astype(jnp.uint32) * _SALT)
    for i in range(grams.shape[-1] - n, grams.shape[-1]):
        h = (h ^ grams[..., i].astype(jnp.uint32)) * _MULT
    return ((h >> 7) % np.uint32(size)).astype(jnp.int32)


def _padded(grams: Int[Array, "... Ng"], n: int) -> Int[Array, "... Ng"]:
    """The key of the last n tokens: earlier columns set to -1."""
    col = jnp.arange(grams.shape[-1]).reshape((1,) * (grams.ndim - 1) + (-1,))
    return jnp.where(col >= grams.shape[-1] - n, grams, -1)


def add(table: NgramTable, tokens: Int[Array, "B S"], old_lengths: Int[Array, "B"], take: Int[Array, "B"],
        width_new: int, contribute: Bool[Array, "B"], tenant: Int[Array, "B"] | None = None) -> NgramTable:
    """Writes the n-grams whose followers the commit of `take` tokens at `old_lengths` completed,
    each in its row's tenant's scope (`tenant`, default 0 for every row)."""
    b, s = tokens.shape
    w, nmax = table.width, table.max_n
    j = jnp.arange(width_new)[None, :]
    pos = old_lengths[:, None] + j  # newly committed positions [B, J]
    end = pos - w  # the n-gram ends here; its followers are end + 1 .. pos
    gather = lambda cols: jnp.take_along_axis(tokens, jnp.clip(cols, 0, s - 1).reshape(b, -1), axis=1).reshape(cols.shape)
    grams = gather(end[..., None] - nmax + 1 + jnp.arange(nmax)[None, None, :])  # [B, J, Ng]
    follow = gather(end[..., None] + 1 + jnp.arange(w)[None, None, :])  # [B, J, W]
    tenant = jnp.zeros((b,), jnp.int32) if tenant is None else tenant.astype(jnp.int32)
    keys, slots, ok = [], [], []
    for n in range(table.min_n, nmax + 1):
        keys.append(_padded(grams, n))
        slots.append(_slot(grams, n, table.size, tenant[:, None]))
        ok.append((j < take[:, None]) & (end - n + 1 >= 0) & contribute[:, None])
    keys, slots, ok = (jnp.stack(x, axis=2) for x in (keys, slots, ok))  # [B, J, n's, ...]
    nn = slots.shape[2]
    # a unique priority per write: the later position wins, then the higher row, then the longer n
    prio = (j[:, :, None] * b + jnp.arange(b)[:, None, None]) * nn + jnp.arange(nn)[None, None, :] + 1
    order = jnp.where(ok, prio, 0).reshape(-1)
    follow = jnp.broadcast_to(follow[:, :, None], slots.shape + (w,)).reshape(-1, w)
    owner = jnp.broadcast_to(tenant[:, None, None], slots.shape).reshape(-1)
    slots, ok, keys = slots.reshape(-1), ok.reshape(-1), keys.reshape(-1, nmax)
    best = jnp.zeros((table.size,), jnp.int32).at[slots].max(order)
    win = ok & (best[slots] == order)
    target = jnp.where(win, slots, table.size)  # losers write out of range: dropped
    owners = jnp.zeros((table.size,), jnp.int32) if table.owner is None else table.owner
    return table.replace(keys=table.keys.at[target].set(keys, mode="drop"),
                         follow=table.follow.at[target].set(follow, mode="drop"),
                         owner=owners.at[target].set(owner, mode="drop"))


def lookup(table: NgramTable, tokens: Int[Array, "B S"], lengths: Int[Array, "B"], k: int,
           tenant: Int[Array, "B"] | None = None):
    """(drafts [B, k], found [B]): the followers of the row's longest n-gram found in the table
    among its tenant's entries (`tenant`, default 0 for every row)."""
    b, s = tokens.shape
    if k > table.width:
        raise ValueError(f"prompt lookup k={k} exceeds the n-gram table's width {table.width}")
    cols = jnp.clip(lengths[:, None] - table.max_n + jnp.arange(table.max_n)[None, :], 0, s - 1)
    grams = jnp.take_along_axis(tokens, cols, axis=1)  # the row's last max_n tokens [B, Ng]
    draft = jnp.zeros((b, k), jnp.int32)
    found = jnp.zeros((b,), bool)
    tenant = jnp.zeros((b,), jnp.int32) if tenant is None else tenant.astype(jnp.int32)
    owners = jnp.zeros((table.size,), jnp.int32) if table.owner is None else table.owner
    for n in range(table.max_n, table.min_n - 1, -1):
        slot = _slot(grams, n, table.size, tenant)
        hit = jnp.all(table.keys[slot] == _padded(grams, n), axis=-1) & (lengths >= n) & ~found
        hit &= owners[slot] == tenant
        draft = jnp.where(hit[:, None], table.follow[slot, :k], draft)
        found |= hit
    return draft, found


def match(tokens: Int[Array, "B S"], lengths: Int[Array, "B"], k: int, min_n: int, max_n: int):
    """(drafts [B, k], found [B]): prompt lookup in each row's own committed tokens.

    For n from `max_n` down to `min_n`, the most recent earlier occurrence of the row's last n
    tokens; its k followers (clamped to the committed text, so every draft is a committed token).
    The first n with a match wins; without one a row proposes its last token k times.
    """
    b, s = tokens.shape
    rows = jnp.arange(b)[:, None]
    last = jnp.take_along_axis(tokens, lengths[:, None] - 1, axis=1)
    draft = jnp.broadcast_to(last, (b, k))
    found = jnp.zeros((b,), bool)
    for n in range(max_n, min_n - 1, -1):
        m = s - n + 1  # candidate starts i = 0 .. s-n
        suffix = jnp.take_along_axis(tokens, jnp.maximum(lengths[:, None] - n + jnp.arange(n)[None, :], 0), axis=1)
        hit_at = jnp.ones((b, m), bool)
        for j in range(n):
            hit_at &= tokens[:, j: j + m] == suffix[:, j: j + 1]
        i = jnp.arange(m)[None, :]
        # an earlier occurrence: it must end before the suffix itself starts repeating it
        hit_at &= (i + n <= lengths[:, None] - 1) & (lengths[:, None] >= n)
        best = jnp.max(jnp.where(hit_at, i, -1), axis=1)
        hit = (best >= 0) & ~found
        cols = jnp.minimum(best[:, None] + n + jnp.arange(k)[None, :], lengths[:, None] - 1)
        cand = tokens[rows, jnp.maximum(cols, 0)]
        draft = jnp.where(hit[:, None], cand, draft)
        found |= hit
    return draft, found
