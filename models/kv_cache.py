"""Position-indexed KV cache with a kind per layer: an explicit pytree carried through the decode loop.

A global layer's buffer has one slot per position: slot `s` of a row holds the key/value of the
token at absolute slot `s` (its position, for committed tokens). A forward over a window of T tokens
writes slots `start .. start+T-1` of each row at that row's own offset. There is no batch-wide write
index and nothing to roll back: a rejected speculative suffix is simply overwritten by the next step.

A local (sliding-window) layer's queries see only the last W positions (the query's own included).
Its buffer is the same full buffer, or, when the model builds the cache with `window=` (the widest
forward that writes into it after its prefill), a ring of `Sr = W - 1 + window` entries: absolute
slot `s` lives at entry `s % Sr`, and `ring_slots[b, j]` records which absolute slot entry j holds
(-1: none yet). Its memory is proportional to W, not to the context.

Every forward reads before it writes (`Access`): the T new tokens attend each other directly
(causal, or a tree's `window_mask`) and the cache only for committed context, the slots before the
row's window start. So stale entries past a row's length (a rejected draft, a prompt's padding) are
never attended, and a ring never needs to hold the window it is writing. Why a ring stays exact when
a speculative window straddles its boundary: a window of T <= `window` tokens at `start` overwrites
the entries of absolute slots `start - Sr .. start + T - 1 - Sr`, all below `start - W + 1`, the
oldest position any later query can see (the next window starts after `start`); rejected tokens sit
at slots >= the next window's start, which the mask excludes until a kept token overwrites them.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, Bool, Float, Int

from specjax import sharding
from specjax.models.config import AttnKind, ModelConfig

_NEG = -1e30  # a masked score (as before the softmax; exp underflows to 0 in float32)


@struct.dataclass
class KVCache(sharding.Logical):
    """Per-layer key and value buffers: `[B, S, Kv, H]`, a ring layer's `[B, Sr, Kv, H]`.

    Models build theirs (`init_cache(batch, length, window=...)`); `length` (S) is the positions the
    cache serves, static.
    """

    k: tuple[Float[Array, "B _ Kv H"], ...]  # S slots, or a ring layer's Sr
    v: tuple[Float[Array, "B _ Kv H"], ...]
    length: int = struct.field(pytree_node=False)
    ring_slots: Int[Array, "B Sr"] | None = None  # the absolute slot each ring entry holds (-1: none)

    def logical_axes(self):
        kv = ("batch", "seq", "kv_heads", "head_dim")
        return dict(k=kv, v=kv, ring_slots=("batch", "seq"))

    @classmethod
    def zeros(cls, config: ModelConfig, batch: int, length: int, *, window: int | None = None) -> "KVCache":
        """An empty cache of `length` positions for `config`'s layers.

        `window`: the widest forward that will write into it after its prefill (a verify window);
        local layers then keep a ring of `sliding_window - 1 + window` entries instead of `length`
        (where that is shorter). None keeps full buffers everywhere (any forward may write).
        """
        if window is not None and window < 1:
            raise ValueError(f"window={window}: the widest forward writing into the cache, >= 1")
        ring = ring_length(config, length, window)
        sizes = [ring if (ring and config.kind(i) == AttnKind.LOCAL) else length for i in range(config.num_layers)]
        shape = lambda s: (batch, s, config.num_kv_heads, config.head_dim)
        dtype = config.compute_dtype
        return cls(k=tuple(jnp.zeros(shape(s), dtype) for s in sizes),
                   v=tuple(jnp.zeros(shape(s), dtype) for s in sizes), length=int(length),
                   ring_slots=jnp.full((batch, ring), -1, jnp.int32) if ring else None)

    @property
    def ring(self) -> int | None:
        """Entries of a local layer's ring (Sr), or None when every buffer is full."""
        return None if self.ring_slots is None else self.ring_slots.shape[1]

    def is_ring(self, layer: int) -> bool:
        return self.ring_slots is not None and self.k[layer].shape[1] != self.length

    @property
    def nbytes(self) -> int:
        slots = 0 if self.ring_slots is None else self.ring_slots.size * self.ring_slots.dtype.itemsize
        return sum(x.size * x.dtype.itemsize for x in self.k + self.v) + slots

    def compact(self, start: Int[Array, "B"], path: Int[Array, "B R"]) -> "KVCache":
        """Moves the K/V at window slots `start + path[:, d]` to slot `start + d`, in every layer
        (a tree's accepted path after verification; a chain's already is consecutive).

        Gathers and writes R slots per row and layer; nothing cache-sized is copied. Slots past the
        accepted depth receive junk that is never attended (beyond the length). A ring's entries of
        those slots were all written by this window (R <= its width <= `window`), so they keep their
        `ring_slots`.
        """
        src = start[:, None] + path  # absolute source slots [B, R]
        dst = start[:, None] + jnp.arange(path.shape[1], dtype=start.dtype)[None]

        def move(buf):
            n = buf.shape[1]
            if n == self.length:
                moved = jnp.take_along_axis(buf, src[:, :, None, None], axis=1)  # [B, R, Kv, H]
                return write(buf, moved, start)
            moved = jnp.take_along_axis(buf, (src % n)[:, :, None, None], axis=1)
            return buf.at[jnp.arange(buf.shape[0])[:, None], dst % n].set(moved)

        return self.replace(k=tuple(move(b) for b in self.k), v=tuple(move(b) for b in self.v))


def ring_length(config: ModelConfig, length: int, window: int | None) -> int | None:
    """A local layer's ring entries for a cache of `length` built for forwards of up to `window`
    tokens, or None when the full buffer is no longer (or the model has no local layers)."""
    if window is None or not config.local_layers:
        return None
    ring = config.sliding_window - 1 + int(window)
    return ring if ring < length else None


def write(
    buf: Float[Array, "B S Kv H"], new: Float[Array, "B T Kv H"], start: Int[Array, "B"]
) -> Float[Array, "B S Kv H"]:
    """Writes `new` into slots `start[b] .. start[b]+T-1` of each row of a full buffer.

    Callers guarantee `start + T <= S` (the loop stops when the cache is full);
    `dynamic_update_slice` would otherwise clamp the offset.
    """
    update = lambda b, n, s: jax.lax.dynamic_update_slice(b, n, (s, 0, 0))
    return jax.vmap(update)(buf, new.astype(buf.dtype), start)


def causal(batch: int, t: int) -> Bool[Array, "B T T"]:
    return jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (batch, t, t))


@dataclasses.dataclass(eq=False)
class Access:
    """What one forward's T queries read and where its keys go, per attention kind (built once per
    forward inside the trace; every layer of a kind shares its masks).

    Attributes:
      start: each row's window start (the first slot it writes); earlier slots are committed.
      positions: the queries' positions (= the new keys'), `[B, T]`.
      window: which new tokens each query sees (causal, or a tree's ancestors), `[B, T, T]`.
      length: the cache's positions S.
      sliding_window: W of the local layers (None: the model has none).
      ring_slots: the cache's ring bookkeeping before this forward (None: no rings).
      kept: how many of each row's new tokens are kept (a prompt's padding is not; None: all).
      context: which full-buffer slots each query sees, replacing "before `start`" (an EAGLE head's
        tree drafting reads scratch slots past the positions); global layers only.
    """

    start: Int[Array, "B"]
    positions: Int[Array, "B T"]
    window: Bool[Array, "B T T"]
    length: int
    sliding_window: int | None = None
    ring_slots: Int[Array, "B Sr"] | None = None
    kept: Int[Array, "B"] | None = None
    context: Bool[Array, "B T S"] | None = None
    _memo: dict = dataclasses.field(default_factory=dict, repr=False)  # one mask per kind, shared by its layers

    @classmethod
    def of(cls, cache: KVCache, config: ModelConfig, positions: Int[Array, "B T"], *,
           start: Int[Array, "B"] | None = None, window_mask: Bool[Array, "B T T"] | None = None,
           kept: Int[Array, "B"] | None = None, context: Bool[Array, "B T S"] | None = None) -> "Access":
        """The access of a model forward over `positions` into `cache` (see `Transformer.features`)."""
        b, t = positions.shape
        start = positions[:, 0] if start is None else start
        ring = cache.ring
        if ring is not None and kept is None and t > ring - config.sliding_window + 1:
            raise ValueError(
                f"a forward of {t} tokens into a cache whose local layers keep a ring of {ring} entries "
                f"(sliding window {config.sliding_window} + forwards of up to "
                f"{ring - config.sliding_window + 1}): build the cache with init_cache(..., window={t}) "
                "or more, or pass kept= for a prefill whose tokens are all committed")
        return cls(start=start, positions=positions, window=causal(b, t) if window_mask is None else window_mask,
                   length=cache.length, sliding_window=config.sliding_window if config.local_layers else None,
                   ring_slots=cache.ring_slots, kept=kept, context=context)

    # ---- what a query sees --------------------------------------------------------------------
    def _near(self, key_positions: Int[Array, "#B #T S"]) -> Bool[Array, "#B T S"]:
        """Keys within the sliding window of each query: `q - k < W`."""
        return self.positions[:, :, None] - key_positions < self.sliding_window

    def cache_mask(self, kind: AttnKind, ring: bool) -> Bool[Array, "#B #T S"]:
        """Which entries of a layer's buffer (before this forward's writes) each query sees
        (`[B, 1, S]` where that is the same for every query)."""
        return self._once(("cache", kind, ring), lambda: self._cache_mask(kind, ring))

    def _cache_mask(self, kind: AttnKind, ring: bool):
        if ring:
            slots = self.ring_slots[:, None, :]  # [B, 1, Sr]
            return (slots >= 0) & (slots < self.start[:, None, None]) & self._near(slots)
        slots = jnp.arange(self.length, dtype=self.start.dtype)[None, None, :]
        if self.context is not None:
            if kind == AttnKind.LOCAL:
                raise ValueError("a context mask reads scratch slots: it is for global layers only")
            return self.context
        committed = slots < self.start[:, None, None]
        return committed & self._near(slots) if kind == AttnKind.LOCAL else committed

    def cache_bounds(self, kind: AttnKind) -> tuple[Int[Array, "B T"], Int[Array, "B"]]:
        """`cache_mask` of a full buffer as slot bounds, `lo[b, t] <= slot < hi[b]`: the committed
        context, from the sliding window's first position for a local layer (the CPU attention
        kernel's form, `specjax.models.cpu_attention`), in slots: a ring holds slot s at entry
        s % Sr. Not for a `context` mask."""
        if kind == AttnKind.LOCAL:
            lo = jnp.maximum(self.positions - self.sliding_window + 1, 0)
        else:
            lo = jnp.zeros_like(self.positions)
        return lo.astype(jnp.int32), self.start.astype(jnp.int32)

    def new_mask(self, kind: AttnKind) -> Bool[Array, "B T T"]:
        """Which of this forward's new tokens each query sees."""
        if kind == AttnKind.GLOBAL:
            return self.window
        return self._once(("new", kind), lambda: self.window & self._near(self.positions[:, None, :]))

    # ---- where the keys go --------------------------------------------------------------------
    def write(self, buf: Float[Array, "B S Kv H"], new: Float[Array, "B T Kv H"], ring: bool):
        """`buf` with this forward's keys (or values) written: full buffers at slots `start + t`, a
        ring at entries `(start + t) % Sr` for the kept tokens (the last Sr of them)."""
        if not ring:
            return write(buf, new, self.start)
        rows = jnp.arange(buf.shape[0])[:, None]
        return buf.at[rows, self._ring_index(buf.shape[1])].set(new.astype(buf.dtype), mode="drop")

    def _ring_index(self, ring: int) -> Int[Array, "B T"]:
        """Entry of each new token in a ring of `ring` entries; `ring` (dropped) for one not kept."""
        def index():
            t = self.positions.shape[1]
            j = jnp.arange(t, dtype=self.start.dtype)[None]
            n = jnp.full_like(self.start, t) if self.kept is None else self.kept
            keep = (j < n[:, None]) & (j >= n[:, None] - ring)
            return jnp.where(keep, (self.start[:, None] + j) % ring, ring)
        return self._once(("ring_index", ring), index)

    def ring_slots_after(self) -> Int[Array, "B Sr"] | None:
        """The ring bookkeeping after this forward's writes."""
        if self.ring_slots is None:
            return None
        ring = self.ring_slots.shape[1]
        t = self.positions.shape[1]
        slots = jnp.broadcast_to(self.start[:, None] + jnp.arange(t, dtype=self.start.dtype)[None], (len(self.start), t))
        rows = jnp.arange(self.ring_slots.shape[0])[:, None]
        return self.ring_slots.at[rows, self._ring_index(ring)].set(slots, mode="drop")

    def _once(self, key, make):
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]
