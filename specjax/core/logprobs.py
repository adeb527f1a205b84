"""Log-probabilities of the committed tokens, recorded inside the loop (OpenAI's `logprobs` and
`top_logprobs`).

Every committed token was scored by one target forward: the prefill's last position, a plain step,
or the verify window slot of its parent on the accepted path. That forward's logits, as the model
gives them (before logit_bias, a constraint's mask and temperature, as vLLM's default "raw"
logprobs), give the token's log-probability and the `top` most likely tokens at its position. They
are written beside the token in the decode state (`DecodeState.logprobs`), so a host reads them with
the tokens, and a speculative loop records what the plain loop does, position by position.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jaxtyping import Array, Float, Int

MAX_TOP = 20  # OpenAI's bound on top_logprobs
AnyArray = Array | np.ndarray  # on device, or a host view's numpy copy


def check_top(top, name: str = "top_logprobs") -> int:
    """`top` alternatives per token, checked: an integer in [0, MAX_TOP] (`name`: the argument's, for
    the error)."""
    try:
        ok = not isinstance(top, bool) and int(top) == top and 0 <= top <= MAX_TOP
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ValueError(f"{name}={top!r}: must be an integer in [0, {MAX_TOP}], the alternatives recorded per token "
                         "(None: record no logprobs)")
    return int(top)


@struct.dataclass
class Logprobs:
    """Per-position log-probabilities of a batch's tokens (`[B, S]` in a decode state, `[B, W]` for
    a window's): the token's own, and the `Tl` most likely tokens with theirs, most likely first.
    Prompt positions hold zeros."""

    chosen: Float[AnyArray, "B S"]
    top_ids: Int[AnyArray, "B S Tl"]
    top_values: Float[AnyArray, "B S Tl"]

    @classmethod
    def zeros(cls, batch: int, length: int, top: int) -> "Logprobs":
        return cls(chosen=jnp.zeros((batch, length), jnp.float32),
                   top_ids=jnp.zeros((batch, length, top), jnp.int32),
                   top_values=jnp.zeros((batch, length, top), jnp.float32))

    @property
    def top(self) -> int:
        return self.top_ids.shape[-1]


def scored(logits: Float[Array, "B W V"], tokens: Int[Array, "B W"], top: int) -> Logprobs:
    """Each slot's token under the log-softmax of its logits, and the slot's `top` best tokens."""
    logits = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)  # log-softmax = logits - lse: the top-k ranks the raw logits
    chosen = jnp.take_along_axis(logits, tokens[..., None].astype(jnp.int32), axis=-1)[..., 0] - lse
    if top == 0:
        b, w = tokens.shape
        return Logprobs(chosen=chosen, top_ids=jnp.zeros((b, w, 0), jnp.int32),
                        top_values=jnp.zeros((b, w, 0), jnp.float32))
    values, ids = jax.lax.top_k(logits, top)
    return Logprobs(chosen=chosen, top_ids=ids.astype(jnp.int32), top_values=values - lse[..., None])


class TokenLogprob(NamedTuple):
    """One generated token's record, as a host hands it on: its log-probability, and its position's
    most likely tokens as (id, log-probability) pairs, most likely first."""

    logprob: float
    top: tuple[tuple[int, float], ...]


def entries(lp: Logprobs, row: int, start: int = 0, stop: int | None = None) -> list[TokenLogprob]:
    """Positions `start:stop` of row `row` of a host copy of `Logprobs`, one record per token."""
    chosen, ids, values = (np.asarray(x)[row, start:stop] for x in (lp.chosen, lp.top_ids, lp.top_values))
    return [TokenLogprob(float(c), tuple(zip(map(int, i), map(float, v)))) for c, i, v in zip(chosen, ids, values)]
