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

from specjax.core.decoder import Decoder
from specjax.core.slots import Slots
from specjax.methods import NgramProposer
from specjax.methods.config import SpecConfig
from specjax.models.eagle import EagleConfig, EagleHead
from specjax.serving.engine import Engine

PROMPTS = [[5, 9, 12, 5, 9, 12, 5, 9], list(range(1, 31)), [40, 41, 42, 43, 40, 41]]  # all longer than W
NEW = 24
SPECS = {
    "ngram-k1": SpecConfig(method="ngram", k=1), "ngram-k4": SpecConfig(method="ngram", k=4),
    "draft-k3": SpecConfig(method="draft", k=3),
    "medusa-k3": SpecConfig(method="medusa", k=3), "medusa-tree": SpecConfig(method="medusa", tree="small"),
    "eagle-k3": SpecConfig(method="eagle", k=3), "eagle-tree": SpecConfig(method="eagle", k=3, nodes=8, topk=3),
}


@pytest.fixture(scope="module")
def model():
    return random_model(CONFIG)


@pytest.fixture(scope="module")
def eng(model):
    eng = Engine(model, draft=random_model(CONFIG, seed=1), heads=random_heads(model))
    head = EagleHead(EagleConfig.for_model(model.config, draft_vocab=64), rngs=nnx.Rngs(0))
    eng.set_eagle(head, np.arange(64))
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


@pytest.mark.parametrize("spec", SPECS)
def test_every_proposer_equals_plain(eng, ref, spec):
    res = eng.generate(PROMPTS, max_new_tokens=NEW, spec=SPECS[spec])
    assert [r.tokens for r in res] == ref


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
    from specjax.core.decoder import Inputs

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
