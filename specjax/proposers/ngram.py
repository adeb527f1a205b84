"""Prompt lookup (n-gram) proposer, on device, no host round trip.

For n from `max_n` down to `min_n`: find the most recent earlier occurrence of the row's last
n committed tokens in the row's prompt + generated tokens, and propose the K tokens that
followed it. The first n with a match wins. No match proposes the last token K times (a
fixed-shape guess that verification simply rejects when wrong).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jaxtyping import Array, Int

from specjax.proposers.base import Stateless
from specjax.state import DecodeState


@dataclasses.dataclass(frozen=True, kw_only=True)
class NgramProposer(Stateless):
    k: int
    min_n: int = 1
    max_n: int = 3

    def lookup(self, tokens: Int[Array, "B S"], lengths: Int[Array, "B"]) -> Int[Array, "B K"]:
        b, s = tokens.shape
        rows = jnp.arange(b)[:, None]
        last = jnp.take_along_axis(tokens, lengths[:, None] - 1, axis=1)
        draft = jnp.broadcast_to(last, (b, self.k))
        found = jnp.zeros((b,), bool)
        for n in range(self.max_n, self.min_n - 1, -1):
            m = s - n + 1  # candidate starts i = 0 .. s-n
            suffix = jnp.take_along_axis(tokens, jnp.maximum(lengths[:, None] - n + jnp.arange(n)[None, :], 0), axis=1)
            match = jnp.ones((b, m), bool)
            for j in range(n):
                match &= tokens[:, j: j + m] == suffix[:, j: j + 1]
            i = jnp.arange(m)[None, :]
            # an earlier occurrence: it must end before the suffix itself starts repeating it
            match &= (i + n <= lengths[:, None] - 1) & (lengths[:, None] >= n)
            best = jnp.max(jnp.where(match, i, -1), axis=1)
            hit = (best >= 0) & ~found
            cols = jnp.minimum(best[:, None] + n + jnp.arange(self.k)[None, :], lengths[:, None] - 1)
            cand = tokens[rows, jnp.maximum(cols, 0)]
            draft = jnp.where(hit[:, None], cand, draft)
            found |= hit
        return draft

    def propose(self, params, pstate, state: DecodeState, sampling_config, keys):
        return self.lookup(state.tokens, state.lengths), None, pstate
