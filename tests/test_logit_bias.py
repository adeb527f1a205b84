"""logit_bias and logprobs inside the loop.

logit_bias (`sampling.biased`) is added to the target's logits at the prefill's token, at every
verified position and at the bonus, in the plain loop too (the oracle). Greedy biased output follows
argmax(full forward + bias) at every position (an independent oracle), every method equals the
biased plain loop token for token, and sampled output follows the biased target's distribution,
where a loop that leaves the bias out of its verify window fails the same test (the negative control).

The same runs record logprobs (`Decoder(logprobs=N)`, `specjax.core.logprobs`): each token's
log-probability and its position's top N under the target's raw logits (no bias), equal to the full
forward's at every position, for the plain loop and every method, greedy and sampled; a loop that
reads a verified token's scores at the wrong window slot fails the same check.
"""

from __future__ import annotations

from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import full_logits
from test_constrain_device import SPECS as CONSTRAINED_SPECS
from test_constrain_device import eng  # noqa: F401 (a fixture: the tiny model with every method's assets)
from specjax.core import decoder as decoder_module
from specjax.core import sampling
from specjax.core import state as state_module
from specjax.core.decoder import Decoder, Inputs, cache_length, new_tokens, token_logprobs
from specjax.core.decoder import generate as specjax_generate
from specjax.core.sampling import SamplingParams
from specjax.methods.config import SpecConfig
from specjax.methods.draft.record import DraftModel
from specjax.models import loader
from specjax.serving.engine import Engine

PROMPTS = [[5, 9, 12, 5, 9, 12, 5, 9], [11, 12, 13, 11, 12], [40, 41, 42, 43, 40, 41], [7, 7, 30]]
# moderate values, so that the bias moves some argmaxes and not others; row 2 has none
BIAS = [{12: 2.5, 9: -3.0, 30: 1.5}, {13: -100.0, 11: 4.0}, None, {7: 1.0, 30: 2.0, 31: -2.0, 40: 3.0}]
BUCKET, NEW = 16, 14
TOP = 3  # top logprobs recorded per position


def _run(eng, spec, bias=BIAS, width=None, logprobs=TOP):
    """(each row's new tokens, their recorded logprobs as `_arrays`, or None without `logprobs`)."""
    proposer, pparams = eng.proposer(spec) if spec else (None, None)
    window = 1 if proposer is None else Decoder(proposer=proposer, cache_length=64).window
    dec = Decoder(cache_length=cache_length(BUCKET, NEW, window), proposer=proposer, logprobs=logprobs)
    inputs = Inputs.create(PROMPTS, bucket=BUCKET, max_new_tokens=NEW, logit_bias=bias, logit_bias_width=width)
    state = specjax_generate(eng.model, inputs, decoder=dec, pparams=pparams)
    return new_tokens(state), None if logprobs is None else _arrays(state)


def _arrays(state) -> list[SimpleNamespace]:
    """Each row's `token_logprobs` records as arrays: chosen [n], top_ids [n, TOP], top_values [n, TOP]."""
    return [SimpleNamespace(chosen=np.array([e.logprob for e in row]),
                            top_ids=np.array([[i for i, _ in e.top] for e in row]).reshape(len(row), -1),
                            top_values=np.array([[v for _, v in e.top] for e in row]).reshape(len(row), -1))
            for row in token_logprobs(state)]


def _raw_log_softmax(model, prompts, answers) -> list[np.ndarray]:
    """The full forward's log-softmax at each answer token's position (no bias): the logprobs oracle."""
    from scipy.special import log_softmax

    graphdef, params = nnx.split(model)
    out = []
    for prompt, toks in zip(prompts, answers):
        logits = np.asarray(full_logits(graphdef, params, jnp.asarray([list(prompt) + list(toks)])), np.float64)
        out.append(log_softmax(logits[0, len(prompt) - 1: len(prompt) - 1 + len(toks)], axis=-1))
    return out


def _check_logprobs(model, prompts, answers, recorded, atol=2e-4):
    for r, (lp, toks, rec) in enumerate(zip(_raw_log_softmax(model, prompts, answers), answers, recorded)):
        assert rec.chosen.shape == (len(toks),), r
        np.testing.assert_allclose(rec.chosen, lp[np.arange(len(toks)), toks], atol=atol, err_msg=f"row {r}")
        best = np.sort(lp, axis=-1)[:, ::-1][:, : rec.top_ids.shape[1]]
        np.testing.assert_allclose(rec.top_values, best, atol=atol, err_msg=f"row {r}")
        np.testing.assert_allclose(np.take_along_axis(lp, rec.top_ids, axis=-1), best, atol=atol, err_msg=f"row {r}")


@pytest.fixture(scope="module")
def plain(eng):
    return _run(eng, None)


def test_biased_greedy_follows_the_full_forward_plus_the_bias(eng, plain):
    free, _ = _run(eng, None, bias=None, logprobs=None)
    graphdef, params = nnx.split(eng.model)
    moved = 0
    for r, (prompt, toks) in enumerate(zip(PROMPTS, plain[0])):
        seq = jnp.asarray([prompt + toks])
        logits = np.asarray(full_logits(graphdef, params, seq))[0, len(prompt) - 1:-1]
        add = np.zeros(logits.shape[-1], np.float32)
        for t, v in (BIAS[r] or {}).items():
            add[t] = v
        assert toks == np.argmax(logits + add, axis=-1).tolist(), r
        moved += toks != free[r]
    assert plain[0][2] == free[2]  # the row without a bias decodes as in a batch without any
    assert moved >= 2, "the bias should change some rows' answers, or the test proves little"
    assert 13 not in plain[0][1]  # -100 bans a token
    assert _run(eng, None, width=8, logprobs=None)[0] == plain[0]  # a wider (padded) bias is the same bias


def test_plain_logprobs_are_the_full_forwards(eng, plain):
    toks, recorded = plain
    _check_logprobs(eng.model, PROMPTS, toks, recorded)
    assert any(rec.top_ids[i, 0] != t for rec, row in zip(recorded, toks) for i, t in enumerate(row)), \
        "the bias should pick tokens the raw distribution ranks lower, or raw and biased look alike"


SPECS = {name: spec for name, spec in CONSTRAINED_SPECS.items() if name != "forced"}  # forced drafts need a grammar


@pytest.mark.parametrize("name", SPECS)
def test_every_method_equals_biased_plain(eng, plain, name):
    toks, recorded = _run(eng, SPECS[name])
    assert toks == plain[0]
    for rec, ref in zip(recorded, plain[1]):  # the same scores as plain's, position by position
        np.testing.assert_allclose(rec.chosen, ref.chosen, atol=1e-5)
        np.testing.assert_allclose(rec.top_values, ref.top_values, atol=1e-5)
        np.testing.assert_array_equal(rec.top_ids, ref.top_ids)


def test_bad_biases_are_refused_by_name():
    with pytest.raises(ValueError, match="logit_bias key 'x'"):
        Inputs.create([[1, 2]], logit_bias=[{"x": 1.0}])
    with pytest.raises(ValueError, match=r"logit_bias\['5'\]=101"):
        Inputs.create([[1, 2]], logit_bias=[{"5": 101}])
    with pytest.raises(ValueError, match=r"in \[0, 64\)"):
        sampling.check_logit_bias({"64": 1.0}, vocab=64)
    with pytest.raises(ValueError, match="exceeds this host's 1 per request"):
        Inputs.create([[1, 2]], logit_bias=[{1: 1.0, 2: 2.0}], logit_bias_width=1)
    with pytest.raises(ValueError, match="2 entries for 1 prompts"):
        Inputs.create([[1, 2]], logit_bias=[None, None])
    assert sampling.check_logit_bias({"7": -100, 3: 0.5}) == {7: -100.0, 3: 0.5}


def test_bad_logprobs_are_refused_by_name(eng):
    """`logprobs` out of [0, 20], or not an integer, is one error naming the argument, before a compile."""
    before = eng.compile_count
    for bad in (21, -1, True, "5", 2.5):
        with pytest.raises(ValueError, match=rf"logprobs={bad!r}: must be an integer in \[0, 20\]"):
            eng.generate([[1, 2]], max_new_tokens=2, logprobs=bad)
    for bad in (21, -1, True):  # ints (the test session's type checker refuses the rest at the annotation)
        with pytest.raises(ValueError, match=rf"logprobs={bad!r}"):
            Decoder(cache_length=16, logprobs=bad)
    assert eng.compile_count == before


# ---- sampling with a bias keeps the biased target's distribution -------------------------------


def _biased_joint(model, bias: dict[int, float], opts):
    """Exact P(t1..t4) of biased sampling: the target's logits plus the bias after each prefix, then
    the sampling filters (as the loop applies them)."""
    import itertools

    from test_lossless import NEW as NEW16, PROMPT, V as V16, joint

    prefixes = np.array(list(itertools.product(range(V16), repeat=NEW16 - 1)), np.int32)
    tokens = np.concatenate([np.tile(PROMPT, (len(prefixes), 1)), prefixes], axis=1)
    logits = np.array(full_logits(*nnx.split(model), jnp.asarray(tokens))[:, len(PROMPT) - 1:])
    for t, v in bias.items():
        logits[..., t] += v
    params = SamplingParams.create(len(prefixes), opts.get("temperature", 0.0), opts.get("top_k", 0),
                                   opts.get("top_p", 1.0))
    c = np.asarray(sampling.probs(jnp.asarray(logits), params), np.float64)
    return joint(c.reshape((V16,) * (NEW16 - 1) + (NEW16, V16)))


_biased = sampling.biased


def _window_unbiased(logits, params):
    """WRONG on purpose: the bias at the prefill's token and in plain steps, not in a verify window."""
    return logits if logits.ndim == 3 and logits.shape[1] > 1 else _biased(logits, params)


def _pvalue(toks, dist) -> float:
    """The smallest pair p-value of `toks` against `dist`; 0 when an outcome `dist` never gives occurs."""
    from scipy import stats
    from test_lossless import PAIRS, V as V16, pair

    worst = 1.0
    for i, j in PAIRS:
        probs = pair(dist, i, j)
        counts = np.bincount(toks[:, i] * V16 + toks[:, j], minlength=len(probs)).astype(np.float64)
        if counts[probs <= 1e-12].sum():
            return 0.0
        exp = probs / probs.sum() * len(toks)
        big = exp >= 5
        obs, ex = np.append(counts[big], counts[~big].sum()), np.append(exp[big], exp[~big].sum())
        worst = min(worst, stats.chisquare(obs[ex > 0], ex[ex > 0]).pvalue)
    return worst


@pytest.mark.parametrize("setting", ["t1.0", "top_k4"])
def test_sampling_with_a_bias_follows_the_biased_target(setting, monkeypatch):
    from test_lossless import CONFIG, NEW as NEW16, PROMPT, SETTINGS

    target, draft = loader.init_model(CONFIG, seed=0), loader.init_model(CONFIG, seed=1)
    bias, opts, n = {3: 2.0, 7: -1.5, 12: 1.0, 5: -100.0}, SETTINGS[setting], 8192
    dist = _biased_joint(target, bias, opts)
    proposer, pparams = Engine(target, assets={"draft": DraftModel(draft)}).proposer(SpecConfig(method="draft", k=2))
    inputs = Inputs.create([PROMPT] * n, max_new_tokens=NEW16, seed=11 + len(setting), logit_bias=[bias] * n, **opts)

    def sample(s=64):  # another cache length: another program, traced anew
        dec = Decoder(proposer=proposer, sampling="sample", cache_length=s, logprobs=2)
        state = specjax_generate(target, inputs, decoder=dec, pparams=pparams)
        toks = np.array(new_tokens(state))
        assert toks.shape == (n, NEW16)
        return toks, state

    toks, state = sample()
    assert 5 not in toks
    assert _pvalue(toks, dist) > 1e-3
    assert 0 < int(state.stats.accepted.sum()) < int(state.stats.drafted.sum())
    # sampled tokens, some drafts rejected: each token's logprobs are its position's in the full forward
    rows = slice(0, 48)
    _check_logprobs(target, [PROMPT] * 48, toks[rows].tolist(), _arrays(state)[rows])
    with monkeypatch.context() as m:  # negative control: a verified token scored at its parent's parent slot
        shifted = lambda st, logits, tokens: state_module.scored(jnp.roll(logits, 1, axis=1), tokens, st.logprobs.top)
        m.setattr(state_module, "scores_of", shifted)
        wrong_toks, wrong = sample(s=66)
        with pytest.raises(AssertionError):
            _check_logprobs(target, [PROMPT] * 48, wrong_toks[rows].tolist(), _arrays(wrong)[rows])
    monkeypatch.setattr(decoder_module.sampling, "biased", _window_unbiased)  # the negative control
    broken, _ = sample(s=65)
    assert _pvalue(broken, dist) < 1e-6
