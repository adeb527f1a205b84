"""A method is one module plus one registry record: a toy proposer defined and registered here alone
runs through the Engine, greedy output equal to plain decoding; no host names a method."""

import dataclasses
import pathlib
import re
from types import SimpleNamespace
from typing import ClassVar

import jax.numpy as jnp
import numpy as np
import pytest
from flax import struct
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Int

from specjax import sharding
from specjax.methods.config import SpecConfig
from specjax.core import shared as shared_state
from specjax.serving.engine import Engine, GenerateOptions
from specjax.serving.scheduler import Scheduler
from specjax.methods import registry
from specjax.core.proposer import Stateless
from specjax.core.state import last_tokens
from specjax.methods.eagle.record import LoadedEagle
from specjax.methods.medusa.record import LoadedHeads
from specjax.methods.draft.record import DraftModel

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROMPTS = [[5, 9, 12, 5, 9, 12, 5], [40, 41, 42, 43], list(range(1, 20))]


@struct.dataclass
class FollowParams(sharding.Logical):
    """A guess of each token's successor; on a mesh it is laid out like the vocabulary."""

    after: Int[Array, "V"]

    def logical_axes(self):
        return dict(after=("vocab",))


@dataclasses.dataclass(frozen=True, kw_only=True)
class FollowProposer(Stateless):
    """Drafts k tokens by following the successor table from the row's pending token."""

    k: int

    def propose(self, params, pstate, state, sampling_config, keys):
        tok, drafts = last_tokens(state), []
        for _ in range(self.k):
            tok = params.after[tok]
            drafts.append(tok)
        return jnp.stack(drafts, axis=1).astype(jnp.int32), None, pstate


def build_follow(spec, assets):
    v = assets.target.config.vocab_size
    return FollowProposer(k=spec.k), FollowParams(after=(jnp.arange(v, dtype=jnp.int32) + 1) % v)


def check_follow(spec):
    if spec.k > 8:
        raise ValueError(f"follow k={spec.k}: at most 8")


@pytest.fixture
def follow(monkeypatch):
    """The toy method's record, registered for this test only."""
    monkeypatch.setitem(registry.RECORDS, "follow", registry.Record("follow", build_follow, check=check_follow))


def test_toy_method_through_the_engine_equals_plain(tiny_model, follow):
    eng = Engine(tiny_model)
    plain = eng.generate(PROMPTS, max_new_tokens=12)
    toy = eng.generate(PROMPTS, max_new_tokens=12, spec=SpecConfig(method="follow", k=3))
    assert [r.tokens for r in toy] == [r.tokens for r in plain]
    assert all(r.method == "follow" and r.k == 3 for r in toy)
    assert sum(r.counters.num_drafts for r in toy) > 0  # it did speculate


def test_toy_method_is_validated_by_its_record(follow):
    with pytest.raises(ValueError, match="at most 8"):
        SpecConfig(method="follow", k=9)
    with pytest.raises(ValueError, match="'medusa' or 'recycle' only"):  # another method's option
        SpecConfig.make("follow", tree="small")


def test_toy_params_are_placed_by_their_axes(tiny_model):
    """Placement on a mesh reads the axes the params declare: the table is vocabulary-parallel."""
    mesh = sharding.make_mesh(data=1, model=2)
    _, params = build_follow(SimpleNamespace(k=2), registry.Assets(target=tiny_model))
    placed = sharding.place_pparams(params, mesh)
    assert placed.after.sharding.spec == P("model") and (placed.after == params.after).all()


def test_unregistered_method_is_refused():
    with pytest.raises(ValueError, match="unknown method 'follow'"):
        SpecConfig(method="follow")


# modules outside specjax/methods/ that name methods on purpose, and why
NAMES_METHODS = {
    "bench/experiments/mesh_device.py": "a benchmark run by hand over a fixed matrix of methods, with its own "
                                        "random draft model and heads",
    "bench/experiments/recycle.py": "token recycling's own benchmark: its arms are recycle's templates beside "
                                    "prompt lookup",
    "bench/peer.py": "prompt lookup beside llama.cpp's n-gram speculation, the one method both implement",
    "core/constraint.py": "'forced' there names the constraint pool's field (its forced-token table), not the method",
    "core/slots.py": "'forced' there names the constraint pool's field (its forced-token table), not the method",
}


def test_no_host_names_a_method():
    """No module of specjax outside specjax/methods/ (the hosts: serving, cli, bench, the core, the
    top-level modules) holds a method's name as a string: the hosts ask the records. The few that
    name methods on purpose are listed with their reason, and each still does."""
    import ast

    names = set(registry.RECORDS)
    hits: dict[str, list[str]] = {}
    for f in sorted((ROOT / "specjax").rglob("*.py")):
        rel = f.relative_to(ROOT / "specjax").as_posix()
        if rel.startswith("methods/"):
            continue
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Constant) and node.value in names:
                hits.setdefault(rel, []).append(f"{rel}:{node.lineno}: {node.value!r}")
    found = [h for rel, lines in hits.items() if rel not in NAMES_METHODS for h in lines]
    assert not found, "\n".join(found)
    assert set(NAMES_METHODS) <= set(hits), "an exemption no longer names a method: drop it"


def test_every_registered_proposer_declares_the_protocol(tiny_model, follow):
    """Each record's proposer (the shipped methods and a toy one) is a `Proposer`: it declares k, its
    verify window (`topology`) and the layers it taps; the Decoder reads those and nothing else."""
    import numpy as np
    from flax import nnx

    from specjax.core import tree
    from specjax.core.decoder import Decoder
    from specjax.models import config as model_config
    from specjax.models import loader
    from specjax.models.eagle import EagleConfig, EagleHead
    from specjax.models.heads import HeadsConfig, MedusaHeads
    from specjax.core.proposer import Proposer

    heads = MedusaHeads(HeadsConfig.for_model(tiny_model.config, num_heads=4), base=tiny_model, rngs=nnx.Rngs(0))
    head = EagleHead(EagleConfig.for_model(tiny_model.config, draft_vocab=64), rngs=nnx.Rngs(2))
    eng = Engine(tiny_model, assets={"draft": DraftModel(loader.init_model(model_config.preset("tiny"), seed=1)),
                                     "medusa": LoadedHeads(heads), "eagle": LoadedEagle(head, np.arange(64))})
    specs = [SpecConfig(method=m, k=3) for m in registry.RECORDS]
    specs += [SpecConfig.make("medusa", tree="small"), SpecConfig.make("eagle", k=3, nodes=6, topk=2)]
    for spec in specs:
        proposer, _ = eng.proposer(spec)
        assert isinstance(proposer, Proposer), spec
        topo, taps = proposer.topology, proposer.taps
        assert isinstance(taps, tuple) and all(isinstance(t, int) for t in taps), spec
        nodes = getattr(spec.options, "nodes", 0)  # eagle's dynamic tree
        paths = getattr(spec.options, "tree", None)  # a static tree
        want = tree.DynamicTopology if nodes else tree.Topology
        assert isinstance(topo, want) and topo.max_depth == spec.depth == proposer.k, spec
        assert topo.is_chain == (not spec.is_tree), spec
        window = len(paths) + 1 if paths else (nodes or spec.k) + 1  # the root and every node
        assert Decoder(proposer=proposer, cache_length=64).window == window, spec
    assert {type(eng.proposer(SpecConfig(method=m, k=3))[0]) for m in registry.RECORDS} >= {FollowProposer}


def test_a_proposer_without_the_protocol_is_refused():
    from specjax.core.decoder import Decoder

    @dataclasses.dataclass(frozen=True)
    class Bare:  # propose alone: no topology, taps, init, reconcile
        k: int = 2

        def propose(self, params, pstate, state, sampling_config, keys):
            raise AssertionError

    with pytest.raises(TypeError, match="not a Proposer|parameter 'proposer'"):  # the latter: the test hook's
        Decoder(proposer=Bare(), cache_length=64)


# ---- a toy method with its own option, asset and batch-shared state, all from this file --------------


@struct.dataclass
class Successors(sharding.Logical):
    """Batch-shared: the token that last followed each token, and the tenant whose text it was."""

    after: Int[Array, "V"]
    owner: Int[Array, "V"]

    def logical_axes(self):
        return dict(after=(), owner=())


@dataclasses.dataclass(frozen=True)
class SuccessorSpec:
    """Declares `Successors` (a `specjax.core.shared.SharedSpec`): written after every commit."""

    name: ClassVar[str] = "successors"
    top_k: ClassVar[int] = 0  # reads committed text only
    vocab: int

    def init(self) -> Successors:
        return Successors(after=jnp.full((self.vocab,), -1, jnp.int32), owner=jnp.full((self.vocab,), -1, jnp.int32))

    def update(self, table: Successors, seen) -> Successors:
        b = seen.after.tokens.shape[0]
        j = jnp.arange(seen.width)[None, :]
        pos = seen.before.lengths[:, None] + j  # the newly committed positions
        ok = (j < (seen.after.lengths - seen.before.lengths)[:, None]) & seen.contribute[:, None]
        tok = lambda p: jnp.take_along_axis(seen.after.tokens, jnp.clip(p, 0, seen.after.tokens.shape[1] - 1), axis=1)
        prev, cur = tok(pos - 1).reshape(-1), tok(pos).reshape(-1)
        at = shared_state.winners(prev, (j * b + jnp.arange(b)[:, None] + 1).reshape(-1), ok.reshape(-1), self.vocab)
        tenant = jnp.broadcast_to(seen.tenant[:, None], pos.shape).reshape(-1)
        return Successors(after=table.after.at[at].set(cur, mode="drop"), owner=table.owner.at[at].set(tenant, mode="drop"))

    def merge(self, other):
        return self

    @property
    def nbytes(self) -> int:
        return 8 * self.vocab


@dataclasses.dataclass(frozen=True, kw_only=True)
class SuccessorOptions:
    succ_prior: bool = True  # where the shared table knows no successor, draft the loaded prior's


@dataclasses.dataclass(frozen=True, kw_only=True)
class SuccessorProposer(Stateless):
    """Follows the batch's successor table (its tenant's entries), else the prior asset."""

    k: int
    spec: SuccessorSpec
    prior: bool

    @property
    def shared(self):
        return (self.spec,)

    def propose(self, params, pstate, state, sampling_config, keys):
        table = state.shared.parts[self.spec.name]
        tenant = jnp.zeros_like(state.lengths) if state.tenant is None else state.tenant
        tok, drafts = last_tokens(state), []
        for _ in range(self.k):
            known = (table.owner[tok] == tenant) & (table.after[tok] >= 0)
            tok = jnp.where(known, table.after[tok], params[tok] if self.prior else tok)
            drafts.append(tok)
        return jnp.stack(drafts, axis=1).astype(jnp.int32), None, pstate


def build_successors(spec, assets):
    v = assets.target.config.vocab_size
    prior = assets.methods.get("successors")
    prior = jnp.arange(v, dtype=jnp.int32) if prior is None else jnp.asarray(prior, jnp.int32)
    return SuccessorProposer(k=spec.k, spec=SuccessorSpec(vocab=v), prior=spec.options.succ_prior), prior


@pytest.fixture
def successors(monkeypatch):
    """The toy method's record: its options, its asset's loader, its proposer (which declares its
    shared state), registered for this test only."""
    prior = registry.Flag("--succ-prior", "succ_prior", lambda text: {"on": True, "off": False}[text],
                          "successors: draft the loaded prior where the shared table knows no successor (on/off)")
    monkeypatch.setitem(registry.RECORDS, "successors", registry.Record(
        "successors", build_successors, option_type=SuccessorOptions, flags=(prior,),
        flag="--successors-prior", flag_value="FILE", flag_help="successors: a prior successor per token (.npy)",
        load=lambda host, path: np.load(path)))


def test_toy_method_with_an_option_an_asset_and_shared_state(tiny_model, successors, tmp_path):
    """The asset (a prior successor per token, from a plain run) makes the first request's drafts
    right; the option turns it off; the shared state, kept by the scheduler across requests, makes
    a repeated request's drafts right without it. Greedy output equals plain throughout."""
    eng = Engine(tiny_model)
    plain = [r.tokens for r in eng.generate(PROMPTS, max_new_tokens=12)]
    prior = np.arange(tiny_model.config.vocab_size)
    for p, t in zip(PROMPTS, plain):
        text = p + t
        prior[text[:-1]] = text[1:]
    np.save(tmp_path / "prior.npy", prior)
    eng.load_asset("successors", str(tmp_path / "prior.npy"))
    kept = {}
    for use in (True, False):
        res = eng.generate(PROMPTS, max_new_tokens=12, spec=SpecConfig.make("successors", k=3, succ_prior=use))
        assert [r.tokens for r in res] == plain
        kept[use] = sum(r.counters.num_accepted_tokens for r in res)
    assert kept[True] > kept[False]
    with pytest.raises(ValueError, match="succ_prior= applies to method 'successors' only"):
        SpecConfig.make("ngram", succ_prior=False)
    s = Scheduler(eng, slots=1, spec=SpecConfig.make("successors", k=3, succ_prior=False), chunk=2,
                  opts=GenerateOptions(max_new_tokens=12), max_prompt_tokens=32)
    for p in (PROMPTS[2], PROMPTS[2]):
        s.submit(p)
    first, again = s.run()
    assert first.tokens == again.tokens == plain[2]
    assert again.target_forwards < first.target_forwards
    assert s.memory(measured=False).parts["successors"] == 8 * tiny_model.config.vocab_size


def test_toy_method_through_the_command_line(tiny_model, successors, tmp_path):
    """The CLI takes the toy method's option flag and asset flag from its record alone: the parser
    offers them, `spec_of` builds its spec from them, and its asset loads through `load_assets`
    (what `engine_for` runs after the model)."""
    from specjax.cli import commands as cli
    from specjax.cli import specs

    v = tiny_model.config.vocab_size
    np.save(tmp_path / "prior.npy", (np.arange(v) + 1) % v)
    args = cli.build_parser().parse_args(["generate", "--prompt", "x", "--method", "successors", "--k", "3",
                                          "--succ-prior", "off", "--successors-prior", str(tmp_path / "prior.npy")])
    assert specs.spec_of(args, args.method, strict=True) == SpecConfig.make("successors", k=3, succ_prior=False)
    specs.check_given(args, [args.method], how=specs.NEEDS_FLAG)
    eng = Engine(tiny_model)
    specs.load_assets(eng, args, [args.method])
    assert (np.asarray(eng.asset("successors")) == (np.arange(v) + 1) % v).all()
    bare = cli.build_parser().parse_args(["generate", "--prompt", "x", "--method", "successors"])
    with pytest.raises(ValueError, match="--method successors needs --successors-prior FILE"):
        specs.check_given(bare, [bare.method], how=specs.NEEDS_FLAG)
