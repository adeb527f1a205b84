"""Speculative sampling is lossless: generated tokens follow the target's own distribution.

On a vocabulary of 16 the exact joint distribution of the first four generated tokens is
computable (16^3 prefixes in one forward). Thousands of rows with the same prompt and their own
key streams give independent samples, compared with chi-square tests on the pairs (t1, t2),
(t2, t3), (t3, t4). With K = 2 the first speculative step emits t2..t4, so the pairs cover the
accepted drafts, the corrections and the bonus token, not only the prefill's t1.
"""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from conftest import full_logits
from scipy import stats

from specjax.core import acceptance
from specjax.core import sampling
from specjax.core.decoder import Decoder, Inputs, new_tokens
from specjax.core.decoder import generate as specjax_generate
from specjax.methods.config import SpecConfig
from specjax.serving.engine import Engine, GenerateOptions
from specjax.models import config as model_config
from specjax.models import loader
from specjax.core.sampling import SamplingParams
from specjax.methods.draft.record import DraftModel

V = 16
CONFIG = model_config.preset("tiny", vocab_size=V, num_layers=1)
PROMPT = [3, 7, 1, 3, 7, 12]  # repeats, so prompt lookup proposes non-trivial drafts
N = 8192  # samples per setting
NEW = 4
K = 2
ALPHA = 1e-3  # seeds are fixed, so these tests are deterministic
SETTINGS = {
    "t0.7": dict(temperature=0.7),
    "t1.0": dict(temperature=1.0),
    "t1.3": dict(temperature=1.3),
    "top_k4": dict(temperature=1.0, top_k=4),
    "top_p0.8": dict(temperature=1.0, top_p=0.8),
    "t0.8_k6_p0.9": dict(temperature=0.8, top_k=6, top_p=0.9),
}
PAIRS = ((0, 1), (1, 2), (2, 3))


@pytest.fixture(scope="module")
def target():
    return loader.init_model(CONFIG, seed=0)


@pytest.fixture(scope="module")
def draft():
    return loader.init_model(CONFIG, seed=1)


@pytest.fixture(scope="module")
def eng(target, draft):
    return Engine(target, assets={"draft": DraftModel(draft)})


def conditionals(model, opts):
    """Per-position sampling distributions after PROMPT + every 3-token continuation.

    Returns c[t1, t2, t3, i, v] = P(token i+1 = v | PROMPT, t1..ti), for i = 0..3.
    """
    prefixes = np.array(list(itertools.product(range(V), repeat=NEW - 1)), np.int32)
    tokens = np.concatenate([np.tile(PROMPT, (len(prefixes), 1)), prefixes], axis=1)
    logits = full_logits(*nnx.split(model), jnp.asarray(tokens))[:, len(PROMPT) - 1:]
    params = SamplingParams.create(len(prefixes), opts.get("temperature", 0.0), opts.get("top_k", 0),
                                   opts.get("top_p", 1.0))
    return np.asarray(sampling.probs(logits, params), np.float64).reshape((V,) * (NEW - 1) + (NEW, V))


def joint(c):
    """Exact P(t1, t2, t3, t4) from the conditionals."""
    p1 = c[0, 0, 0, 0][:, None, None, None]
    p2 = c[:, 0, 0, 1][:, :, None, None]
    p3 = c[:, :, 0, 2][:, :, :, None]
    return p1 * p2 * p3 * c[:, :, :, 3]


def pair(dist, i, j):
    return dist.sum(axis=tuple(a for a in range(NEW) if a not in (i, j))).ravel()


def chi_square_p(codes, probs):
    """p-value of integer `codes` against `probs`; bins with expected count < 5 are merged.

    Codes of probability 0 must never occur: that is asserted, not tested statistically.
    """
    probs = probs / probs.sum()
    counts = np.bincount(codes, minlength=len(probs)).astype(np.float64)
    assert counts[probs <= 1e-12].sum() == 0, "sampled an outcome the target gives probability 0"
    expected = probs * len(codes)
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    return stats.chisquare(obs[keep], exp[keep]).pvalue


def generate(eng, method, opts, seed, **spec):
    batch = eng.start([PROMPT] * N, GenerateOptions(max_new_tokens=NEW, seed=seed, **opts),
                      spec=SpecConfig.make(method, k=K, **spec))
    batch.run()
    toks = np.array(batch.new_tokens())
    assert toks.shape == (N, NEW)
    return toks, batch.state.stats


def pair_pvalues(toks, dist):
    return {(i, j): chi_square_p(toks[:, i] * V + toks[:, j], pair(dist, i, j)) for i, j in PAIRS}


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_speculative_samples_follow_the_target(eng, target, method, setting):
    opts = SETTINGS[setting]
    seed = 1000 * list(SETTINGS).index(setting) + (method == "ngram")
    dist = joint(conditionals(target, opts))
    np.testing.assert_allclose(dist.sum(), 1.0, rtol=1e-5)
    toks, st = generate(eng, method, opts, seed)
    pvals = pair_pvalues(toks, dist)
    assert min(pvals.values()) > ALPHA, pvals
    # the test exercises both branches: some drafts accepted, some rejected
    accepted, drafted = int(st.accepted.sum()), int(st.drafted.sum())
    assert 0 < accepted < drafted


@pytest.mark.parametrize("setting", ["t1.0", "top_k4"])
def test_prompt_lookup_with_a_shared_table_follows_the_target(eng, target, setting):
    """Drafts from a table every row writes (other rows' samples) stay lossless: they never depend on
    the drafting row's own randomness at that step."""
    opts = SETTINGS[setting]
    toks, st = generate(eng, "ngram", opts, seed=31 + len(setting), ngram_table=61)
    pvals = pair_pvalues(toks, joint(conditionals(target, opts)))
    assert min(pvals.values()) > ALPHA, pvals
    assert 0 < int(st.accepted.sum()) < int(st.drafted.sum())


RECYCLE_TREE = ((0,), (1,), (2,), (0, 0), (1, 0), (2, 0))  # depth K, siblings from one matrix row


@pytest.mark.parametrize("setting", ["t1.0", "top_p0.8"])
def test_recycling_tree_follows_the_target(eng, target, setting):
    """Token recycling's tree (the matrix every row writes, prompt lookup on the spine) under the tree
    rule: its drafts depend on committed text and other rows' earlier windows, never on this step's
    draws, and siblings are distinct tokens, so the samples follow the target."""
    opts = SETTINGS[setting]
    toks, st = generate(eng, "recycle", opts, seed=53 + len(setting), tree=RECYCLE_TREE)
    pvals = pair_pvalues(toks, joint(conditionals(target, opts)))
    assert min(pvals.values()) > ALPHA, pvals
    assert 0 < int(st.accepted.sum()) < int(st.drafted.sum())


@pytest.mark.parametrize("setting", ["t1.0", "top_k4"])
def test_predicted_outputs_follow_the_target(eng, target, setting):
    """Drafts copied from a per-row prediction (here the greedy continuation, so that some are
    accepted and some rejected) depend on committed text and the prediction alone: the samples
    follow the target."""
    opts = SETTINGS[setting]
    predicted = eng.generate([PROMPT], max_new_tokens=2 * NEW)[0].tokens
    batch = eng.start([PROMPT] * N, GenerateOptions(max_new_tokens=NEW, seed=71 + len(setting), **opts),
                      spec=SpecConfig.make("predict", k=K, prediction_cap=16), prediction=[predicted] * N)
    batch.run()
    toks, st = np.array(batch.new_tokens()), batch.state.stats
    pvals = pair_pvalues(toks, joint(conditionals(target, opts)))
    assert min(pvals.values()) > ALPHA, pvals
    assert 0 < int(st.accepted.sum()) < int(st.drafted.sum())


def test_draft_equal_to_target_accepts_everything(eng, target, monkeypatch):
    """p == q: the draft's sampled tokens are all accepted, and the samples still follow p."""
    monkeypatch.setitem(eng.assets.methods, "draft", DraftModel(target))  # same shapes: the compiled programs serve
    opts = SETTINGS["t1.0"]
    toks, st = generate(eng, "draft", opts, seed=7)
    assert int(st.accepted.sum()) >= 0.999 * int(st.drafted.sum())  # not bit-equal: other windows
    pvals = pair_pvalues(toks, joint(conditionals(target, opts)))
    assert min(pvals.values()) > ALPHA, pvals


def _through_scheduler(eng, n, *, stream=None):
    """`n` requests of PROMPT through a Scheduler (draft model, K drafts): rows enter by its insert
    path, several per chunk, each on the stream of its request id (or all on `stream`)."""
    from specjax.serving.scheduler import Scheduler

    s = Scheduler(eng, slots=64, spec=SpecConfig(method="draft", k=K), chunk=2, max_prompt_tokens=len(PROMPT),
                  opts=GenerateOptions(max_new_tokens=NEW, seed=17, **SETTINGS["t1.0"]))
    for _ in range(n):
        s.submit(PROMPT, stream=stream)
    out = s.run()
    assert all(len(r.tokens) == NEW for r in out)
    return np.array([r.tokens for r in out]), sum(r.counters.num_accepted_tokens for r in out)


def test_speculative_sampling_through_the_schedulers_insert_path_follows_the_target(eng, target):
    """Requests admitted into a running batch (the scheduler's insert, not `Engine.generate`'s
    prefill) sample the target's distribution; the control, every request on one random stream,
    is rejected by the same test."""
    n = N // 2
    dist = joint(conditionals(target, SETTINGS["t1.0"]))
    toks, accepted = _through_scheduler(eng, n)
    assert min(pair_pvalues(toks, dist).values()) > ALPHA
    assert 0 < accepted < n * (NEW - 1)
    same, _ = _through_scheduler(eng, 64, stream=0)  # the control: one stream for all
    assert len({tuple(t) for t in same}) == 1


# ---- negative controls: the same test rejects the library's rule once it is broken --------------


def _duplicate_siblings():
    """WRONG on purpose: token recycling with nodes (1,) and (2,) copies of node (0,), and their
    children copies of (0, 0), so siblings carry one token (the tree rule needs distinct siblings:
    identical subtrees give the walk several independent draws at one prefix)."""
    import dataclasses

    from specjax.methods.recycle.proposer import RecycleProposer

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class DuplicateSiblings(RecycleProposer):
        def propose(self, params, pstate, state, sampling_config, keys):
            nodes, q, pstate = super().propose(params, pstate, state, sampling_config, keys)
            at = RECYCLE_TREE.index
            for copy, of in (((1,), (0,)), ((2,), (0,)), ((1, 0), (0, 0)), ((2, 0), (0, 0))):
                nodes = nodes.at[:, at(copy)].set(nodes[:, at(of)])
            return nodes, q, pstate

    return DuplicateSiblings


def test_recycling_with_duplicate_siblings_is_detected(eng, target):
    """The same chi-square test rejects recycling's drafts once siblings repeat a token; the right
    proposer in the same loop passes (the control)."""
    opts = SETTINGS["t1.0"]
    right, warm = eng.proposer(SpecConfig.make("recycle", tree=RECYCLE_TREE))
    broken = _duplicate_siblings()(**{f.name: getattr(right, f.name) for f in dataclasses.fields(right)})
    inputs = Inputs.create([PROMPT] * N, max_new_tokens=NEW, seed=97, **opts)
    dist = joint(conditionals(target, opts))
    pvals = {}
    for name, proposer in (("broken", broken), ("right", right)):
        dec = Decoder(proposer=proposer, sampling="sample", cache_length=64)
        toks = np.array(new_tokens(specjax_generate(target, inputs, decoder=dec, pparams=warm)))
        pvals[name] = min(pair_pvalues(toks, dist).values())
    assert pvals["broken"] < 1e-6 and pvals["right"] > ALPHA, pvals


class ResampleFromP(acceptance.Speculative):
    """WRONG on purpose: after a rejection, draw from p instead of norm(max(0, p - q)) (the library's
    `acceptance.speculative` with its second half replaced)."""

    def accept(self, w):
        n, p_n, _, key = acceptance.rejection(w.keys, w.nodes, w.q, w.logits, w.params)
        nxt = jax.vmap(jax.random.categorical)(key, jnp.log(p_n)).astype(jnp.int32)
        return acceptance.Accepted(n=n, path=acceptance.chain_path(n, w.topo), next=nxt)


@pytest.mark.parametrize("rule", [ResampleFromP(), acceptance.TypicalAcceptance(0.3, 0.09)],
                         ids=["resample_p_on_rejection", "typical_lossy"])
def test_broken_or_lossy_rules_are_detected(eng, target, rule):
    """A `Decoder` with a broken (or the library's own lossy) acceptance rule runs the same loop
    with the same draft model; the same chi-square test rejects its samples."""
    opts = SETTINGS["t1.0"]
    proposer, pparams = eng.proposer(SpecConfig(method="draft", k=K))
    dec = Decoder(proposer=proposer, acceptance=rule, sampling="sample", cache_length=64)
    inputs = Inputs.create([PROMPT] * N, max_new_tokens=NEW, seed=99, **opts)
    state = specjax_generate(target, inputs, decoder=dec, pparams=pparams)
    toks = np.array(new_tokens(state))
    pvals = pair_pvalues(toks, joint(conditionals(target, opts)))
    assert min(pvals.values()) < 1e-6, pvals
    right = Decoder(proposer=proposer, sampling="sample", cache_length=64)  # the control: default rule
    assert isinstance(right.acceptance, acceptance.Speculative) and type(right.acceptance) is not type(rule)
    toks = np.array(new_tokens(specjax_generate(target, inputs, decoder=right, pparams=pparams)))
    assert min(pair_pvalues(toks, joint(conditionals(target, opts))).values()) > ALPHA
