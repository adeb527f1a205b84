"""A method is one module plus one registry record: a toy proposer defined and registered here alone
runs through the Engine, greedy output equal to plain decoding; no host names a method."""

import dataclasses
import pathlib
import re
from types import SimpleNamespace

import jax.numpy as jnp
import pytest
from flax import struct
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Int

from specjax import sharding
from specjax.methods.config import SpecConfig
from specjax.serving.engine import Engine
from specjax.methods import registry
from specjax.core.proposer import Stateless
from specjax.core.state import last_tokens

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
    with pytest.raises(ValueError, match="'medusa' only"):  # another method's option
        SpecConfig(method="follow", tree="small")


def test_toy_params_are_placed_by_their_axes(tiny_model):
    """Placement on a mesh reads the axes the params declare: the table is vocabulary-parallel."""
    mesh = sharding.make_mesh(data=1, model=2)
    _, params = build_follow(SimpleNamespace(k=2), registry.Assets(target=tiny_model))
    placed = sharding.place_pparams(params, mesh)
    assert placed.after.sharding.spec == P("model") and (placed.after == params.after).all()


def test_unregistered_method_is_refused():
    with pytest.raises(ValueError, match="unknown method 'follow'"):
        SpecConfig(method="follow")


def test_no_host_names_a_method():
    """`grep -rnE '"(medusa|eagle|draft|ngram)"' specjax/*.py` finds nothing: the hosts ask the records."""
    pattern = re.compile(r'"(medusa|eagle|draft|ngram)"')
    hits = [f"{f.name}:{i}: {line.strip()}" for f in sorted((ROOT / "specjax").glob("*.py"))
            for i, line in enumerate(f.read_text().splitlines(), 1) if pattern.search(line)]
    assert not hits, "\n".join(hits)


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

    eng = Engine(tiny_model, draft=loader.init_model(model_config.preset("tiny"), seed=1),
                 heads=MedusaHeads(HeadsConfig.for_model(tiny_model.config, num_heads=4), base=tiny_model,
                                   rngs=nnx.Rngs(0)))
    eng.set_eagle(EagleHead(EagleConfig.for_model(tiny_model.config, draft_vocab=64), rngs=nnx.Rngs(2)),
                  np.arange(64))
    specs = [SpecConfig(method=m, k=3) for m in registry.RECORDS]
    specs += [SpecConfig(method="medusa", tree="small"), SpecConfig(method="eagle", k=3, nodes=6, topk=2)]
    for spec in specs:
        proposer, _ = eng.proposer(spec)
        assert isinstance(proposer, Proposer), spec
        topo, taps = proposer.topology, proposer.taps
        assert isinstance(taps, tuple) and all(isinstance(t, int) for t in taps), spec
        want = tree.DynamicTopology if spec.nodes else tree.Topology
        assert isinstance(topo, want) and topo.max_depth == spec.depth == proposer.k, spec
        assert topo.is_chain == (not spec.is_tree), spec
        window = len(spec.tree) + 1 if spec.tree else (spec.nodes or spec.k) + 1  # the root and every node
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
