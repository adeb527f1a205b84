"""One table from a method name to the factory that builds its proposer and params.

A factory takes the `SpecConfig` and the `Assets` the host holds (the target, a draft model,
trained heads) and returns `(proposer, params)`, raising one clear ValueError when something it
needs is missing. Adding a method is its own module plus one line in `FACTORIES`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from specjax import acceptance
from specjax.proposers.draft_model import DraftModelProposer
from specjax.proposers.eagle import EagleProposer
from specjax.proposers.medusa import LoadedHeads, MedusaProposer
from specjax.proposers.ngram import NgramProposer


@dataclasses.dataclass
class Assets:
    """What proposers may be built from: the target and the optional draft model and heads."""

    target: Any
    draft: Any = None
    heads: LoadedHeads | None = None
    eagle: "LoadedEagle | None" = None


@dataclasses.dataclass(frozen=True)
class LoadedEagle:
    """A trained EAGLE head, its draft vocabulary (most frequent first) and its manifest."""

    module: Any
    ids: tuple[int, ...]
    manifest: dict = dataclasses.field(default_factory=dict, hash=False, compare=False)
    tuning: dict | None = dataclasses.field(default=None, hash=False, compare=False)  # tuning.json

    def spec(self, *, tree: bool, **overrides):
        """The `SpecConfig` this head was tuned for on its machine (`specjax tune-heads --eagle`):
        its chain, or with `tree` its dynamic tree; without a tuning, chain k=3 / tree depth 4 with
        16 nodes and top-4. `overrides` (not None) replace tuned fields."""
        from specjax.config import SpecConfig

        tuned = (self.tuning or {}).get("tree" if tree else "chain")
        base = dict(tuned or (dict(k=4, nodes=16, topk=4) if tree else dict(k=3)))
        base.update({k: v for k, v in overrides.items() if v is not None})
        return SpecConfig(method="eagle", **base)


FACTORIES: dict[str, Callable] = {
    "ngram": NgramProposer.from_spec,
    "draft": DraftModelProposer.from_spec,
    "medusa": MedusaProposer.from_spec,
    "eagle": EagleProposer.from_spec,
}


def build(spec, assets: Assets):
    """(proposer, params) for `spec`, or (None, None) for the plain loop."""
    if spec.method == "none":
        return None, None
    if spec.method not in FACTORIES:
        raise ValueError(f"method {spec.method!r} has no proposer: use one of none, {', '.join(FACTORIES)}")
    return FACTORIES[spec.method](spec, assets)


def acceptance_rule(spec):
    """The acceptance rule `spec` asks for, or None for the lossless default."""
    if spec.typical is not None:
        return acceptance.TypicalAcceptance(*spec.typical)
    return None
