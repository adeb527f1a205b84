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
from collections.abc import Sequence

import jax.numpy as jnp
from jaxtyping import Array, Int

from specjax.core import ngram_table
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


def host_replay(spec, tokens) -> "HostLookup":
    """The same lookup on the host over a row's tokens (the scheduler's replay, `replay`)."""
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


class HostLookup:
    """The same prompt lookup on the host, over one row's growing token list, with an n-gram index.

    `propose()` returns exactly what `NgramProposer.lookup` proposes for this row's tokens (tested
    against it). The index maps each n-gram to its most recent start that is followed by at least one
    token, so a lookup is a dict access, not a scan. The adaptive controller uses it to replay prompt
    lookup over text that another method (or the plain loop) committed: what prompt lookup would have
    accepted there, for free (see `replay`).
    """

    def __init__(self, tokens, *, k: int, min_n: int = 1, max_n: int = 3):
        self.k, self.min_n, self.max_n = int(k), int(min_n), int(max_n)
        self.tokens: list[int] = []
        self.index: dict[tuple[int, ...], int] = {}
        self.extend(tokens)

    def extend(self, tokens) -> None:
        for t in tokens:
            # the n-grams ending at the current last token are now followed by one: index them
            end = len(self.tokens)
            for n in range(self.min_n, self.max_n + 1):
                if end >= n:
                    self.index[tuple(self.tokens[end - n:end])] = end - n
            self.tokens.append(int(t))

    def propose(self) -> list[int]:
        """The K drafts after the tokens held so far."""
        toks, n_tok = self.tokens, len(self.tokens)
        for n in range(self.max_n, self.min_n - 1, -1):
            if n_tok >= n:
                i = self.index.get(tuple(toks[n_tok - n:]))
                if i is not None:
                    return [toks[min(i + n + j, n_tok - 1)] for j in range(self.k)]
        return [toks[-1]] * self.k


def replay(lookup: HostLookup, committed: Sequence[int]) -> tuple[list[int], int]:
    """Replays prompt lookup over text something else committed: what prompt lookup would have kept.

    `lookup` holds the row's first tokens (its length is the replay cursor); `committed` is the row's
    whole token list so far. Each simulated step proposes K drafts at the cursor, keeps the leading
    drafts equal to the committed tokens and moves the cursor past them and one more token, as a real
    speculative step does. A step is counted once its outcome and the token after the kept drafts
    are committed; the rest waits for the next call.

    Under greedy decoding the counts are exactly prompt lookup's on this text: its drafts depend only
    on committed tokens. Under sampling they are unbiased per draft: a one-hot draft d is accepted
    with probability p(d), which is also the probability that the sampled text continues with d.

    Returns:
      (kept per draft position, steps); `lookup` is advanced to the new cursor.
    """
    k = lookup.k
    kept = [0] * k
    steps = 0
    pos, end = len(lookup.tokens), len(committed)
    while True:
        draft = lookup.propose()
        acc = 0
        while acc < k and pos + acc < end and draft[acc] == committed[pos + acc]:
            acc += 1
        if pos + acc >= end:  # the text ends before the step's outcome (and its next token) is known
            return kept, steps
        for j in range(acc):
            kept[j] += 1
        steps += 1
        lookup.extend(committed[pos:pos + acc + 1])
        pos += acc + 1
