"""Vocabulary safety: an id outside [0, V) never poisons a row, and assets carrying one are refused.

`jnp.take` fills an out-of-range row with NaN, and attention multiplies masked cache slots by exactly
zero (0 x NaN = NaN), so one bad draft's K/V would corrupt every later step of its row. The model's
embedding lookups clip instead; every id a proposer can draft is in range by construction (its draft
vocabulary is checked where it is loaded). Here drafts outside the vocabulary (too large and negative)
go through the real loop, chain and tree, greedy and the sampled program: the output equals plain and
nothing in the cache or the logits is NaN.
"""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax.methods.config import TREES, SpecConfig
from specjax.core.decoder import verify
from specjax.serving.engine import Engine, GenerateOptions
from specjax.models import eagle_io, heads_io
from specjax.models.eagle import EagleConfig, EagleHead
from specjax.models.heads import HeadsConfig, MedusaHeads
from specjax.methods import EagleProposer, MedusaProposer, NgramProposer
from specjax.core.proposer import Stateless
from specjax.core.sampling import Greedy, Sample
from specjax.core.tree import chain_topology
from specjax.methods.eagle.record import LoadedEagle
from test_speculative import PROMPTS, REF_NEW, _state, _table

M = 17


def bad_ids(vocab: int) -> jnp.ndarray:
    """Ids no embedding has: the first past the end, far past it, negative, the int32 extremes."""
    return jnp.asarray([vocab, vocab + 7, -1, -vocab - 3, 2**31 - 1, -(2**31)], jnp.int32)


@dataclasses.dataclass(frozen=True, kw_only=True)
class OutOfRangeChain(Stateless):
    """Row b's first `right[b]` drafts are the true greedy tokens; the rest are out of range."""

    k: int
    vocab: int

    def propose(self, params, pstate, state, sampling_config, keys):
        table, right = params
        j = jnp.arange(self.k)[None, :]
        cols = jnp.minimum(state.lengths[:, None] + j, table.shape[1] - 1)
        true = jnp.take_along_axis(table, cols, axis=1)
        bad = bad_ids(self.vocab)
        wrong = bad[(state.lengths[:, None] + j) % bad.shape[0]]
        return jnp.where(j < right[:, None], true, wrong), None, pstate


@dataclasses.dataclass(frozen=True, kw_only=True)
class OutOfRangeTree(Stateless):
    """The true greedy tokens along the rank-0 path, out-of-range ids on every other node."""

    k: int
    tree: tuple
    vocab: int

    @property
    def paths(self):
        return self.tree

    def propose(self, params, pstate, state, sampling_config, keys):
        table, _ = params
        bad = bad_ids(self.vocab)
        toks = []
        for i, path in enumerate(self.tree):
            cols = jnp.minimum(state.lengths - 1 + len(path), table.shape[1] - 1)
            true = jnp.take_along_axis(table, cols[:, None], axis=1)[:, 0]
            on = all(r == 0 for r in path)
            toks.append(true if on else jnp.broadcast_to(bad[i % bad.shape[0]], true.shape))
        return jnp.stack(toks, axis=1), None, pstate


@pytest.fixture(scope="module")
def eng(tiny_model):
    return Engine(tiny_model)


@pytest.fixture(scope="module")
def ref(eng):
    return [r.tokens for r in eng.generate(PROMPTS, max_new_tokens=REF_NEW)]


def _finite_state(batch):
    cache = batch.state.decode.cache
    for buf in (*cache.k, *cache.v):
        assert bool(jnp.isfinite(buf).all()), "a NaN/inf reached the KV cache"


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("sampled", [False, True])
def test_out_of_range_chain_drafts_equal_plain(eng, ref, monkeypatch, k, sampled):
    vocab = eng.config.vocab_size
    params = (_table(ref), jnp.asarray([0, 1, k], jnp.int32))  # rows keep 0, 1, k true drafts
    monkeypatch.setattr(eng, "proposer", lambda spec: (OutOfRangeChain(k=spec.k, vocab=vocab), params))
    batch = eng.start(PROMPTS, GenerateOptions(max_new_tokens=M), spec=SpecConfig(method="ngram", k=k),
                      sampling_config=(Sample() if sampled else Greedy()))
    res = batch.run()
    assert [r.tokens for r in res] == [t[:M] for t in ref]  # temperature 0 rows of a sampled program too
    assert sum(r.counters.num_accepted_tokens for r in res) > 0  # the true drafts were kept
    _finite_state(batch)


def test_out_of_range_tree_drafts_equal_plain(eng, ref, monkeypatch):
    """Off-path nodes (masked for the accepted path, compacted away) carry out-of-range ids."""
    tree = TREES["small"]
    depth = max(len(p) for p in tree)
    prop = OutOfRangeTree(k=depth, tree=tree, vocab=eng.config.vocab_size)
    params = (_table(ref), None)
    monkeypatch.setattr(eng, "proposer", lambda spec: (prop, params))
    batch = eng.start(PROMPTS, GenerateOptions(max_new_tokens=M), spec=SpecConfig.make("medusa", tree=tree))
    res = batch.run()
    assert [r.tokens for r in res] == [t[:M] for t in ref]
    assert all(r.tau > 1 for r in res)
    _finite_state(batch)


def test_out_of_range_ngram_drafts_equal_plain(eng, ref, monkeypatch):
    """Prompt lookup patched to shift its drafts out of the vocabulary (up and down)."""
    vocab = eng.config.vocab_size
    propose = NgramProposer.propose

    def shifted(self, params, pstate, state, sampling_config, keys):
        draft, q, pstate = propose(self, params, pstate, state, sampling_config, keys)
        j = jnp.arange(draft.shape[1])[None, :]
        return jnp.where(j % 2 == 0, draft + vocab, -1 - draft), q, pstate

    monkeypatch.setattr(NgramProposer, "propose", shifted)
    res = eng.generate(PROMPTS, max_new_tokens=M, spec=SpecConfig(method="ngram", k=3))
    assert [r.tokens for r in res] == [t[:M] for t in ref]


def test_verify_logits_finite_for_any_id(tiny_model):
    """The target's forward over a window of out-of-range ids: every logit is finite."""
    v = tiny_model.config.vocab_size
    nodes = bad_ids(v)[None, :]
    state = _state([3], capacity=16).replace(cache=tiny_model.init_cache(1, 16))
    out = jax.jit(lambda s, n: verify(tiny_model, s, n, chain_topology(n.shape[1])))(state, nodes)
    assert bool(jnp.isfinite(out.logits).all())
    for buf in (*out.cache.k, *out.cache.v):
        assert bool(jnp.isfinite(buf).all())


def test_heads_embedding_lookups_finite_for_any_id(tiny_model):
    cfg = tiny_model.config
    toks = bad_ids(cfg.vocab_size)
    h = jax.random.normal(jax.random.key(0), (toks.shape[0], cfg.dim))
    heads = MedusaHeads(HeadsConfig.for_model(cfg, token_input=True), rngs=nnx.Rngs(0))
    heads.u[...] = jnp.ones_like(heads.u[...]) * 0.1  # the token's embedding matters
    assert bool(jnp.isfinite(heads(h, tiny_model, toks)).all())
    prop, params = MedusaProposer.from_heads(heads, tiny_model, k=2)
    assert bool(jnp.isfinite(prop.head_logits(params, h, toks)).all())


# ---- draft vocabularies are checked where they are loaded ------------------------------------------


def _eagle_head(model):
    return EagleHead(EagleConfig.for_model(model.config, draft_vocab=8), rngs=nnx.Rngs(0))


@pytest.mark.parametrize("bad", [-1, 64, 1000])
def test_eagle_draft_ids_out_of_range_refused(tiny_model, tmp_path, bad):
    v = tiny_model.config.vocab_size
    head = _eagle_head(tiny_model)
    ids = np.arange(8, dtype=np.int32)
    ids[5] = bad
    with pytest.raises(ValueError, match=rf"draft_ids.*{bad}.*vocabulary of {v}"):
        EagleProposer.from_head(head, ids, tiny_model, k=2)
    with pytest.raises(ValueError, match=rf"{bad}.*vocabulary of {v}"):
        Engine(tiny_model).set_asset("eagle", LoadedEagle(head, ids))
    with pytest.raises(ValueError, match=rf"{bad}.*vocabulary of {v}"):
        eagle_io.save_head(tmp_path / "refused", head, ids, dict(model="tiny", weights_id="w"))
    assert not (tmp_path / "refused" / "manifest.json").exists()
    # a directory holding such ids (written past the check) is refused at load, naming the file
    heads_io.save_atomically(tmp_path / "h", dict(head=eagle_io.params_of(head), draft_ids=ids),
                             dict(model="tiny", weights_id="w", eagle_config=head.config.to_dict(),
                                  format=eagle_io.FORMAT), None)
    with pytest.raises(ValueError) as e:
        eagle_io.load_head(tmp_path / "h", model_name="tiny")
    msg = str(e.value)
    assert str(tmp_path / "h") in msg and "params-" in msg and f"{bad}" in msg and f"vocabulary of {v}" in msg
    assert msg.count("\n") == 0
    with pytest.raises(ValueError, match=rf"{bad}.*vocabulary of {v}"):
        Engine(tiny_model, name="tiny").load_asset("eagle", str(tmp_path / "h"))


def test_eagle_draft_ids_in_range_round_trip(tiny_model, tmp_path):
    head = _eagle_head(tiny_model)
    ids = np.arange(56, 64, dtype=np.int32)  # the last ids of the vocabulary are fine
    eagle_io.save_head(tmp_path / "h", head, ids, dict(model="tiny", weights_id="w"))
    _, got, _ = eagle_io.load_head(tmp_path / "h", model_name="tiny")
    np.testing.assert_array_equal(got, ids)


def test_medusa_vocab_json_out_of_range_refused(tiny_model, tmp_path):
    v = tiny_model.config.vocab_size
    heads = MedusaHeads(HeadsConfig.for_model(tiny_model.config), rngs=nnx.Rngs(0))
    heads_io.save_heads(tmp_path, heads, dict(model="tiny", weights_id="w"))
    eng = Engine(tiny_model, name="tiny")
    for bad in ([1, 2, v], [3, -1], [1, "x"], {"a": 1}, []):
        (tmp_path / "vocab.json").write_text(json.dumps(bad))
        with pytest.raises(ValueError) as e:
            eng.load_asset("medusa", str(tmp_path))
        assert str(tmp_path / "vocab.json") in str(e.value), e.value
        assert eng.asset("medusa") is None
    (tmp_path / "vocab.json").write_text(json.dumps([1, 2, v]))
    with pytest.raises(ValueError, match=rf"id {v} .*vocabulary of {v}"):
        eng.load_asset("medusa", str(tmp_path))
    (tmp_path / "vocab.json").write_text(json.dumps([1, 2, v - 1]))
    eng.load_asset("medusa", str(tmp_path))
    assert eng.asset("medusa").vocab == (1, 2, v - 1)


def test_shipped_draft_vocabularies_are_in_range():
    """The shipped heads' draft vocabularies pass the load-time check (read without the model)."""
    med = heads_io.shipped_heads_dir("smollm2-135m")
    manifest = json.loads((med / "manifest.json").read_text())
    extras = heads_io.load_extras(med, manifest["heads_config"]["vocab_size"])
    assert extras["vocab"] is not None and len(extras["vocab"]) > 0
    eagle = eagle_io.shipped_eagle_dir("smollm2-135m")
    head, ids, manifest = eagle_io.load_head(eagle, model_name="smollm2-135m")
    assert ids.min() >= 0 and ids.max() < manifest["eagle_config"]["vocab_size"]
