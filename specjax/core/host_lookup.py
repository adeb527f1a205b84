"""Prompt lookup on the host, and the replay the auto scheduler learns acceptance from.

`HostLookup` mirrors the device lookup (`specjax.core.ngram_table.match`, what the n-gram proposer
and forced text's fallback draft) over one row's growing token list; `replay` runs any such host
proposer (prompt lookup's, forced text's: `k`, `tokens`, `propose()`, `extend(tokens)`) over text
another option committed and counts what it would have kept.
"""

from __future__ import annotations

from collections.abc import Sequence


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

