"""Prompt lookup (n-gram) proposer, on device, no host round trip.

For n from `max_n` down to `min_n`: find the most recent earlier occurrence of the row's last
n committed tokens in the row's prompt + generated tokens, and propose the K tokens that
followed it. The first n with a match wins. No match proposes the last token K times (a
fixed-shape guess that verification simply rejects when wrong). With a cross-request n-gram table
(`ngram_table=` slots: it declares the table as batch-shared state, `specjax.core.ngram_table`), a
row with no match in its own context takes the followers the table holds for its last n-gram
instead.

Every draft is a committed token (columns are clamped to the row's committed length), so drafts
are in the vocabulary by construction: prompts are checked at the boundary (`Engine.encode`), and
generated tokens are argmaxes or samples over the target's logits.
"""

from __future__ import annotations

import dataclasses
import jax.numpy as jnp
from jaxtyping import Array, Int

from specjax.core import ngram_table
from specjax.core.host_lookup import HostLookup, replay  # noqa: F401 (prompt lookup's host side, re-exported)
from specjax.core.ngram_table import TableConfig
from specjax.core.proposer import Stateless
from specjax.core.state import DecodeState
from specjax.methods.ngram.options import SERVING_TABLE, NgramOptions


def table_config(options: NgramOptions, k: int) -> TableConfig | None:
    """The cross-request table `options` ask for (None when off): k followers per entry, n-grams of
    at least 2 tokens (1-grams across requests are mostly noise)."""
    if not options.ngram_table:
        return None
    lo = min(max(2, options.ngram_min), options.ngram_max)
    return TableConfig(size=options.ngram_table, width=k, min_n=lo, max_n=options.ngram_max)


def serving(spec, table: int | None):
    """`spec` as a long-running host runs it: with its cross-request table (`table` slots; None: the
    spec's own, else `SERVING_TABLE`; 0: none)."""
    size = (spec.options.ngram_table or SERVING_TABLE) if table is None else int(table)
    return spec.with_options(ngram_table=size)


def host_replay(spec, tokens, *, prompt_len: int = 0, constraint=None) -> "HostLookup":
    """The same lookup on the host over a row's tokens (the scheduler's replay, `replay`); prompt
    lookup reads no constraint."""
    return HostLookup(tokens, k=spec.k, min_n=spec.options.ngram_min, max_n=spec.options.ngram_max)


@dataclasses.dataclass(frozen=True, kw_only=True)
class NgramProposer(Stateless):
    """Attributes:
      k: drafts per step.
      min_n, max_n: n-gram lengths tried in the row's context, longest first.
      table: the cross-request n-gram table it reads when the row's context has no match (declared
        as batch-shared state, `shared`), or None.
    """

    k: int
    min_n: int = 1
    max_n: int = 3
    table: TableConfig | None = None

    @property
    def shared(self) -> tuple[TableConfig, ...]:
        return () if self.table is None else (self.table,)

    def lookup(self, tokens: Int[Array, "B S"], lengths: Int[Array, "B"]) -> Int[Array, "B K"]:
        """The drafts of every row from its own context."""
        return ngram_table.match(tokens, lengths, self.k, self.min_n, self.max_n)[0]

    @classmethod
    def from_spec(cls, spec, assets=None) -> tuple["NgramProposer", None]:
        """Prompt lookup needs no weights: (proposer, None)."""
        o = spec.options
        return cls(k=spec.k, min_n=o.ngram_min, max_n=o.ngram_max, table=table_config(o, spec.k)), None

    def propose(self, params, pstate, state: DecodeState, sampling_config, keys):
        draft, found = ngram_table.match(state.tokens, state.lengths, self.k, self.min_n, self.max_n)
        if self.table is not None:
            table = state.shared.parts[self.table.name]
            shared, hit = ngram_table.lookup(table, state.tokens, state.lengths, self.k, state.tenant)
            draft = jnp.where((~found & hit)[:, None], shared, draft)
        return draft, None, pstate


