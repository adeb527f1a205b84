"""What a method is to the hosts: its `Record`, its option `Flag`s and the `Assets` it builds from.

Each method's folder defines its record (`specjax.methods.<name>.record.RECORD`) from these; the
registry (`specjax.methods.registry`) collects them by name. A record owns everything about its
method: building its proposer, its options and their flags, loading its asset from a directory
and fitting a given one to the target, its tuned settings and what auto may run with it.
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any, Callable

from specjax.core.tree import parse_tree


@dataclasses.dataclass
class Assets:
    """What proposers are built from: the target (and its catalog name and weights id), and each
    method's own loaded asset by method name (`methods[name]`: what its record's `load` returned
    and its `fit` checked, set through `Engine.set_asset` / `Engine.load_asset`)."""

    target: Any
    name: str | None = None
    weights_id: str | None = None
    methods: dict[str, Any] = dataclasses.field(default_factory=dict)


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


# `--tree`, the static candidate tree of the methods that draft one (their options' `tree`)
TREE_FLAG = Flag("--tree", "tree", parse_tree,
                 "medusa, recycle: the candidate tree: a name (chain4, small, medium; heads = the tree tuned "
                 "with Medusa's heads) or paths of ranks as JSON, e.g. '[[0],[1],[0,0]]'; default: medusa a "
                 "chain of --k heads, recycle its tuned template")

# `--ngram-min` / `--ngram-max`: the n-gram lengths of prompt lookup and of predicted outputs
NGRAM_FLAGS = (Flag("--ngram-min", "ngram_min", int, "ngram, predict, forced: shortest n-gram tried (default 1)", min=1),
               Flag("--ngram-max", "ngram_max", int, "ngram, predict, forced: longest n-gram tried (default 3)", min=1))

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
      option_type: the method's own options, a frozen keyword-only dataclass that checks its values
        (`SpecConfig.options` holds one; `SpecConfig.make` fills it from keywords); None: none.
      check: `(spec) -> None`, the method's own checks of its options against the spec (raises
        ValueError).
      shape: `(spec) -> (depth, tree)`: the depth its options fix (a static tree's, which becomes
        the spec's `k`; None: the spec's k) and whether it drafts a tree; None: a chain of k.
      resolve: `(spec, assets) -> spec`, the spec with what it names in the loaded assets filled in
        (Medusa's `tree="heads"`: the tree tuned for the loaded heads); None: as given.
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
      load: `(host, path) -> asset`, the asset at `path` ("default": the one shipped for the host's
        model) read for the host (an `Engine`: its `name`, `weights_id`, `config`, `tokenizer`);
        None: the method has no asset.
      fit: `(asset, host) -> asset`, a given asset checked against the host's target (one clear
        ValueError when it does not fit) and placed on its `mesh`; None: taken as given.
      modules: `(asset) -> ((module, cached), ...)`, the weights the asset holds for the memory
        plan, each with whether it keeps a KV cache of its own (a draft model, planned from its
        `init_cache`).
      serving: `(spec, table) -> spec`, the spec as a long-running host (the scheduler) runs it: a
        method with cross-request state turns it on (`table`: the host's n-gram table slots, None
        for the method's default, 0 for none); None: as given.
      replay: `(spec, tokens, prompt_len=, constraint=) -> lookup`, the method replayed on the host
        over a row's tokens (the first `prompt_len` its prompt; `constraint`: the row's
        `specjax.constrain.TokenTables` or None): an object with `k`, `tokens`, `propose()` and
        `extend(tokens)` as `specjax.methods.ngram.proposer.HostLookup`, advanced by
        `ngram.proposer.replay`. The auto scheduler learns what the method would have kept while
        other options run; None: no replay.
      on_request: the method drafts from what a request brings (a prediction, a constraint) and
        pays only with it: auto runs it when it is chosen by name (`--auto-methods`), never by default.
    """

    name: str
    build: Callable[[Any, Assets], tuple[Any, Any]]
    option_type: type | None = None
    check: Callable[[Any], None] = _no_checks
    shape: Callable[[Any], tuple[int | None, bool]] | None = None
    resolve: Callable[[Any, Assets], Any] | None = None
    tuned: Callable[[Assets, bool], dict] | None = None
    auto: Callable[[Assets, tuple[int, ...], Any], list[dict]] | None = None
    flags: tuple[Flag, ...] = ()
    flag: str | None = None
    flag_value: str = "DIR"
    flag_help: str = ""
    shipped: Callable[[str], Any] | None = None
    load: Callable[[Any, str], Any] | None = None
    fit: Callable[[Any, Any], Any] | None = None
    modules: Callable[[Any], tuple] | None = None
    serving: Callable[[Any, int | None], Any] | None = None
    replay: Callable[[Any, Any], Any] | None = None
    on_request: bool = False


def shipped_or(path: str, record: Record, model: str, missing: str, train: str) -> str | pathlib.Path:
    """`path`, or for "default" the directory `record` ships for `model`; ValueError naming what is
    `missing` and the `train` command that makes one when none ships."""
    if path != "default":
        return path
    found = None if record.shipped is None else record.shipped(model)
    if found is None:
        raise ValueError(f"{missing} shipped for model {model!r}: train with `{train} --model {model} --out DIR` "
                         f"and pass {record.flag} DIR")
    return found
