"""Token recycling's registry record: build the proposer from a spec, serve it, load its warm start,
and give its tuned templates (`specjax.methods.registry`)."""

from __future__ import annotations

from specjax.core import tree as tree_lib
from specjax.core.ngram_table import TableConfig
from specjax.methods.recycle import assets as recycle_assets
from specjax.methods.recycle.matrix import RecycleParams, RecycleSpec
from specjax.methods.method import TREE_FLAG, Flag, Record
from specjax.methods.recycle.options import WARM_COLD, WARM_DEFAULT, RecycleOptions
from specjax.methods.recycle.proposer import Levels, RecycleProposer

METHOD = "recycle"
SERVING_TABLE = 1 << 16  # the spine's cross-request n-gram table in a long-running host
# the tree before any tuning (16 nodes): ranks thin out with depth, the spine deepest
DEFAULT_TREE: tree_lib.Tree = (
    (0,), (1,), (2,), (3,), (0, 0), (0, 1), (0, 2), (1, 0), (2, 0),
    (0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0), (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 0, 0, 0))


shipped_dir = recycle_assets.shipped_dir


def template_of(spec) -> tree_lib.Tree:
    """The spec's draft tree: its options' `tree`, or a chain of k."""
    return tree_lib.chain(spec.k) if spec.options.tree is None else spec.options.tree


def warm_params(assets, options: RecycleOptions) -> RecycleParams:
    """The warm start `options.recycle_warm` names, for the target in `assets`."""
    vocab, k = assets.target.config.vocab_size, options.recycle_k
    where = options.recycle_warm
    if where == WARM_COLD:
        return RecycleParams.cold(vocab, k)
    if where == WARM_DEFAULT:
        loaded = assets.methods.get(METHOD)
        if loaded is not None:
            if loaded.k < k:
                raise ValueError(f"the loaded warm start keeps {loaded.k} candidates per token; recycle_k={k} "
                                 f"needs at least {k}")
            return RecycleParams(first=loaded.first[:, :k], keys=loaded.keys, second=loaded.second[:, :k])
        where = recycle_assets.shipped_dir(assets.name)
        if where is None:
            return RecycleParams.cold(vocab, k)
    return recycle_assets.load(where, vocab=vocab, k=k, name=assets.name, weights_id=assets.weights_id)


def build(spec, assets) -> tuple[RecycleProposer, RecycleParams]:
    """(proposer, warm start) for `spec` on the target in `assets`."""
    o: RecycleOptions = spec.options
    template = template_of(spec)
    rspec = RecycleSpec(vocab=assets.target.config.vocab_size, k=o.recycle_k, order=o.recycle_order,
                        table=o.recycle_table, tenants=o.recycle_tenants)
    spine = Levels.of(template).spine if o.recycle_spine else 0
    table = None
    if spine and o.recycle_ngram_table:
        table = TableConfig(size=o.recycle_ngram_table, width=spine, min_n=max(2, o.recycle_spine),
                            max_n=max(2, o.recycle_spine, o.recycle_spine_max))
    proposer = RecycleProposer(k=max(len(p) for p in template), template=template, spec=rspec,
                               spine=o.recycle_spine, spine_max=o.recycle_spine_max, table=table)
    return proposer, warm_params(assets, o)


def serving(spec, table: int | None):
    """In a long-running host the spine also reads the cross-request n-gram table (`table` slots;
    None: the spec's own, else `SERVING_TABLE`; 0: none)."""
    if not spec.options.recycle_spine:
        return spec
    size = (spec.options.recycle_ngram_table or SERVING_TABLE) if table is None else int(table)
    return spec.with_options(recycle_ngram_table=size)


def _tuning(assets) -> dict:
    """The tuning beside the loaded or shipped warm start ({} when none)."""
    where = recycle_assets.shipped_dir(assets.name) if METHOD not in assets.methods else None
    loaded = getattr(assets.methods.get(METHOD), "tuning", None)
    return loaded or (recycle_assets.tuning(where) if where is not None else None) or {}


def tuned(assets, tree: bool) -> dict:
    """The template tuned on this machine (`tuning.json`, `specjax tune-recycle`): the default (the
    fastest chain or tree of at most 16 nodes), or with `tree` the fastest tree of any size; before
    any tuning, `DEFAULT_TREE`."""
    t = _tuning(assets).get("tree" if tree else "default")
    if not t:
        return dict(tree=DEFAULT_TREE)
    return dict(tree=tuple(tuple(p) for p in t["tree"])) if "tree" in t else dict(k=int(t["k"]))


def auto(assets, ks, given) -> list[dict]:
    """With a warm start (loaded or shipped): the tuned default, the fastest tree, and a chain as long
    as auto's longest K. The tuning weighs every prompt alike; answers that recur across requests
    (configuration files) accept long chains that the average does not, and auto measures acceptance
    per task class, so the long chain is there for the classes where it pays."""
    if METHOD not in assets.methods and recycle_assets.shipped_dir(assets.name) is None:
        return []
    options = [dict(method=METHOD, **tuned(assets, t)) for t in (False, True)]
    longest = max((int(k) for k in ks), default=0)
    if longest > 1:
        options.append(dict(method=METHOD, k=longest))
    return list({repr(o): o for o in options}.values())


def load(host, path: str) -> "WarmStart | None":
    """`Record.load`: the warm start at `path` for the host's target ("default": the one shipped for
    the model; None when none ships, so the matrix starts cold, as `recycle_warm="cold"`)."""
    where = recycle_assets.shipped_dir(host.name) if path == WARM_DEFAULT else path
    if where is None:
        return None
    man = recycle_assets.read(where)[0]
    params = recycle_assets.load(where, vocab=host.config.vocab_size, k=int(man["k"]), name=host.name,
                                 weights_id=host.weights_id)
    return WarmStart(params=params, tuning=recycle_assets.tuning(where), manifest=man)


class WarmStart:
    """A loaded warm start: its arrays (`RecycleParams`), its tuning and manifest."""

    def __init__(self, params: RecycleParams, tuning: dict | None = None, manifest: dict | None = None):
        self.params, self.tuning, self.manifest = params, tuning, dict(manifest or {})

    @property
    def k(self) -> int:
        return self.params.k

    @property
    def first(self):
        return self.params.first

    @property
    def keys(self):
        return self.params.keys

    @property
    def second(self):
        return self.params.second


RECORD = Record(
    METHOD, build, option_type=RecycleOptions, shape=lambda spec: (spec.options.depth, spec.options.tree is not None),
    tuned=tuned, auto=auto, serving=serving, load=load, shipped=shipped_dir, flags=(
        TREE_FLAG,
        Flag("--recycle-k", "recycle_k", int, "recycle: candidates kept per token, 1..32 (default 8)", min=1),
        Flag("--recycle-order", "recycle_order", int,
             "recycle: 2 also keeps a table keyed by the last two tokens; 1 the matrix alone (default 2)", min=1),
        Flag("--recycle-spine", "recycle_spine", int,
             "recycle: prompt lookup on the spine, a match of at least N tokens (0 = off; default 2)", min=0),
        Flag("--recycle-warm", "recycle_warm", str,
             "recycle: the matrix its drafts fall back on: default (the loaded or shipped warm start), "
             "cold (none) or a warm start's directory")))
