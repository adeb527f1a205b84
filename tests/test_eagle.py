"""EAGLE proposer, chain and dynamic tree: greedy identity with the plain loop (random and trained
heads, ragged batches), drafts accepted, the dynamic tree's mask against explicit forwards, fixed
shapes (compile counts), lossless sampling, and bad input."""

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import padded_logits
from flax import nnx

from specjax.core import tree as tree_lib
from specjax.methods.config import SpecConfig
from specjax.core.decoder import Decoder, Inputs
from specjax.serving.engine import Engine
from specjax.models import loader
from specjax.models.eagle import EagleConfig, EagleHead
from specjax.methods.eagle.proposer import EagleProposer
from specjax.methods.eagle.record import LoadedEagle
from train_heads import eagle as train
from train_heads import sequences

PROMPTS = [[5, 9, 12, 5, 9, 12, 5, 9], list(range(1, 31)), [40, 41, 42, 43, 40, 41]]
NEW = 32
SPECS = {"chain1": dict(k=1), "chain4": dict(k=4), "tree": dict(k=3, nodes=8, topk=3),
         "tree_deep": dict(k=5, nodes=16, topk=2)}


def random_head(model, seed=0):
    return EagleHead(EagleConfig.for_model(model.config, draft_vocab=model.config.vocab_size), rngs=nnx.Rngs(seed))


@pytest.fixture(scope="module")
def trained(tiny_model, tmp_path_factory):
    """A head trained for a few seconds on the tiny target's own greedy continuations."""
    eng = Engine(tiny_model)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 64, size=4).tolist() for _ in range(48)]
    seqs = [p + r.tokens for p, r in zip(prompts, eng.generate(prompts, max_new_tokens=28))]
    t = 32
    data = sequences.Sequences.pad([(np.asarray(s[:t], np.int32), np.arange(min(len(s), t)) >= 4) for s in seqs], t)
    cfg = EagleConfig.for_model(tiny_model.config, draft_vocab=64)
    ids = sequences.draft_vocabulary(data.tokens, data.mask, 64, 64)
    tc = train.EagleTrainConfig(steps=150, batch_size=8, seq_len=t, lr=1e-2, warmup=5, unroll=3,
                                save_every=1000, eval_every=1000, log_every=50)
    tr = train.EagleTrainer(cfg, tiny_model, sequences.Sequences(data.tokens[:40], data.mask[:40]),
                            sequences.Sequences(data.tokens[40:], data.mask[40:]), ids, tmp_path_factory.mktemp("e"), tc)
    metrics = tr.fit(progress=False)
    tr.ckpts.close()
    assert metrics["acc"][0] > 0.3, metrics
    return tr.head, ids


@pytest.fixture(scope="module")
def ref(tiny_model):
    return [r.tokens for r in Engine(tiny_model).generate(PROMPTS, max_new_tokens=NEW)]


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("which", ["random", "trained"])
def test_greedy_equals_plain(tiny_model, trained, ref, spec, which):
    eng = Engine(tiny_model)
    if which == "random":
        eng.set_asset("eagle", LoadedEagle(random_head(tiny_model), np.arange(64)))
    else:
        eng.set_asset("eagle", LoadedEagle(*trained))
    out = eng.generate(PROMPTS, max_new_tokens=NEW, spec=SpecConfig.make("eagle", **SPECS[spec]))
    assert [r.tokens for r in out] == ref
    if which == "trained":
        assert sum(r.counters.num_accepted_tokens for r in out) > 0, "no draft was ever accepted"
        hist = sum(np.asarray(r.counters.accept_hist) for r in out)
        assert hist[0] > 0 and hist[1:].sum() > 0  # ragged: rows accept different counts


def test_batch_and_draft_vocabulary(tiny_model, trained, ref):
    """Rows of one batch accept different counts (ragged); a smaller draft vocabulary stays exact."""
    eng = Engine(tiny_model)
    eng.set_asset("eagle", LoadedEagle(*trained))
    for spec in (SpecConfig.make("eagle", k=4, draft_vocab=16), SpecConfig.make("eagle", k=3, nodes=8, draft_vocab=16)):
        out = eng.generate(PROMPTS, max_new_tokens=NEW, spec=spec, batch_size=4)
        assert [r.tokens for r in out] == ref


def dynamic_tree(tiny_model, head, ids, spec, prompts):
    proposer, pparams = EagleProposer.from_head(head, ids, tiny_model, **spec)
    dec = Decoder(proposer=proposer, cache_length=48)
    inputs = Inputs.create(prompts, max_new_tokens=8)
    state = dec.prefill(tiny_model, pparams, inputs)
    drafts, _, _ = proposer.propose(pparams, state.proposer, state.decode, dec.sampling, state.decode.keys)
    return dec, state, drafts


def test_dynamic_tree_mask_equals_a_forward_over_each_path(tiny_model, trained):
    """Every node of the tree built on device sees the committed prefix and its ancestors only:
    its verify logits equal a causal forward over prefix + path."""
    from specjax.core.decoder import verify

    head, ids = trained
    dec, state, drafts = dynamic_tree(tiny_model, head, ids, dict(k=3, nodes=10, topk=3), PROMPTS[:2])
    assert isinstance(drafts, tree_lib.DraftTree) and drafts.tokens.shape == (2, 10)
    win = drafts.window
    par = np.asarray(win.parent)
    assert (par[:, 1:] < np.arange(1, 11)[None]).all()  # parents first
    out = verify(tiny_model, state.decode, drafts.tokens, win)
    s = state.decode
    seqs, nodes = [], []  # prefix + path of every node, (row, node)
    for b in range(2):
        length = int(s.lengths[b])
        prefix = np.asarray(s.tokens[b, :length]).tolist()
        window = [prefix[-1]] + np.asarray(drafts.tokens[b]).tolist()
        sibling_sets = {}
        for w in range(1, 11):
            path, v = [], w
            while v:
                path.append(v)
                v = par[b, v]
            path = path[::-1]
            assert len(path) == int(win.depth[b, w])
            sibling_sets.setdefault(par[b, w], []).append(window[w])
            seqs.append(prefix + [window[u] for u in path])
            nodes.append((b, w))
        assert all(len(set(x)) == len(x) for x in sibling_sets.values())  # siblings distinct
    full = padded_logits(tiny_model, seqs, 48)  # one causal forward over every sequence
    for i, (b, w) in enumerate(nodes):
        np.testing.assert_allclose(out.logits[b, w], full[i, len(seqs[i]) - 1], atol=1e-5)


def test_dynamic_tree_picks_the_most_probable_paths(tiny_model, trained):
    """The tree holds the nodes of highest path probability under the head."""
    head, ids = trained
    _, state, drafts = dynamic_tree(tiny_model, head, ids, dict(k=2, nodes=3, topk=3), PROMPTS[:1])
    par = np.asarray(drafts.window.parent)[0]
    # with a budget of 3 from 3 root children and 3 x 3 grandchildren, the best 3 include the best root child
    root_children = np.asarray(drafts.tokens[0])[par[1:] == 0]
    proposer, pparams = EagleProposer.from_head(head, ids, tiny_model, k=2, nodes=3, topk=3)
    logits = head.logits(state.proposer.feature, pparams.lm_rows)[0]
    assert int(pparams.ids[jnp.argmax(logits)]) in root_children.tolist()


def test_fixed_shapes_compile_once(tiny_model, trained):
    eng = Engine(tiny_model)
    eng.set_asset("eagle", LoadedEagle(*trained))
    spec = SpecConfig.make("eagle", k=3, nodes=8)
    eng.generate(PROMPTS[:1], max_new_tokens=NEW, spec=spec)
    before = eng.compile_count
    eng.generate([PROMPTS[2], PROMPTS[0][:5]], max_new_tokens=NEW - 3, spec=spec, batch_size=1)
    eng.generate(PROMPTS[:1], max_new_tokens=NEW, spec=spec, temperature=0.0)
    assert eng.compile_count == before


def test_bad_eagle_input(tiny_model, trained, tiny_config):
    eng = Engine(tiny_model)
    before = eng.compile_count
    with pytest.raises(ValueError, match="EAGLE head"):
        eng.generate(PROMPTS[:1], max_new_tokens=4, spec=SpecConfig(method="eagle", k=2))
    with pytest.raises(ValueError, match="candidates"):
        EagleProposer.from_head(trained[0], trained[1], tiny_model, k=2, nodes=50, topk=2)
    with pytest.raises(ValueError, match="draft_vocab"):
        EagleProposer.from_head(trained[0], trained[1], tiny_model, k=2, draft_vocab=1000)
    with pytest.raises(ValueError, match="eagle"):
        SpecConfig.make("medusa", nodes=4)
    other = loader.init_model(tiny_config.__class__(**{**tiny_config.__dict__, "dim": 16, "head_dim": 4}), seed=0)
    with pytest.raises(ValueError, match="this model"):
        Engine(other).set_asset("eagle", LoadedEagle(trained[0], trained[1]))
    assert eng.compile_count == before


# ---- sampling is lossless (the chi-square harness of test_lossless) -------------------------------


@pytest.mark.parametrize("spec,setting", [(dict(k=2), "t1.0"), (dict(k=2), "t0.8_k6_p0.9"),
                                          (dict(k=3, nodes=6, topk=2), "t0.7"),
                                          (dict(k=3, nodes=6, topk=2), "top_p0.8")])
def test_samples_follow_the_target(spec, setting):
    import test_lossless as tl

    target = loader.init_model(tl.CONFIG, seed=0)
    eng = Engine(target)
    head = EagleHead(EagleConfig.for_model(tl.CONFIG, draft_vocab=tl.V), rngs=nnx.Rngs(3))
    eng.set_asset("eagle", LoadedEagle(head, np.arange(tl.V)))
    opts = tl.SETTINGS[setting]
    batch = eng.start([tl.PROMPT] * tl.N, tl.GenerateOptions(max_new_tokens=tl.NEW, seed=21, **opts),
                      spec=SpecConfig.make("eagle", **spec))
    batch.run()
    toks = np.array(batch.new_tokens())
    pvals = tl.pair_pvalues(toks, tl.joint(tl.conditionals(target, opts)))
    assert min(pvals.values()) > tl.ALPHA, pvals
    hist = np.asarray(batch.state.stats.accept_hist).sum(0)
    assert hist[0] > 0 and hist[1:].sum() > 0  # rejections and accepts both


def test_fused_feature_head_equals_plain(tiny_model, ref):
    """An EAGLE-3 head reads the inputs of some target layers: prefill and verify hand them over."""
    cfg = EagleConfig.for_model(tiny_model.config, features="fused", feature_layers=(0, 1), draft_vocab=64)
    eng = Engine(tiny_model)
    eng.set_asset("eagle", LoadedEagle(EagleHead(cfg, rngs=nnx.Rngs(5)), np.arange(64)))
    for spec in (SpecConfig(method="eagle", k=3), SpecConfig.make("eagle", k=3, nodes=6)):
        assert [r.tokens for r in eng.generate(PROMPTS, max_new_tokens=NEW, spec=spec)] == ref
    dec, _ = eng.build_decoder(SpecConfig(method="eagle", k=3), cache_length=64)
    assert dec.taps == (0, 1)


def test_a_broken_rule_with_the_eagle_chain_is_detected():
    """The chi-square test has power here too: the same EAGLE chain with the rejection rule broken
    (resample from p) is rejected, with the library's rule accepted above."""
    import test_lossless as tl
    from specjax.core.decoder import generate, new_tokens

    target = loader.init_model(tl.CONFIG, seed=0)
    head = EagleHead(EagleConfig.for_model(tl.CONFIG, draft_vocab=tl.V), rngs=nnx.Rngs(3))
    proposer, pparams = EagleProposer.from_head(head, np.arange(tl.V), target, k=2)
    dec = Decoder(proposer=proposer, acceptance=tl.ResampleFromP(), sampling="sample", cache_length=64)
    opts = tl.SETTINGS["t1.0"]
    inputs = Inputs.create([tl.PROMPT] * tl.N, max_new_tokens=tl.NEW, seed=5, **opts)
    toks = np.array(new_tokens(generate(target, inputs, decoder=dec, pparams=pparams)))
    assert min(tl.pair_pvalues(toks, tl.joint(tl.conditionals(target, opts))).values()) < 1e-6


# ---- the real model and the shipped head ---------------------------------------------------------


@pytest.mark.oracle
def test_shipped_head_on_the_real_model_equals_plain(smollm2):
    from specjax.models import eagle_io

    path = eagle_io.shipped_eagle_dir("smollm2-135m")
    assert path is not None, "the EAGLE head for SmolLM2-135M is not in the package"
    eng = Engine(smollm2.model, smollm2.tokenizer, name="smollm2-135m", weights_id=smollm2.weights_id,
                 buckets=(64,))
    eng.load_asset("eagle", "default")
    prompts = ["Write a Python function that returns the sum of a list.", "What is the capital of France?"]
    plain = [r.tokens for r in eng.generate(prompts, chat=True, max_new_tokens=40)]
    for tree in (False, True):
        out = eng.generate(prompts, chat=True, max_new_tokens=40, spec=eng.tuned("eagle", tree=tree))
        assert [r.tokens for r in out] == plain
        assert sum(r.counters.num_accepted_tokens for r in out) > 0
