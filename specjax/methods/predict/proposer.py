"""Predicted outputs (OpenAI's `prediction`): drafts copied from a text the answer is expected to restate.

A request may carry a prediction: the file it asks to edit, the answer it got last time. Each row
holds its prediction in a fixed-capacity buffer (`[B, cap]` tokens, its length an array, set when
the row is prefilled or inserted), so one compiled program serves every prediction up to the cap.

A cursor follows the answer through the prediction: the prediction index the next committed token
is expected to restate. Each step drafts the K prediction tokens from the first of these that holds:

1. The last step drafted from the prediction and the last committed token is the prediction's token
   just before the cursor: the answer still follows it (its bonus or correction token included).
2. The longest suffix n-gram of the committed text (n from `max_n` down to 2, or `min_n` if larger)
   occurs in the prediction: the cursor moves just past the occurrence nearest at or after it (else
   the nearest one before it). This finds the answer again after an insertion or a deletion.
   A single token is searched too, but only within `NEAR` tokens of the cursor: one-token matches
   (a newline, a space) anchor it in the wrong place more often than not farther away.
3. The last committed token is the prediction's token before the cursor (an edit of the same length
   ended: the cursor kept moving with the answer meanwhile).
4. The last step drafted from the prediction (1 or 2) and its correction token left it: the edit
   is taken to be a substitution, and the drafts continue from the cursor once.

Otherwise the row falls back to prompt lookup in its own context (`specjax.core.ngram_table.match`),
as does a row without a prediction.

Past the prediction's end the drafts are the row's first stop token: an answer that ends where
its prediction ends is accepted with its stop token. After a commit the cursor moves past what
the step committed (accepted drafts and the token after them), also on steps that did not draft
from the prediction.

Drafts are a function of the committed text and the prediction alone (one-hot q): greedy output is
the plain loop's token for token and sampling keeps the target's distribution. Every draft is a
prediction token (checked at the boundary to lie in the vocabulary), a stop id or a committed token.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, Bool, Int

from specjax.core import ngram_table
from specjax.core.proposer import Chain
from specjax.core.state import DecodeState, last_tokens

NEAR = 16  # tokens around the cursor where a single-token match may move it (rule 2)


@struct.dataclass
class PredictState:
    """Per-row prediction and cursor (the proposer state: batch-leading, moved with its row)."""

    prediction: Int[Array, "B Q"]  # right-padded with 0
    lengths: Int[Array, "B"]  # its tokens (0: the row has no prediction)
    cursor: Int[Array, "B"]  # prediction index aligned with the next committed token
    aligned: Bool[Array, "B"]  # the last step that committed drafted from the prediction by rule 1 or 2
    start: Int[Array, "B"]  # where this step's drafts start in the prediction
    drafted: Bool[Array, "B"]  # this step drafted from the prediction by rule 1 or 2 (`aligned` next)
    guessed: Bool[Array, "B"]  # this step drafted from the prediction by rule 3 or 4
    base: Int[Array, "B"]  # committed tokens when this step proposed


def buffer(inputs, cap: int) -> tuple[Int[Array, "B Q"], Int[Array, "B"]]:
    """The inputs' predictions padded to `cap` tokens (all empty when the inputs carry none)."""
    b = inputs.prompts.shape[0]
    if inputs.prediction is None:
        return jnp.zeros((b, cap), jnp.int32), jnp.zeros((b,), jnp.int32)
    q = inputs.prediction.shape[1]
    if q > cap:
        raise ValueError(f"a prediction bucket of {q} tokens exceeds the method's prediction_cap={cap}: "
                         "build the inputs with prediction_bucket=prediction_cap")
    pred = jnp.pad(inputs.prediction.astype(jnp.int32), ((0, 0), (0, cap - q)))
    return pred, inputs.prediction_lengths.astype(jnp.int32)


def find(pred: Int[Array, "B Q"], plen: Int[Array, "B"], tokens: Int[Array, "B S"], lengths: Int[Array, "B"],
         cursor: Int[Array, "B"], min_n: int, max_n: int,
         near: int | None = None) -> tuple[Int[Array, "B"], Bool[Array, "B"]]:
    """(new cursor, found): the longest suffix n-gram of each row's committed tokens found in its
    prediction; the cursor lands just past the occurrence nearest at or after `cursor`, else just
    past the nearest one before it. With `near`, a single token (n = 1) counts only within `near`
    tokens of the cursor."""
    b, q = pred.shape
    best = jnp.zeros((b,), jnp.int32)
    found = jnp.zeros((b,), bool)
    for n in range(max_n, min_n - 1, -1):
        m = q - n + 1  # occurrence starts 0 .. q-n
        if m < 1:
            continue
        suffix = jnp.take_along_axis(tokens, jnp.maximum(lengths[:, None] - n + jnp.arange(n)[None, :], 0), axis=1)
        hit = jnp.ones((b, m), bool)
        for j in range(n):
            hit &= pred[:, j: j + m] == suffix[:, j: j + 1]
        end = jnp.arange(m)[None, :] + n  # the cursor after this occurrence
        hit &= (end <= plen[:, None]) & (lengths[:, None] >= n)
        if n == 1 and near is not None:
            hit &= jnp.abs(end - cursor[:, None]) <= near
        ahead = hit & (end >= cursor[:, None])
        nearest_ahead = jnp.min(jnp.where(ahead, end, q + 1), axis=1)
        nearest_behind = jnp.max(jnp.where(hit, end, -1), axis=1)
        at = jnp.where(ahead.any(axis=1), nearest_ahead, nearest_behind)
        new = hit.any(axis=1) & ~found
        best = jnp.where(new, at, best).astype(jnp.int32)
        found |= new
    return best, found


@dataclasses.dataclass(frozen=True, kw_only=True)
class PredictProposer(Chain):
    """Attributes:
      k: drafts per step.
      cap: tokens of each row's prediction buffer (static).
      min_n, max_n: n-gram lengths tried, longest first, to find the cursor again and in the
        fallback to the row's own context.
    """

    k: int
    cap: int = 1024
    min_n: int = 1
    max_n: int = 3

    @classmethod
    def from_spec(cls, spec, assets=None) -> tuple["PredictProposer", None]:
        """Predicted outputs need no weights: (proposer, None)."""
        o = spec.options
        return cls(k=spec.k, cap=o.prediction_cap, min_n=o.ngram_min, max_n=o.ngram_max), None

    @property
    def search_min_n(self) -> int:
        """The shortest n-gram searched in the prediction (rule 2): 2, unless the range says otherwise."""
        return min(max(2, self.min_n), self.max_n)

    def init(self, params, state: DecodeState, inputs, hidden) -> PredictState:
        """The rows' predictions, the cursor past the prediction's first token: the prefill's token
        restates it, or replaces it (rule 1 or 4 at the first step)."""
        pred, plen = buffer(inputs, self.cap)
        some = plen > 0
        zeros = jnp.zeros_like(plen)
        return PredictState(prediction=pred, lengths=plen, cursor=some.astype(jnp.int32), aligned=some,
                            start=zeros, drafted=jnp.zeros_like(some), guessed=jnp.zeros_like(some),
                            base=state.lengths)

    def propose(self, params, ps: PredictState, state: DecodeState, sampling_config, keys):
        pred, plen = ps.prediction, ps.lengths
        before = jnp.take_along_axis(pred, jnp.clip(ps.cursor - 1, 0, self.cap - 1)[:, None], axis=1)[:, 0]
        inside = (ps.cursor >= 1) & (ps.cursor <= plen)
        restates = inside & (before == last_tokens(state))
        follows = ps.aligned & restates  # rule 1
        again, found = find(pred, plen, state.tokens, state.lengths, ps.cursor, self.search_min_n, self.max_n)
        if self.search_min_n > 1 and self.min_n == 1:  # a single token, near the cursor
            near, close = find(pred, plen, state.tokens, state.lengths, ps.cursor, 1, 1, near=NEAR)
            again, found = jnp.where(found, again, near), found | close
        found &= ~follows  # rule 2
        guessed = ~follows & ~found & inside & (restates | ps.aligned)  # rules 3, 4
        start = jnp.where(found, again, ps.cursor)
        drafted = follows | found
        cols = start[:, None] + jnp.arange(self.k)[None, :]
        copied = jnp.take_along_axis(pred, jnp.clip(cols, 0, self.cap - 1), axis=1)
        last = jnp.take_along_axis(pred, jnp.maximum(plen - 1, 0)[:, None], axis=1)
        end = jnp.where(state.stop_ids[:, :1] >= 0, state.stop_ids[:, :1], last)  # past the prediction's end
        copied = jnp.where(cols < plen[:, None], copied, end)
        own = ngram_table.match(state.tokens, state.lengths, self.k, self.min_n, self.max_n)[0]
        draft = jnp.where((drafted | guessed)[:, None], copied, own)
        return draft, None, ps.replace(start=start, drafted=drafted, guessed=guessed, base=state.lengths)

    def reconcile(self, params, ps: PredictState, state: DecodeState, verify, accepted) -> PredictState:
        """Moves the cursor past what the step committed (rows that committed nothing keep theirs)."""
        take = state.lengths - ps.base
        moved = take > 0
        cursor = jnp.where(moved, ps.start + take, ps.cursor)
        return ps.replace(cursor=cursor.astype(jnp.int32), aligned=jnp.where(moved, ps.drafted, ps.aligned))
