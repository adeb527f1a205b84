"""One record per method: everything a host needs to know about it, looked up by name.

Each method's folder defines its `Record` (`specjax.methods.method`): it builds the proposer and its
params from a `SpecConfig` and the `Assets` the host holds (the target, each method's loaded asset),
owns the method's options (a frozen dataclass, `SpecConfig.options`) and their flags, loads and
fits its asset, and gives the settings tuned for it (`tuned`). Batch-shared state (the
cross-request n-gram table, token recycling's matrix) is declared by the proposer it builds
(`Proposer.shared`). Hosts (the Engine, the scheduler, the CLI) look records up by name here and
never test for a method themselves, so adding a method is its own folder plus one entry in
`RECORDS` (or `register` for one defined elsewhere).

This module sits below `specjax.methods.config` (which validates a `SpecConfig` through the records) and
so never imports it: records read a spec's fields and return plain values.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from specjax.core import acceptance
from specjax.methods.draft.record import RECORD as DRAFT_RECORD
from specjax.methods.eagle.record import RECORD as EAGLE_RECORD
from specjax.methods.forced.record import RECORD as FORCED_RECORD
from specjax.methods.medusa.record import RECORD as MEDUSA_RECORD
from specjax.methods.method import K_FLAG, TREE_FLAG, Assets, Flag, Record  # noqa: F401 (re-exported)
from specjax.methods.ngram.record import RECORD as NGRAM_RECORD
from specjax.methods.predict.record import RECORD as PREDICT_RECORD
from specjax.methods.recycle.record import RECORD as RECYCLE_RECORD

# the shipped methods, in the order `--help` and auto list them
RECORDS: dict[str, Record] = {r.name: r for r in (NGRAM_RECORD, PREDICT_RECORD, FORCED_RECORD, DRAFT_RECORD,
                                                  MEDUSA_RECORD, EAGLE_RECORD, RECYCLE_RECORD)}
MEDUSA, EAGLE = MEDUSA_RECORD.name, EAGLE_RECORD.name  # the heads `specjax train-heads` trains


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
    """A spec's method exists and its own checks of the spec hold (`Record.check`)."""
    if spec.method != "none":
        record(spec.method).check(spec)


def shape(spec) -> tuple[int | None, bool]:
    """(the depth the spec's options fix, or None for its k; whether it drafts a tree)."""
    rec = None if spec.method == "none" else record(spec.method)
    return (None, False) if rec is None or rec.shape is None else rec.shape(spec)


def resolve(spec, assets: Assets):
    """`spec` with what it names in the loaded assets filled in (`Record.resolve`)."""
    rec = RECORDS.get(spec.method)
    return spec if rec is None or rec.resolve is None else rec.resolve(spec, assets)


def modules(assets: Assets) -> list[tuple[Any, Any]]:
    """The weights the loaded assets hold, each with whether it keeps a KV cache of its own."""
    return [m for name, asset in assets.methods.items()
            if name in RECORDS and RECORDS[name].modules is not None for m in RECORDS[name].modules(asset)]


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


def host_replay(spec, tokens, *, prompt_len: int = 0, constraint=None):
    """The method of `spec` replayed on the host from a row's `tokens`, the first `prompt_len` of
    them its prompt, under the row's `constraint` tables or None (`Record.replay`)."""
    return record(spec.method).replay(spec, tokens, prompt_len=prompt_len, constraint=constraint)


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
