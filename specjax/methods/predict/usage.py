"""What a prediction was worth, as OpenAI's usage reports it (`completion_tokens_details`).

`accepted_prediction_tokens` are "the tokens in the prediction that appeared in the completion",
`rejected_prediction_tokens` the others. The count is of the text, not of the method: it is the same
whichever method decoded the answer (the plain loop included), and whatever step boundaries fell
where. Tokens count as appearing when a token alignment of the two sequences pairs them: the
matching blocks of `difflib.SequenceMatcher` (longest common block first, then recursively on each
side, no junk heuristic), so a token is never counted twice and accepted <= both lengths.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence


def prediction_usage(prediction: Sequence[int], completion: Sequence[int]) -> tuple[int, int]:
    """(accepted, rejected) prediction tokens of a completion: accepted + rejected == len(prediction)."""
    match = difflib.SequenceMatcher(a=list(prediction), b=list(completion), autojunk=False)
    accepted = sum(block.size for block in match.get_matching_blocks())
    return accepted, len(prediction) - accepted
