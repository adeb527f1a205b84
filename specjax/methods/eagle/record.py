"""EAGLE's registry record: a trained head drafting from the target's features, a chain or a dynamic
tree (EAGLE-2); its asset is the head (`specjax train-heads --kind eagle`), its draft vocabulary
and the settings tuned for it on this machine (`specjax tune-heads --eagle`, tuning.json)."""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any

import numpy as np

from specjax import sharding
from specjax.methods.eagle.options import EagleOptions
from specjax.methods.eagle.proposer import EagleProposer
from specjax.methods.method import Flag, Record, shipped_or
from specjax.models import eagle_io

METHOD = "eagle"
MISSING = ("method 'eagle' needs an EAGLE head: Engine.load(..., assets={'eagle': 'default' or DIR}) "
           "or --eagle DIR (train one with `specjax train-heads --kind eagle`)")


@dataclasses.dataclass(frozen=True)
class LoadedEagle:
    """A trained EAGLE head (`specjax.models.eagle.EagleHead`), its draft vocabulary (token ids, most
    frequent first), its manifest and its tuned settings (tuning.json; `Engine.tuned`)."""

    module: Any
    ids: tuple[int, ...]
    manifest: dict = dataclasses.field(default_factory=dict, hash=False, compare=False)
    tuning: dict | None = dataclasses.field(default=None, hash=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "ids", tuple(int(t) for t in np.asarray(self.ids).ravel()))
        object.__setattr__(self, "manifest", dict(self.manifest or {}))


def _loaded(assets) -> LoadedEagle:
    head = assets.methods.get(METHOD)
    if head is None:
        raise ValueError(MISSING)
    return head


def build(spec, assets):
    """(proposer, params) of the loaded head: a chain of `spec.k`, or a dynamic tree of `nodes`."""
    head, o = _loaded(assets), spec.options
    return EagleProposer.from_head(head.module, head.ids, assets.target, k=spec.k, nodes=o.nodes, topk=o.topk,
                                   draft_vocab=o.draft_vocab or None)


def load(host, path: str) -> LoadedEagle:
    """The head at `path` ("default": the one shipped for the host's model) and its tuning."""
    path = shipped_or(path, RECORD, host.name, "no EAGLE head is", "specjax train-heads --kind eagle")
    head, ids, manifest = eagle_io.load_head(path, model_name=host.name, weights_id=host.weights_id)
    f = pathlib.Path(path) / "tuning.json"  # written by `specjax tune-heads --eagle`
    return LoadedEagle(module=head, ids=ids, manifest=manifest, tuning=json.loads(f.read_text()) if f.is_file() else None)


def fit(head: LoadedEagle, host) -> LoadedEagle:
    """`head` checked against the host's target (raises when it does not fit) and placed on its mesh."""
    EagleProposer.from_head(head.module, head.ids, host.model, k=1)
    return dataclasses.replace(head, module=sharding.place_module(head.module, host.mesh))


def tuned(assets, tree: bool) -> dict:
    """The head's tuning on its machine: its chain, or with `tree` its dynamic tree; without a
    tuning, chain k=3 / tree depth 4 with 16 nodes and top-4."""
    found = (_loaded(assets).tuning or {}).get("tree" if tree else "chain")
    return dict(found or (dict(k=4, nodes=16, topk=4) if tree else dict(k=3)))


def auto(assets, ks, given) -> list[dict]:
    """The head's tuned chain and dynamic tree."""
    if METHOD not in assets.methods:
        return []
    return [dict(method=METHOD, **tuned(assets, tree)) for tree in (False, True)]


RECORD = Record(
    METHOD, build, option_type=EagleOptions, shape=lambda spec: (None, bool(spec.options.nodes)), tuned=tuned,
    auto=auto, flag="--eagle", shipped=eagle_io.shipped_eagle_dir, load=load, fit=fit,
    modules=lambda head: ((head.module, False),),
    flag_help="EAGLE head directory for --method eagle (default: the head shipped for the model)", flags=(
        Flag("--nodes", "nodes", int, "eagle: nodes of the dynamic tree built each step (--k is its depth; "
             "default: a chain). Unset values come from the head's tuning (tune-heads --eagle)", min=0, tree=True),
        Flag("--topk", "topk", int, "eagle trees: children per expanded node", min=1, tree=True),
        Flag("--draft-vocab", "draft_vocab", int,
             "eagle: propose from the head's N most frequent tokens (default: as tuned)", min=1)))
