"""One record per method: everything a host needs to know about it, looked up by name.

A `Record` builds the proposer and its params from a `SpecConfig` and the `Assets` the host holds
(the target, a draft model, trained heads, a method's own loaded asset), owns the method's options
(a frozen dataclass, `SpecConfig.options`) and checks them, loads its assets, and gives the settings
tuned for them (`tuned`). Batch-shared state (the cross-request n-gram table, token recycling's
matrix) is declared by the proposer it builds (`Proposer.shared`). Hosts (the Engine, the
scheduler, the CLI) look records up by name and never test for a method themselves, so adding a
method is its own module plus one record in `RECORDS` (or `register` for one defined elsewhere).

This module sits below `specjax.methods.config` (which validates a `SpecConfig` through the records) and
so never imports it: records read a spec's fields and return plain values.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from specjax.core import acceptance
from specjax.models import eagle_io, heads_io
from specjax.methods.draft.proposer import DraftModelProposer
from specjax.methods.eagle.proposer import EagleProposer
from specjax.methods.medusa.proposer import LoadedHeads, MedusaProposer, heads_tree
from specjax.methods.ngram import proposer as ngram_proposer
from specjax.methods.ngram.options import NgramOptions
from specjax.methods.recycle import record as recycle
from specjax.methods.recycle.options import RecycleOptions
from specjax.methods.ngram.proposer import NgramProposer
from specjax.core.tree import HEADS_TREE, parse_tree


@dataclasses.dataclass
class Assets:
    """What proposers may be built from: the target (and its catalog name), the optional draft
    model and heads, and each method's own loaded asset (`methods[name]`, set by its record's
    `load`, e.g. through `Engine.set_asset`)."""

    target: Any
    draft: Any = None
    heads: LoadedHeads | None = None
    eagle: "LoadedEagle | None" = None
    name: str | None = None
    weights_id: str | None = None
    methods: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class LoadedEagle:
    """A trained EAGLE head, its draft vocabulary (most frequent first) and its manifest."""

    module: Any
    ids: tuple[int, ...]
    manifest: dict = dataclasses.field(default_factory=dict, hash=False, compare=False)
    tuning: dict | None = dataclasses.field(default=None, hash=False, compare=False)  # tuning.json


def _no_checks(spec) -> None:
    pass


@dataclasses.dataclass(frozen=True)
class Flag:
    """A command-line flag that sets one of a method's options (`Record.flags`).

    The CLI adds every method's flags to each command that takes a method (`specjax.cli.flags`),
    each flag once (methods that share an option, as a tree, declare the same flag), and sets
    `field` from the value given; a flag left out leaves the option at its default. Adding an
    option to a method is one `Flag` in its record.

    Attributes:
      name: the flag, e.g. "--ngram-min".
      field: the option it sets, by name: a `SpecConfig` field or a field of the method's own
        options (`Record.option_type`; `SpecConfig.make` puts each where it belongs).
      type: parses the text given (argparse's `type`: int, `parse_tree`).
      help: one line for `--help`; says the default.
      min: the least value taken, checked before any model loads (None: no bound).
      tree: the option shapes a tree (EAGLE's nodes and top-k): a method with tuned settings runs
        its tuned tree when such a flag is given, and its chain ignores it.
    """

    name: str
    field: str
    type: Callable[[str], Any] = str
    help: str = ""
    min: int | None = None
    tree: bool = False

    @property
    def dest(self) -> str:
        """The attribute argparse stores the value under ("--ngram-min" -> "ngram_min")."""
        return self.name.lstrip("-").replace("-", "_")


# `--tree`, the static candidate tree of the methods that draft one (`SpecConfig.tree`)
TREE_FLAG = Flag("--tree", "tree", parse_tree,
                 "medusa, recycle: the candidate tree: a name (chain4, small, medium; heads = the tree tuned "
                 "with Medusa's heads) or paths of ranks as JSON, e.g. '[[0],[1],[0,0]]'; default: medusa a "
                 "chain of --k heads, recycle its tuned template")

# `--k`, an option of every method (`SpecConfig.k`)
K_FLAG = Flag("--k", "k", int, min=1,
              help="drafted tokens per step (default 4; eagle: the head's tuned chain, or tree depth)")


@dataclasses.dataclass(frozen=True)
class Record:
    """A method, as the hosts see it.

    Attributes:
      name: the `SpecConfig.method` (and `--method`) that selects it.
      build: `(spec, assets) -> (proposer, params)`; raises one clear ValueError when an asset it
        needs is missing or does not fit the target.
      options: the `SpecConfig` fields beyond `k` that apply to this method only (`tree`, `nodes`,
        `draft_vocab`): any other method must leave them at their defaults.
      option_type: the method's own options, a frozen keyword-only dataclass that checks its values
        (`SpecConfig.options` holds one; `SpecConfig.make` fills it from keywords); None: none.
      check: `(spec) -> None`, the method's own checks of its options against the spec (raises
        ValueError).
      tuned: `(assets, tree) -> dict`, the `SpecConfig` fields tuned for the loaded assets (its
        chain, or with `tree` its tree); None when the method has no tuning.
      auto: `(assets, ks, given) -> [fields]`, what the auto controller may run with the loaded
        assets: the `SpecConfig` fields of each option (a chain, a tree); `ks` are the
        controller's lengths, `given` the spec the user gave for this method (or None). None: the
        controller's `methods` cover it.
      flags: the command-line flags of its options (`Flag`); `--k` is every method's (`K_FLAG`).
      flag, flag_value, flag_help: the command-line flag that gives the method's asset, what it
        takes (for error messages) and its help (None: the method needs none).
      shipped: `(model name) -> path | None`, the asset shipped for a model (None: none ship, so
        the flag must be given).
      load: `(engine, path) -> None`, loads the asset at `path` ("default": the shipped one) into
        an `Engine`; None: `Engine.load` takes it (a draft model, loaded in the target's dtype).
      serving: `(spec, table) -> spec`, the spec as a long-running host (the scheduler) runs it: a
        method with cross-request state turns it on (`table`: the host's n-gram table slots, None
        for the method's default, 0 for none); None: as given.
      replay: `(spec, tokens) -> lookup`, the method replayed on the host over a row's tokens
        (`specjax.methods.ngram.proposer.HostLookup`, advanced by `ngram.proposer.replay`): the auto
        scheduler learns what it would have kept while other options run; None: no replay.
    """

    name: str
    build: Callable[[Any, Assets], tuple[Any, Any]]
    options: tuple[str, ...] = ()
    option_type: type | None = None
    check: Callable[[Any], None] = _no_checks
    tuned: Callable[[Assets, bool], dict] | None = None
    auto: Callable[[Assets, tuple[int, ...], Any], list[dict]] | None = None
    flags: tuple[Flag, ...] = ()
    flag: str | None = None
    flag_value: str = "DIR"
    flag_help: str = ""
    shipped: Callable[[str], Any] | None = None
    load: Callable[[Any, str], None] | None = None
    serving: Callable[[Any, int | None], Any] | None = None
    replay: Callable[[Any, Any], Any] | None = None


def _eagle_tuned(assets: Assets, tree: bool) -> dict:
    """The head's tuning on its machine (`specjax tune-heads --eagle`): its chain, or with `tree` its
    dynamic tree; without a tuning, chain k=3 / tree depth 4 with 16 nodes and top-4."""
    if assets.eagle is None:
        raise ValueError("method 'eagle' needs an EAGLE head: Engine.load(..., eagle='default' or DIR) "
                         "or --eagle DIR (train one with `specjax train-heads --kind eagle`)")
    tuned = (assets.eagle.tuning or {}).get("tree" if tree else "chain")
    return dict(tuned or (dict(k=4, nodes=16, topk=4) if tree else dict(k=3)))


def _eagle_auto(assets: Assets, ks, given) -> list[dict]:
    """The head's tuned chain and dynamic tree."""
    if assets.eagle is None:
        return []
    return [dict(method=EAGLE, **_eagle_tuned(assets, tree)) for tree in (False, True)]


def _medusa_auto(assets: Assets, ks, given) -> list[dict]:
    """Each chain length in `ks` the heads support, and the tree given (a spec with a tree) or else
    the heads' own tuned tree, if any."""
    if assets.heads is None:
        return []
    heads = assets.heads.module.config.num_heads
    chains = [dict(method=MEDUSA, k=k) for k in sorted({k for k in ks if k > 0}) if k <= heads]
    if given is not None and given.tree is not None:
        fields = {f.name: getattr(given, f.name) for f in dataclasses.fields(given)}
        if fields["tree"] == HEADS_TREE:
            fields["tree"] = heads_tree(assets.heads)
    elif assets.heads.tree is not None:
        fields = dict(method=MEDUSA, tree=assets.heads.tree)
    else:
        return chains
    return chains + [fields]


NGRAM, DRAFT, MEDUSA, EAGLE, RECYCLE = "ngram", "draft", "medusa", "eagle", recycle.METHOD  # the shipped methods
RECORDS: dict[str, Record] = {r.name: r for r in (
    Record(NGRAM, NgramProposer.from_spec, option_type=NgramOptions, serving=ngram_proposer.serving,
           replay=ngram_proposer.host_replay, flags=(
               Flag("--ngram-min", "ngram_min", int, "ngram: shortest n-gram tried (default 1)", min=1),
               Flag("--ngram-max", "ngram_max", int, "ngram: longest n-gram tried (default 3)", min=1))),
    Record(DRAFT, DraftModelProposer.from_spec, flag="--draft-model",
           flag_value="NAME (a model with the target's vocabulary)", flag_help="draft model for --method draft"),
    Record(MEDUSA, MedusaProposer.from_spec, options=("tree",), auto=_medusa_auto, flag="--heads",
           flag_help="Medusa heads directory for --method medusa (default: the heads shipped for the model)",
           shipped=heads_io.shipped_heads_dir, load=lambda engine, path: engine.load_heads(path), flags=(
               TREE_FLAG,)),
    Record(EAGLE, EagleProposer.from_spec, options=("nodes", "draft_vocab"), tuned=_eagle_tuned,
           auto=_eagle_auto, flag="--eagle", shipped=eagle_io.shipped_eagle_dir,
           flag_help="EAGLE head directory for --method eagle (default: the head shipped for the model)",
           load=lambda engine, path: engine.load_eagle(path), flags=(
               Flag("--nodes", "nodes", int, "eagle: nodes of the dynamic tree built each step (--k is its "
                    "depth; default: a chain). Unset values come from the head's tuning (tune-heads --eagle)",
                    min=0, tree=True),
               Flag("--topk", "topk", int, "eagle trees: children per expanded node", min=1, tree=True),
               Flag("--draft-vocab", "draft_vocab", int,
                    "eagle: propose from the head's N most frequent tokens (default: as tuned)", min=1))),
    Record(RECYCLE, recycle.build, options=("tree",), option_type=RecycleOptions, check=recycle.check,
           tuned=recycle.tuned, auto=recycle.auto, serving=recycle.serving, load=recycle.load_into,
           shipped=recycle.shipped_dir, flags=(
               TREE_FLAG,
               Flag("--recycle-k", "recycle_k", int, "recycle: candidates kept per token, 1..32 (default 8)",
                    min=1),
               Flag("--recycle-order", "recycle_order", int,
                    "recycle: 2 also keeps a table keyed by the last two tokens; 1 the matrix alone (default 2)",
                    min=1),
               Flag("--recycle-spine", "recycle_spine", int,
                    "recycle: prompt lookup on the spine, a match of at least N tokens (0 = off; default 2)",
                    min=0),
               Flag("--recycle-warm", "recycle_warm", str,
                    "recycle: the matrix its drafts fall back on: default (the loaded or shipped warm start), "
                    "cold (none) or a warm start's directory"))),
)}


def register(record: Record) -> None:
    """Adds (or replaces) a method's record: what a method defined outside specjax calls once."""
    RECORDS[record.name] = record


def record(method: str) -> Record:
    """The record of `method`; ValueError naming the known methods otherwise."""
    if method not in RECORDS:
        raise ValueError(f"unknown method {method!r}: use one of none, {', '.join(RECORDS)}")
    return RECORDS[method]


def options_of(spec) -> Any:
    """The method's own options for `spec`: `spec.options`, or its defaults when None (None for a
    method without options); ValueError when they are another method's."""
    rec = None if spec.method == "none" else record(spec.method)
    kind = None if rec is None else rec.option_type
    if kind is None:
        if spec.options is not None:
            raise ValueError(f"options={spec.options!r}: method {spec.method!r} takes no options of its own")
        return None
    if spec.options is None:
        return kind()
    if type(spec.options) is not kind:
        raise ValueError(f"options={spec.options!r}: method {spec.method!r} takes {kind.__name__}")
    return spec.options


def check(spec) -> None:
    """A spec's method exists and its method-specific options belong to it and hold."""
    if spec.method != "none":
        record(spec.method)
    defaults = {f.name: f.default for f in dataclasses.fields(spec)}
    for field in sorted({f for r in RECORDS.values() for f in r.options}):
        owners = [r.name for r in RECORDS.values() if field in r.options]
        if getattr(spec, field) != defaults[field] and spec.method not in owners:
            raise ValueError(f"{field}= applies to method {' or '.join(map(repr, owners))} only")
    if spec.method != "none":
        RECORDS[spec.method].check(spec)


def flags() -> tuple[Flag, ...]:
    """`K_FLAG`, then every method's option flags, each once (methods that share an option
    declare the same flag, setting the same field)."""
    out = {K_FLAG.name: K_FLAG}
    for rec in RECORDS.values():
        for f in rec.flags:
            if out.setdefault(f.name, f).field != f.field:
                raise ValueError(f"{f.name} of method {rec.name!r} sets {f.field!r}, another method's sets "
                                 f"{out[f.name].field!r}: one flag, one option")
    return tuple(out.values())


def option_owners(name: str) -> list[str]:
    """The methods whose own options have a field `name`."""
    return [r.name for r in RECORDS.values()
            if r.option_type is not None and name in {f.name for f in dataclasses.fields(r.option_type)}]


def base(label: str) -> str:
    """The method behind a bench label or an option's kind (eagle-tree: eagle's tuned tree)."""
    return label.removesuffix("-tree") if label.endswith("-tree") and label[:-5] in RECORDS else label


def looks_up(method: str) -> bool:
    """The method can be replayed on the host over text other options commit (`Record.replay`,
    prompt lookup's): auto's default options, learned for free while others run."""
    return method in RECORDS and RECORDS[method].replay is not None


def serving(spec, table: int | None = None):
    """`spec` as a long-running host runs it (`Record.serving`; as given for plain and methods
    without one)."""
    rec = RECORDS.get(spec.method)
    return spec if rec is None or rec.serving is None else rec.serving(spec, table)


def host_replay(spec, tokens):
    """The method of `spec` replayed on the host from a row's `tokens` (`Record.replay`)."""
    return record(spec.method).replay(spec, tokens)


def auto_options(assets: Assets, ks: tuple[int, ...], given: dict | None = None) -> list[dict]:
    """What the auto controller may run besides its `methods`, over every record with loaded assets:
    the `SpecConfig` fields of each option (see `Record.auto`)."""
    out = []
    for rec in RECORDS.values():
        if rec.auto is not None:
            out += rec.auto(assets, ks, (given or {}).get(rec.name))
    return out


def build(spec, assets: Assets):
    """(proposer, params) for `spec`, or (None, None) for the plain loop."""
    if spec.method == "none":
        return None, None
    return record(spec.method).build(spec, assets)


def tuned(method: str, assets: Assets, *, tree: bool = False) -> dict | None:
    """The `SpecConfig` fields tuned for the loaded assets of `method` (None: it has no tuning)."""
    rec = record(method)
    return None if rec.tuned is None else rec.tuned(assets, tree)


def acceptance_rule(spec):
    """The acceptance rule `spec` asks for, or None for the lossless default."""
    if spec.typical is not None:
        return acceptance.TypicalAcceptance(*spec.typical)
    return None
