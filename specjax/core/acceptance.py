"""Acceptance rules: keep a path of the drafted window and choose the token after it.

A rule is a frozen, hashable object chosen by the `specjax.Decoder` (static: it shapes the
program) that satisfies `AcceptanceRule`: `check(topology)` refuses a window shape the rule cannot
verify (when the Decoder is built), and `accept(window)` judges one verified `Window` (the drafts,
their q, the target's logits, the sampling values, keys and topology). Every rule answers
`Accepted(n, path, next)`: `path[:, d]` is the window slot of the
accepted node at depth d (slot 0 is the pending token; entries past `n` are junk), and `next` is
the token after it: the correction on a rejection, the bonus token when the whole path was kept.
A chain is the tree whose node i hangs under node i - 1, so one walk serves both.

Lossless rules (the output follows the target's distribution exactly):
- `Greedy`: exact match against the target's argmax (chain or tree); equals plain greedy decoding.
- `SpecInfer`: at the current node draw x ~ p; follow the child carrying x, else emit x. Every
  emitted token is a draw from p at its own prefix, so it is lossless for any drafts whose siblings
  are distinct tokens (Miao et al. 2024). On a chain it is the one-hot-q speculative rule.
- `Speculative`: Leviathan et al. 2023 with the draft's real q (chain only): accept x ~ q with
  probability min(1, p(x)/q(x)); on rejection draw from norm(max(0, p - q)). With q one-hot
  (deterministic drafts) it reduces to SpecInfer.

Lossy, only on request and named so: `TypicalAcceptance` (Medusa's typical acceptance).
Counts come from cumulative products and masks, so no shape depends on the data.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, Bool, Float, Int

from specjax.core import sampling
from specjax.core.sampling import Sampling, SamplingParams
from specjax.core import tree


@struct.dataclass
class Accepted:
    """What a rule kept: per row, drafts accepted, the path's window slots, the next token."""

    n: Int[Array, "B"]
    path: Int[Array, "B R"]
    next: Int[Array, "B"]

    @property
    def leaf(self) -> Int[Array, "B"]:
        """Window slot of the last accepted token (the root when nothing was accepted)."""
        return jnp.take_along_axis(self.path, self.n[:, None], axis=1)[:, 0]


@dataclasses.dataclass(frozen=True)
class Window:
    """What the verify step hands a rule: one step's drafted window and the target's logits on it."""

    sampling: Sampling  # the static sampling method (greedy or sampled)
    keys: Array  # [B] per-row PRNG keys for this step's acceptance
    nodes: Int[Array, "B K"]  # the drafted tokens (window slots 1..K)
    q: Float[Array, "B K V"] | None  # the distributions the drafts came from; None: one-hot
    logits: Float[Array, "B K+1 V"]  # the target's logits at the window's slots
    params: SamplingParams  # per-row sampling values
    topo: Any  # tree.AnyTopology: the window's shape (static, or traced per-row trees)


@runtime_checkable
class AcceptanceRule(Protocol):
    """The interface the `specjax.Decoder`'s verify step calls."""

    lossless: ClassVar[bool]  # whether the output follows the target's distribution exactly

    def check(self, topology: tree.AnyTopology) -> None:
        """Raise ValueError, saying what to use instead, when this rule cannot verify `topology`."""

    def accept(self, window: Window) -> Accepted:
        """The path of `window` kept and the token after it."""


class _AnyShape:
    """A rule that verifies chains and trees alike."""

    def check(self, topology: tree.AnyTopology) -> None:
        return None


def _count_prefix(ok: Array) -> Int[Array, "B"]:
    return jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)


def greedy(draft: Int[Array, "B K"], logits: Float[Array, "B K+1 V"]):
    """Chain exact match: drafts kept while they equal the target's argmax; returns (n, next)."""
    target = sampling.argmax(logits)  # [B, K+1]
    n = _count_prefix(draft == target[:, :-1])
    return n, jnp.take_along_axis(target, n[:, None], axis=1)[:, 0]


def speculative(keys: Array, draft: Int[Array, "B K"], q: Float[Array, "B K V"] | None,
                logits: Float[Array, "B K+1 V"], params: SamplingParams):
    """Lossless speculative sampling on a chain (Leviathan et al. 2023; Chen et al. 2023).

    With p the target's and q the draft's distribution at a position (both after the same
    temperature / top-k / top-p), draft x ~ q is accepted with probability min(1, p(x)/q(x)).
    At the first rejection the token is drawn from the residual norm(max(0, p - q)); if all K
    are accepted a bonus token is drawn from p at position K. For any q the emitted token is
    distributed exactly as p:
      P(x) = q(x) min(1, p(x)/q(x)) + (1 - sum_y min(q(y), p(y))) norm(max(0, p - q))(x)
           = min(q(x), p(x)) + max(0, p(x) - q(x)) = p(x).
    A deterministic proposer passes q=None: q is one-hot at the draft, so x is accepted with
    probability p(x) and the residual is p with x removed, renormalised.

    Args:
      keys: [B] per-row PRNG keys for this step.
      draft: drafted tokens.
      q: the distributions the drafts were sampled from, or None for one-hot.
      logits: target logits at the K+1 window positions.
      params: per-row sampling values (rows at temperature 0 reduce to greedy acceptance).
    Returns:
      (n, next): drafts kept per row and the token after them.
    """
    n, p_n, q_n, k_next = rejection(keys, draft, q, logits, params)
    residual = jnp.maximum(p_n - q_n, 0.0)  # q = 0 at the bonus slot: p itself there
    mass = residual.sum(-1, keepdims=True)
    # mass is 0 only when p == q at that slot, where a rejection has probability 0
    residual = jnp.where(mass > 0, residual / jnp.where(mass > 0, mass, 1.0), p_n)
    nxt = jax.vmap(jax.random.categorical)(k_next, jnp.log(residual)).astype(jnp.int32)
    return n, nxt


def rejection(keys: Array, draft: Int[Array, "B K"], q: Float[Array, "B K V"] | None,
              logits: Float[Array, "B K+1 V"], params: SamplingParams):
    """Where each row's chain stops (`speculative`'s first half): the drafts kept `n` (x ~ q kept with
    probability min(1, p(x)/q(x))), the target's and the draft's distributions p and q at slot n (q
    is 0 at the bonus slot K), and the key the next token is drawn with."""
    b, k = draft.shape
    p = sampling.probs(logits, params)  # [B, K+1, V]
    if q is None:
        q = jax.nn.one_hot(draft, p.shape[-1], dtype=p.dtype)
    p_x = jnp.take_along_axis(p[:, :k], draft[..., None], axis=-1)[..., 0]
    q_x = jnp.take_along_axis(q, draft[..., None], axis=-1)[..., 0]
    k_unif, k_next = jax.vmap(lambda key: tuple(jax.random.split(key)))(keys)
    u = jax.vmap(lambda key: jax.random.uniform(key, (k,)))(k_unif)
    n = _count_prefix(u * q_x < p_x)  # u < p/q without dividing by a zero q
    p_n = jnp.take_along_axis(p, n[:, None, None], axis=1)[:, 0]  # [B, V]
    q_pad = jnp.concatenate([q, jnp.zeros_like(q[:, :1])], axis=1)  # q = 0 at the bonus slot
    q_n = jnp.take_along_axis(q_pad, n[:, None, None], axis=1)[:, 0]
    return n, p_n, q_n, k_next


def walk(ok: Bool[Array, "B K"], x: Int[Array, "B W"], topo: tree.AnyTopology) -> Accepted:
    """The deepest node whose whole path is kept (`ok` per node), and the target's token there.

    Siblings carry distinct tokens, so at most one path matches; ties (typical acceptance) go to
    the node listed first.
    """
    ok = jnp.concatenate([jnp.ones_like(ok[:, :1]), ok], axis=1)  # the root is always kept
    depth, anc = tree.batched(topo, ok.shape[0])  # [B, W], [B, W, W]: static or one tree per row
    reached = ~jnp.any(anc & ~ok[:, None, :], axis=-1)  # [B, W]
    leaf = jnp.argmax(jnp.where(reached, depth, -1), axis=1)
    n = jnp.take_along_axis(depth, leaf[:, None], axis=1)[:, 0]
    d = jnp.arange(topo.max_depth + 1)
    leaf_anc = jnp.take_along_axis(anc, leaf[:, None, None], axis=1)[:, 0]  # [B, W]
    at_depth = leaf_anc[:, None, :] & (depth[:, None, :] == d[None, :, None])  # [B, R, W]
    path = jnp.argmax(at_depth, axis=-1).astype(jnp.int32)
    return Accepted(n=n, path=path, next=jnp.take_along_axis(x, leaf[:, None], axis=1)[:, 0])


def chain_path(n: Array, topo: tree.AnyTopology) -> Array:
    """The accepted path of a chain: slots 0..K (the first n + 1 of them hold what was kept)."""
    return jnp.broadcast_to(jnp.arange(topo.max_depth + 1, dtype=jnp.int32), (n.shape[0], topo.max_depth + 1))


@dataclasses.dataclass(frozen=True)
class Greedy(_AnyShape):
    """Exact match against the target's argmax: output equals plain greedy decoding."""

    lossless: ClassVar[bool] = True

    def accept(self, w: Window) -> Accepted:
        x = sampling.argmax(w.logits)
        return walk(w.nodes == tree.at_parents(x, w.topo), x, w.topo)


@dataclasses.dataclass(frozen=True)
class SpecInfer(_AnyShape):
    """Draw at each node from p, follow the matching child (lossless for any drafts; see module)."""

    lossless: ClassVar[bool] = True

    def accept(self, w: Window) -> Accepted:
        x = w.sampling.draws(w.keys, w.logits, w.params)  # draws at all slots up front; the walk uses some
        return walk(w.nodes == tree.at_parents(x, w.topo), x, w.topo)


@dataclasses.dataclass(frozen=True)
class Speculative:
    """Leviathan et al.'s rule with the draft's real q (one-hot when the draft gives none); chains."""

    lossless: ClassVar[bool] = True

    def check(self, topology: tree.AnyTopology) -> None:
        if not topology.is_chain:
            raise ValueError(f"{type(self).__name__} verifies chains only; this proposer drafts a tree: "
                             "use acceptance.SpecInfer() (lossless) or Greedy()")

    def accept(self, w: Window) -> Accepted:
        if w.sampling.greedy:
            n, nxt = greedy(w.nodes, w.logits)
        else:
            n, nxt = speculative(w.keys, w.nodes, w.q, w.logits, w.params)
        return Accepted(n=n, path=chain_path(n, w.topo), next=nxt)


@dataclasses.dataclass(frozen=True)
class TypicalAcceptance(_AnyShape):
    """LOSSY (Medusa's typical acceptance): keep node x if p(x) > min(eps, delta * exp(-H(p))) at
    its parent, then sample the next token from p at the deepest kept node. Output no longer follows
    the target's distribution; greedy rows are unchanged (exact match)."""

    epsilon: float = 0.09
    delta: float = 0.3
    lossless: ClassVar[bool] = False

    def __post_init__(self):
        if not (0 < self.epsilon < 1 and 0 < self.delta < 1):
            raise ValueError(f"typical acceptance ({self.epsilon}, {self.delta}): need 0 < epsilon < 1 "
                             "and 0 < delta < 1")

    def accept(self, w: Window) -> Accepted:
        if w.sampling.greedy:
            return Greedy().accept(w)
        logits, topo = w.logits, w.topo
        p = sampling.probs(logits, w.params)  # [B, W, V]
        p_par = tree.at_parents(p, topo)  # [B, K, V]
        p_x = jnp.take_along_axis(p_par, w.nodes[..., None], axis=-1)[..., 0]
        ent = -jnp.sum(jnp.where(p_par > 0, p_par * jnp.log(jnp.where(p_par > 0, p_par, 1.0)), 0.0), -1)
        ok = p_x > jnp.minimum(self.epsilon, self.delta * jnp.exp(-ent))
        acc = walk(ok, jnp.zeros(logits.shape[:2], jnp.int32), topo)
        at_leaf = jnp.take_along_axis(logits, acc.leaf[:, None, None], axis=1)[:, 0]
        nxt = w.sampling.draw(jax.vmap(lambda k: jax.random.fold_in(k, 7))(w.keys), at_leaf, w.params)
        return acc.replace(next=nxt)


def default_rule(config: Sampling, topo: tree.AnyTopology):
    """Greedy decoding: exact match. Sampling: Leviathan's rule on a chain, SpecInfer on a tree."""
    if config.greedy:
        return Greedy()
    return Speculative() if topo.is_chain else SpecInfer()
