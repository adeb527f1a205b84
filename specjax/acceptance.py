"""Acceptance rules: keep a prefix of the K drafted tokens and choose the token after it.

Both rules return `(num_accepted [B], next_token [B])`; the caller commits
`draft[:, :num_accepted]` followed by `next_token`: the correction on a rejection, or the
bonus token when all K drafts were accepted. Counts come from a cumulative product, so the
shapes never depend on the data.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from specjax import sampling
from specjax.sampling import SamplingConfig, SamplingParams


def _count_prefix(ok: Array) -> Int[Array, "B"]:
    return jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)


def greedy(draft: Int[Array, "B K"], logits: Float[Array, "B K+1 V"]):
    """Exact match against the target's argmax; output equals plain greedy decoding.

    Draft j is kept while it equals argmax of the target at window position j; the next
    token is the target's argmax right after the kept prefix (bonus if all K match).
    """
    target = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B, K+1]
    n = _count_prefix(draft == target[:, :-1])
    return n, jnp.take_along_axis(target, n[:, None], axis=1)[:, 0]


def speculative(
    keys: Array,
    draft: Int[Array, "B K"],
    q: Float[Array, "B K V"] | None,
    logits: Float[Array, "B K+1 V"],
    params: SamplingParams,
):
    """Lossless speculative sampling (Leviathan et al. 2023; Chen et al. 2023).

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
    """
    b, k = draft.shape
    p = sampling.probs(logits, params)  # [B, K+1, V]
    if q is None:
        q = jax.nn.one_hot(draft, p.shape[-1], dtype=p.dtype)
    p_x = jnp.take_along_axis(p[:, :k], draft[..., None], axis=-1)[..., 0]
    q_x = jnp.take_along_axis(q, draft[..., None], axis=-1)[..., 0]
    k_unif, k_next = jax.vmap(lambda key: tuple(jax.random.split(key)))(keys)
    u = jax.vmap(lambda key: jax.random.uniform(key, (k,)))(k_unif)
    accept = u * q_x < p_x  # u < p/q without dividing by a zero q
    n = _count_prefix(accept)
    p_n = jnp.take_along_axis(p, n[:, None, None], axis=1)[:, 0]  # [B, V]
    q_pad = jnp.concatenate([q, jnp.zeros_like(q[:, :1])], axis=1)  # q = 0 at the bonus slot
    q_n = jnp.take_along_axis(q_pad, n[:, None, None], axis=1)[:, 0]
    residual = jnp.maximum(p_n - q_n, 0.0)
    mass = residual.sum(-1, keepdims=True)
    # mass is 0 only when p == q at that slot, where a rejection has probability 0
    residual = jnp.where(mass > 0, residual / jnp.where(mass > 0, mass, 1.0), p_n)
    nxt = jax.vmap(jax.random.categorical)(k_next, jnp.log(residual)).astype(jnp.int32)
    return n, nxt


def accept(
    config: SamplingConfig,
    keys: Array,
    draft: Int[Array, "B K"],
    q: Float[Array, "B K V"] | None,
    logits: Float[Array, "B K+1 V"],
    params: SamplingParams,
):
    """Dispatches on the static sampling method."""
    if config.method == "greedy":
        return greedy(draft, logits)
    return speculative(keys, draft, q, logits, params)
