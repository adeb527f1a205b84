"""A command's flags onto what runs: the engine with its methods' assets (`engine_for`, the one place
a command builds one), `SpecConfig`s (from each record's `Flag`s) and auto's controller settings."""

from __future__ import annotations

from typing import Callable, Iterable

from specjax.cli.flags import mesh_arg, names
from specjax.methods import registry
from specjax.methods.registry import RECORDS

NEEDS_FLAG = "--method {method} needs {flag} {value}"
INCLUDES_NEEDS_FLAG = "--methods includes {method}: give {flag} {value}"
DEFAULT_K = 4


def flag_values(args, method: str | None = None) -> dict:
    """{field: value} of the method flags given (not None) in `args`: every method's flags, or with
    `method` that method's own and `--k`. Each value is checked against its flag's bound first."""
    mine = None if method is None or method == "none" else {f.name for f in registry.record(method).flags}
    out = {}
    for f in registry.flags():
        v = getattr(args, f.dest, None)
        if v is None or (mine is not None and f is not registry.K_FLAG and f.name not in mine):
            continue
        if f.min is not None and v < f.min:
            raise ValueError(f"{f.name}={v}: must be >= {f.min}")
        out[f.field] = v
    return out


def check_flags(args) -> None:
    """Every method flag given holds its bound (before any model loads)."""
    flag_values(args)


def spec_of(args, method: str, *, strict: bool = False, engine=None, tree: bool | None = None):
    """The `SpecConfig` of `method` from the flags in `args` (`--k` defaults to 4). A method with
    tuned settings takes them from the loaded assets, flags overriding: it needs the `engine`
    (None without one), and runs its tree when `tree` (None: when a tree flag of its own is given);
    a method that drafts a static tree (recycle) runs the chain of `--k` or the `--tree` given instead.
    `strict`: flags of another method are passed on too, so the spec refuses them (one method runs,
    so such a flag is a mistake); else only the method's own apply."""
    from specjax.methods.config import SpecConfig

    if method in ("none", "auto"):
        return SpecConfig()
    rec = registry.record(method)
    given = flag_values(args, None if strict else method)
    explicit = registry.TREE_FLAG in rec.flags and ({"k", "tree"} & given.keys())  # a template of one's own
    if rec.tuned is None or explicit:
        return SpecConfig.make(method, **{"k": DEFAULT_K, **given})
    if engine is None:
        return None  # from the loaded assets' tuning
    trees = {f.field for f in rec.flags if f.tree}
    if tree is None:
        tree = any(given.get(x) for x in trees)
    return engine.tuned(method, tree=tree, **{k: v for k, v in given.items() if tree or k not in trees})


def bench_spec(args, label: str, engine=None):
    """The `SpecConfig` of a bench method label ("eagle-tree": eagle's tuned tree)."""
    method = registry.base(label)
    return spec_of(args, method, engine=engine, tree=label != method)


def given(args, method: str):
    """What the method's asset flag gave (`--heads DIR`, `--draft-model NAME`, ...), or None."""
    flag = registry.record(method).flag
    return None if flag is None else getattr(args, flag.lstrip("-").replace("-", "_"), None)


def check_given(args, methods, *, how: str) -> None:
    """A method whose asset ships with no model (a draft model) needs its flag: fail before loading."""
    for m in methods:
        rec = registry.record(m)
        if rec.flag is not None and rec.shipped is None and not given(args, m):
            raise ValueError(how.format(method=m, flag=rec.flag, value=rec.flag_value))


def engine_for(args, methods: Iterable[str] | Callable = (), *, loaded: Callable[[], None] | None = None):
    """The Engine a command runs: `--model` in `--dtype` (on `--mesh` where the command has one),
    then the assets of `methods` (names, or a function of the loaded engine that gives them),
    each through its record. `loaded` is called between the model and the assets (a memory split)."""
    from specjax.serving.engine import Engine

    engine = Engine.load(args.model, dtype=args.dtype, mesh=mesh_arg(args),
                         weights_arith=getattr(args, "weights_arith", "exact"))
    if loaded is not None:
        loaded()
    load_assets(engine, args, methods(engine) if callable(methods) else methods)
    return engine


def load_assets(engine, args, methods) -> None:
    """Loads the assets of `methods` that have one (`Record.load`): the given ones (their flag),
    else those shipped for the model ("default")."""
    for m in dict.fromkeys(methods):
        if registry.record(m).load is not None:
            engine.load_asset(m, given(args, m) or "default")


def auto_methods() -> tuple[str, ...]:
    """What auto may choose: prompt lookup, and the methods whose loaded assets give it options."""
    return tuple(m for m, r in RECORDS.items()
                 if registry.looks_up(m) or r.auto is not None or r.on_request)


def chosen_auto_methods(text: str | None) -> tuple[str, ...] | None:
    """`--auto-methods` as names (None: every method the model has assets for)."""
    if text is None:
        return None
    methods, allowed = names(text), auto_methods()
    if not methods or any(m not in allowed for m in methods):
        raise ValueError(f"--auto-methods {text!r}: give some of {','.join(allowed)}")
    return methods


def auto_assets(args, chosen: tuple[str, ...] | None) -> Callable:
    """What auto may use, as a function of the loaded engine (for `engine_for`): the `chosen`
    methods with an asset, or (None chosen) every method whose asset is given or shipped for the
    model."""
    def wanted(engine, m: str) -> bool:
        rec = RECORDS[m]
        if rec.load is None:
            return False
        if chosen is not None:
            return m in chosen
        return bool(given(args, m) or (rec.shipped is not None and rec.shipped(engine.name)))

    return lambda engine: [m for m in RECORDS if wanted(engine, m)]


def auto_controller(engine, chosen: tuple[str, ...] | None, **settings):
    """Auto's `ControllerConfig` over the loaded assets (`ControllerConfig.with_assets`): its methods
    and options cut to the `chosen` ones when given."""
    import dataclasses

    from specjax.serving.controller import ControllerConfig

    ccfg = ControllerConfig(**settings).with_assets(engine.assets)
    if chosen is not None:  # methods that pay with what a request brings only when chosen: their options cost programs
        asked = tuple(m for m, r in RECORDS.items() if r.on_request)
        ccfg = dataclasses.replace(ccfg, methods=tuple(m for m in dict.fromkeys((*ccfg.methods, *asked)) if m in chosen),
                                   extra=tuple(o for o in ccfg.extra if o.method in chosen))  # a shipped warm start too
    return ccfg
