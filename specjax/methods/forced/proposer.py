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
from specjax.core.host_lookup import HostLookup


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


class HostForced:
    """The same drafts on the host, over one row's growing token list: its constraint's automaton
    walked over the answer's tokens (`TokenTables.next_state`), the forced tokens at its state first,
    prompt lookup's after them (`HostLookup`); proposes exactly what `ForcedProposer.propose` does
    for the row. The auto scheduler replays it (`ngram.proposer.replay`) over text other options
    commit, so a constrained answer's forced text is evidence before forced ever runs.
    """

    def __init__(self, tokens, *, k: int, min_n: int, max_n: int, tables, prompt_len: int):
        self.k, self.tables, self.prompt_len = int(k), tables, int(prompt_len)
        self.lookup = HostLookup([], k=k, min_n=min_n, max_n=max_n)
        self.state = 0  # every automaton starts in state 0, as the row's on device
        self.extend(tokens)

    @property
    def tokens(self) -> list[int]:
        return self.lookup.tokens

    def extend(self, tokens) -> None:
        for t in tokens:
            if len(self.lookup.tokens) >= self.prompt_len and self.state >= 0:  # an answer token: the automaton moves
                self.state = int(self.tables.next_state[self.state, self.tables.token_class[int(t)]])
            self.lookup.extend([t])

    def propose(self) -> list[int]:
        drafts = self.lookup.propose()
        if self.state < 0:
            return drafts
        forced = [int(x) for x in self.tables.forced[self.state][: self.k]]
        forced = forced[: next((i for i, x in enumerate(forced) if x < 0), len(forced))]
        return forced + drafts[len(forced):]


def host_replay(spec, tokens, *, prompt_len: int = 0, constraint=None) -> HostForced | HostLookup:
    """Forced drafts replayed on the host over a row's tokens (`Record.replay`): under the row's
    constraint tables, or prompt lookup's alone for a row without one (what the proposer drafts there)."""
    o = spec.options
    if constraint is None or constraint.forced is None:
        return HostLookup(tokens, k=spec.k, min_n=o.ngram_min, max_n=o.ngram_max)
    return HostForced(tokens, k=spec.k, min_n=o.ngram_min, max_n=o.ngram_max, tables=constraint,
                      prompt_len=prompt_len)
