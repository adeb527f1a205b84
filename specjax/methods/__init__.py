"""Draft proposers: each guesses the next tokens of every row with fixed shapes.

A proposer is a frozen, hashable dataclass (static: it shapes the program) with pure methods; its
arrays (draft weights, caches) travel separately as `params` (built with it by its factory) and
`pstate` (in the loop carry). It satisfies `Proposer` (`specjax.core.proposer`):

- `topology`: the window it drafts: a static `specjax.core.tree.Topology` (a chain of K is the tree
  `((0,), (0, 0), ...)`; the `Chain` mixin builds it from `paths`), or, for a proposer that builds
  its tree each step (the EAGLE-2 dynamic tree), a `tree.DynamicTopology` (its node budget), and
  then `propose` returns a `tree.DraftTree`.
- `taps`: target layers whose input it reads (an EAGLE-3 head); () for none.
- `shared`: the batch-shared state it reads (`specjax.core.shared.SharedSpec`s: the cross-request
  n-gram table, token recycling's matrix); the Decoder carries them and updates them after every
  commit; () for none.
- `init(params, state, inputs, hidden) -> pstate`: after the target prefill (inside jit), with the
  target's final hidden states at every prompt position `[B, P, D]`.
- `propose(params, pstate, state, sampling_config, keys) -> (nodes [B, K], q, pstate)`: q is the
  `[B, K, V]` distribution the drafts were sampled from, or None when the proposer is
  deterministic (one-hot q).
- `reconcile(params, pstate, state, verify, accepted) -> pstate`: after the commit, with the verify
  pass's whole output (`verify.hidden` at every window slot `[B, W, D]`, `verify.logits`) and the
  accepted path (`accepted.n`, `accepted.path`, `accepted.leaf`), so a proposer that keeps a cache
  or a feature can bring it in line with what was committed.

Each method's folder holds its proposer, its options and its record (`<name>/record.py`, a
`specjax.methods.method.Record`: how to build, check, load and tune it); `specjax.methods.registry`
collects the records by name, and a new method is its own folder plus one entry there.
"""

from specjax.core.proposer import Proposer
from specjax.methods.draft.proposer import DraftModelProposer
from specjax.methods.eagle.options import EagleOptions
from specjax.methods.eagle.proposer import EagleParams, EagleProposer
from specjax.methods.medusa.options import MedusaOptions
from specjax.methods.medusa.proposer import MedusaParams, MedusaProposer
from specjax.methods.ngram.options import NgramOptions
from specjax.methods.ngram.proposer import NgramProposer
from specjax.methods.recycle.options import RecycleOptions
from specjax.methods.recycle.proposer import RecycleProposer

__all__ = ["Proposer", "NgramProposer", "NgramOptions", "DraftModelProposer", "MedusaProposer", "MedusaParams",
           "MedusaOptions", "EagleProposer", "EagleParams", "EagleOptions", "RecycleProposer", "RecycleOptions"]
