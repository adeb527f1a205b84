"""Draft proposers: each guesses K next tokens per row with fixed shapes.

A proposer is a frozen, hashable dataclass (static: it shapes the program) with three pure
methods; its arrays (draft weights, caches) travel separately as `params` and `pstate`:

- `init(params, state, prompts, hidden) -> pstate`: after the target prefill (inside jit).
- `propose(params, pstate, state, sampling_config, keys) -> (draft [B, K], q, pstate)`:
  q is the [B, K, V] distribution the drafts were sampled from, or None when the proposer
  is deterministic (one-hot q).
- `reconcile(params, pstate, state, hidden, last) -> pstate`: after the commit, with the
  target's verify hidden states [B, W, D] and the window slot of the last accepted token
  (for a chain, the number of accepted drafts); brings the proposer's state in line with
  the accepted length.
"""

from specjax.proposers.base import Proposer
from specjax.proposers.draft_model import DraftModelProposer
from specjax.proposers.medusa import MedusaProposer
from specjax.proposers.ngram import NgramProposer

__all__ = ["Proposer", "NgramProposer", "DraftModelProposer", "MedusaProposer"]
