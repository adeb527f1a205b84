"""Medusa's registry record: heads on the target's last hidden state, drafting a chain of k heads or
a static tree; its asset is trained heads (`specjax train-heads`), with the vocabulary subset and
tree tuned for them (`specjax tune-heads`)."""

from __future__ import annotations

import dataclasses

import numpy as np

from specjax import sharding
from specjax.core.tree import Tree, as_tree
from specjax.methods.medusa.options import HEADS_TREE, MedusaOptions
from specjax.methods.medusa.proposer import MedusaProposer
from specjax.methods.method import TREE_FLAG, Record, shipped_or
from specjax.models import heads_io
from specjax.models.heads import MedusaHeads

METHOD = "medusa"


@dataclasses.dataclass(frozen=True)
class LoadedHeads:
    """Trained heads with what was tuned for them (`specjax tune-heads`) and their manifest.

    Attributes:
      module: the heads (`specjax.models.heads.MedusaHeads`).
      vocab: token ids the shared-LM-head heads may propose (the frequent tokens); None: the whole
        vocabulary (see `MedusaParams`).
      tree: the candidate tree tuned for them (`tree="heads"`), or None.
      manifest: what they were trained for, kept for telemetry.
    """

    module: MedusaHeads
    vocab: tuple[int, ...] | None = None
    tree: Tree | None = None
    manifest: dict = dataclasses.field(default_factory=dict, hash=False, compare=False)

    def __post_init__(self):
        if self.vocab is not None:
            object.__setattr__(self, "vocab", tuple(int(t) for t in np.asarray(self.vocab).ravel()))
        if self.tree is not None:
            object.__setattr__(self, "tree", as_tree(self.tree))
        object.__setattr__(self, "manifest", dict(self.manifest or {}))


def heads_tree(heads: LoadedHeads | None) -> Tree:
    """The candidate tree tuned for the loaded heads (`tree="heads"`); one clear error when there are
    none or they carry no tuned tree."""
    if heads is None or heads.tree is None:
        raise ValueError('tree="heads" needs heads that carry a tuned tree (tree.json beside them); '
                         "name a tree (chain4, small, medium) or give --k")
    return heads.tree


def _loaded(assets) -> LoadedHeads:
    heads = assets.methods.get(METHOD)
    if heads is None:
        raise ValueError("method 'medusa' needs Medusa heads: Engine.load(..., assets={'medusa': 'default' or DIR}) "
                         "or --heads DIR")
    return heads


def build(spec, assets):
    """(proposer, params) of the loaded heads: a chain of `spec.k`, or the options' tree."""
    heads = _loaded(assets)
    tree = heads_tree(heads) if spec.options.tree == HEADS_TREE else spec.options.tree
    return MedusaProposer.from_heads(heads.module, assets.target, k=spec.k, tree=tree, vocab_subset=heads.vocab)


def resolve(spec, assets):
    """`spec` with `tree="heads"` replaced by the tree tuned for the loaded heads."""
    if spec.options.tree != HEADS_TREE:
        return spec
    return spec.with_options(tree=heads_tree(assets.methods.get(METHOD)))


def load(host, path: str) -> LoadedHeads:
    """The heads at `path` ("default": those shipped for the host's model), with their tuned
    vocabulary and tree (vocab.json, tree.json; checked)."""
    path = shipped_or(path, RECORD, host.name, "no Medusa heads are", "specjax train-heads")
    heads, manifest = heads_io.load_heads(path, model_name=host.name, weights_id=host.weights_id)
    extra = heads_io.load_extras(path, heads.config.vocab_size)
    return LoadedHeads(module=heads, vocab=extra["vocab"], tree=extra["tree"], manifest=manifest)


def fit(heads: LoadedHeads, host) -> LoadedHeads:
    """`heads` checked against the host's target (raises when they do not fit) and placed on its mesh."""
    MedusaProposer.from_heads(heads.module, host.model, vocab_subset=heads.vocab, tree=heads.tree)
    return dataclasses.replace(heads, module=sharding.place_module(heads.module, host.mesh))


def auto(assets, ks, given) -> list[dict]:
    """Each chain length in `ks` the heads support, and the tree given (a spec with a tree) or else
    the heads' own tuned tree, if any."""
    heads = assets.methods.get(METHOD)
    if heads is None:
        return []
    most = heads.module.config.num_heads
    chains = [dict(method=METHOD, k=k) for k in sorted({k for k in ks if k > 0}) if k <= most]
    if given is not None and given.options.tree is not None:
        tree = heads_tree(heads) if given.options.tree == HEADS_TREE else given.options.tree
        return chains + [dict(method=METHOD, tree=tree, typical=given.typical)]
    if heads.tree is not None:
        return chains + [dict(method=METHOD, tree=heads.tree)]
    return chains


RECORD = Record(
    METHOD, build, option_type=MedusaOptions,
    shape=lambda spec: (spec.options.depth, spec.options.tree is not None), resolve=resolve, auto=auto,
    flag="--heads", flag_help="Medusa heads directory for --method medusa (default: the heads shipped for the model)",
    shipped=heads_io.shipped_heads_dir, load=load, fit=fit, modules=lambda heads: ((heads.module, False),),
    flags=(TREE_FLAG,))
