"""Forced text as drafts: where a row's constraint fixes what comes next (a JSON schema's keys, quotes
and punctuation), its tokens are the drafts; elsewhere prompt lookup in the row's own context.

The constraint pool (`specjax.core.constraint`) holds, per automaton state, the tokens of the text every
answer continues with (`specjax.constrain.TokenTables.forced`); a row reads them at its current state
with one gather. A row with forced tokens drafts them first and fills the rest of its window with
prompt lookup's drafts; a row with none (a free row, a choice point) drafts prompt lookup's. Drafts are
a function of committed text and the constraint, so greedy output equals plain decoding and sampling
stays lossless with the one-hot rule.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from specjax.core import ngram_table
from specjax.core.constraint import PoolSpec
from specjax.core.proposer import Stateless
from specjax.core.state import DecodeState


@dataclasses.dataclass(frozen=True, kw_only=True)
class ForcedProposer(Stateless):
    """Attributes:
      k: drafts per step.
      pool: the constraint pool it reads (declared as batch-shared state; the host's pool merges with it).
      min_n, max_n: prompt lookup's n-gram lengths where nothing is forced.
    """

    k: int
    pool: PoolSpec
    min_n: int = 1
    max_n: int = 3

    @property
    def shared(self) -> tuple[PoolSpec, ...]:
        return (self.pool,)

    @classmethod
    def from_spec(cls, spec, assets) -> tuple["ForcedProposer", None]:
        """No weights: (proposer, None); the pool over the target's vocabulary, F >= k."""
        o = spec.options
        pool = PoolSpec(vocab=assets.target.config.vocab_size, forced=max(spec.k, PoolSpec.forced))
        return cls(k=spec.k, pool=pool, min_n=o.ngram_min, max_n=o.ngram_max), None

    def propose(self, params, pstate, state: DecodeState, sampling_config, keys):
        pool = state.shared.parts[PoolSpec.name]
        forced = pool.forced[state.constraint, jnp.maximum(state.automaton, 0)][:, : self.k]  # [B, <=K]
        forced = jnp.pad(forced, ((0, 0), (0, self.k - forced.shape[1])), constant_values=-1)
        lookup = ngram_table.match(state.tokens, state.lengths, self.k, self.min_n, self.max_n)[0]
        has = (forced[:, :1] >= 0) & (state.automaton[:, None] >= 0)
        return jnp.where(has & (forced >= 0), forced, lookup), None, pstate
