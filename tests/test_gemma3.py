"""A tiny Gemma 3 (sliding window of 4) through the decoder: the plain loop equals a full forward's
greedy tokens, and every proposer's greedy output equals the plain loop's; a base model refuses
chat mode in one line."""

import numpy as np
import pytest
import jax.numpy as jnp
from conftest import padded_logits
from flax import nnx
from test_kv_cache import CONFIG, random_model
from test_medusa import random_heads
from test_speculative import TableProposer, _table

from specjax.core.decoder import Decoder, Inputs
from specjax.core.slots import Slots
from specjax.methods import NgramProposer
from specjax.methods.config import SpecConfig
from specjax.models.eagle import EagleConfig, EagleHead
from specjax.models.gemma3 import Gemma3
from specjax.serving.engine import Engine
from specjax.methods.eagle.record import LoadedEagle
from specjax.methods.draft.record import DraftModel
from specjax.methods.medusa.record import LoadedHeads

PROMPTS = [[5, 9, 12, 5, 9, 12, 5, 9], list(range(1, 31)), [40, 41, 42, 43, 40, 41]]  # all longer than W
NEW = 24
SPECS = {
    "ngram-k1": SpecConfig(method="ngram", k=1), "ngram-k4": SpecConfig(method="ngram", k=4),
    "draft-k3": SpecConfig(method="draft", k=3), "draft-k6": SpecConfig(method="draft", k=6),
    "medusa-k3": SpecConfig(method="medusa", k=3), "medusa-tree": SpecConfig.make("medusa", tree="small"),
    "eagle-k3": SpecConfig(method="eagle", k=3), "eagle-tree": SpecConfig.make("eagle", k=3, nodes=8, topk=3),
}


@pytest.fixture(scope="module")
def model():
    return random_model(CONFIG)


@pytest.fixture(scope="module")
def eng(model):
    eng = Engine(model, assets={"draft": DraftModel(random_model(CONFIG, seed=1)),
                                "medusa": LoadedHeads(random_heads(model))})
    head = EagleHead(EagleConfig.for_model(model.config, draft_vocab=64), rngs=nnx.Rngs(0))
    eng.set_asset("eagle", LoadedEagle(head, np.arange(64)))
    return eng


@pytest.fixture(scope="module")
def ref(eng):
    return [r.tokens for r in eng.generate(PROMPTS, max_new_tokens=NEW)]


def test_plain_loop_equals_the_full_forward_argmax(model, ref):
    """The plain loop (its cache a ring of W entries) gives, at every step, the argmax of a full
    forward over prompt + what it generated so far (teacher forcing: the same logits)."""
    seqs = [p + r for p, r in zip(PROMPTS, ref)]
    logits = padded_logits(model, seqs)
    for p, r, row in zip(PROMPTS, ref, logits):
        np.testing.assert_array_equal(row[len(p) - 1: len(p) + len(r) - 1].argmax(-1), r)


@pytest.fixture(scope="module")
def full_buffers():
    """Every cache the model (target and draft) builds with full buffers, the window in the mask."""
    def use(monkeypatch):
        build = Gemma3.init_cache
        monkeypatch.setattr(Gemma3, "init_cache", lambda self, batch, length, window=None: build(self, batch, length))
    return use


@pytest.mark.parametrize("spec", SPECS)
def test_every_proposer_equals_plain_and_its_ring_changes_nothing(eng, ref, spec, full_buffers, monkeypatch):
    """Greedy identity; and the same drafts accepted, step for step, as with full buffers (a draft
    model's own ring included: a wrong one would change its drafts, never the output)."""
    res = eng.generate(PROMPTS, max_new_tokens=NEW, spec=SPECS[spec])
    assert [r.tokens for r in res] == ref
    full_buffers(monkeypatch)
    full = eng.generate(PROMPTS, max_new_tokens=NEW, spec=SPECS[spec])
    assert [r.counters for r in res] == [r.counters for r in full]
    if SPECS[spec].method != "eagle":  # a random EAGLE head is never right here
        assert sum(r.counters.num_accepted_tokens for r in res) > 0


def test_a_draft_equal_to_the_target_accepts_everything(eng, ref, model, monkeypatch):
    """The draft's own ring stays exact although its drafts run K positions past the commit (a ring
    built for its 2-token forwards alone would lose context it needs, and its drafts with it)."""
    monkeypatch.setitem(eng.assets.methods, "draft", DraftModel(model))
    k, m = 4, 21  # (m - 1) % (k + 1) == 0: an always-right draft commits k + 1 a step
    res = eng.generate(PROMPTS, max_new_tokens=m, spec=SpecConfig(method="draft", k=k))
    for r, want in zip(res, ref):
        assert r.tokens == want[:m] and r.counters.accept_hist == [0] * k + [(m - 1) // (k + 1)]


def _drafts_with_rejections(model, draft, k, steps=12):
    """A draft model's drafts over `steps` steps that each reject them all (the pending token's
    correction is committed alone), the worst case for its cache: it re-reads its context after
    writing k positions past it."""
    import jax

    from specjax.core.sampling import Greedy
    from specjax.core.state import commit
    from specjax.methods import DraftModelProposer

    prop, params = DraftModelProposer.from_model(draft, k=k)
    inputs = Inputs.create(PROMPTS, bucket=32, max_new_tokens=64)
    dec = Decoder(cache_length=128, proposer=prop)
    state, hidden = dec.prefill_target(model, inputs)
    pstate = prop.init(params, state, inputs, hidden)
    propose = jax.jit(lambda pstate, state: prop.propose(params, pstate, state, Greedy(), state.keys))
    out = []
    for _ in range(steps):
        drafts, _, pstate = propose(pstate, state)
        out.append(np.asarray(drafts))
        state = commit(state, (drafts[:, :1] + 1) % 64, jnp.ones((3,), jnp.int32), window=k + 1)[0]
    return np.stack(out)


def test_a_draft_models_ring_keeps_its_context(model, full_buffers, monkeypatch):
    """The draft writes k positions past the commit before it reads its context again: its ring is
    built for that, so its drafts equal those from full buffers."""
    draft = random_model(CONFIG, seed=1)
    ring = _drafts_with_rejections(model, draft, k=6)
    full_buffers(monkeypatch)
    np.testing.assert_array_equal(ring, _drafts_with_rejections(model, draft, k=6))


@pytest.mark.parametrize("right", [[4, 4, 4], [0, 1, 4], [2, 3, 1]])
def test_windows_accepting_every_depth_equal_plain(eng, ref, right, monkeypatch):
    """A proposer right exactly `right[b]` times a step: rows commit 1 .. 5 tokens a step, so
    windows start at every offset of the ring and straddle its end, with rejected drafts in it."""
    params = (_table(ref), jnp.asarray(right, jnp.int32))
    monkeypatch.setattr(eng, "proposer", lambda spec: (TableProposer(k=spec.k, vocab=64), params))
    res = eng.generate(PROMPTS, max_new_tokens=NEW, spec=SpecConfig(method="ngram", k=4))
    assert [r.tokens for r in res] == ref


def test_slots_build_the_ring_for_the_widest_option(model):
    """Options of different windows share one cache: it is built for the widest."""
    slots = Slots(base=Decoder(cache_length=64), decoders=(Decoder(cache_length=64, proposer=NgramProposer(k=4)),))
    assert slots.window == 5
    state, _ = slots.prefill(model, ((),), Inputs.create(PROMPTS, bucket=32, max_new_tokens=4))
    assert state.cache.ring == CONFIG.sliding_window - 1 + 5


def test_chat_mode_without_a_template_is_one_clear_error(eng, monkeypatch):
    class Plain:  # a tokenizer without a chat template (a base model's)
        chat_template = None

    monkeypatch.setattr(eng, "tokenizer", Plain())
    with pytest.raises(ValueError, match="has none .a base model completes text.: give the prompt as plain text"):
        eng.generate(["hello"], chat=True)
