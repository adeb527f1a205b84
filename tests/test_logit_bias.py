"""logit_bias inside the loop (`sampling.biased`): added to the target's logits at the prefill's token,
at every verified position and at the bonus, in the plain loop too (the oracle).

Greedy biased output follows argmax(full forward + bias) at every position (an independent oracle),
every method equals the biased plain loop token for token, and sampled output follows the biased
target's distribution, where a loop that leaves the bias out of its verify window fails the same
test (the negative control).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import full_logits
from test_constrain_device import SPECS as CONSTRAINED_SPECS
from test_constrain_device import eng  # noqa: F401 (a fixture: the tiny model with every method's assets)
from specjax.core import decoder as decoder_module
from specjax.core import sampling
from specjax.core.decoder import Decoder, Inputs, cache_length, new_tokens
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


def _run(eng, spec, bias=BIAS, width=None):
    proposer, pparams = eng.proposer(spec) if spec else (None, None)
    window = 1 if proposer is None else Decoder(proposer=proposer, cache_length=64).window
    dec = Decoder(cache_length=cache_length(BUCKET, NEW, window), proposer=proposer)
    inputs = Inputs.create(PROMPTS, bucket=BUCKET, max_new_tokens=NEW, logit_bias=bias, logit_bias_width=width)
    return new_tokens(specjax_generate(eng.model, inputs, decoder=dec, pparams=pparams))


@pytest.fixture(scope="module")
def plain(eng):
    return _run(eng, None)


def test_biased_greedy_follows_the_full_forward_plus_the_bias(eng, plain):
    free = _run(eng, None, bias=None)
    graphdef, params = nnx.split(eng.model)
    moved = 0
    for r, (prompt, toks) in enumerate(zip(PROMPTS, plain)):
        seq = jnp.asarray([prompt + toks])
        logits = np.asarray(full_logits(graphdef, params, seq))[0, len(prompt) - 1:-1]
        add = np.zeros(logits.shape[-1], np.float32)
        for t, v in (BIAS[r] or {}).items():
            add[t] = v
        assert toks == np.argmax(logits + add, axis=-1).tolist(), r
        moved += toks != free[r]
    assert plain[2] == free[2]  # the row without a bias decodes as in a batch without any
    assert moved >= 2, "the bias should change some rows' answers, or the test proves little"
    assert 13 not in plain[1]  # -100 bans a token
    assert _run(eng, None, width=8) == plain  # a wider (padded) bias is the same bias


SPECS = {name: spec for name, spec in CONSTRAINED_SPECS.items() if name != "forced"}  # forced drafts need a grammar


@pytest.mark.parametrize("name", SPECS)
def test_every_method_equals_biased_plain(eng, plain, name):
    assert _run(eng, SPECS[name]) == plain


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
        dec = Decoder(proposer=proposer, sampling="sample", cache_length=s)
        state = specjax_generate(target, inputs, decoder=dec, pparams=pparams)
        toks = np.array(new_tokens(state))
        assert toks.shape == (n, NEW16)
        return toks, state.stats

    toks, st = sample()
    assert 5 not in toks
    assert _pvalue(toks, dist) > 1e-3
    assert 0 < int(st.accepted.sum()) < int(st.drafted.sum())
    monkeypatch.setattr(decoder_module.sampling, "biased", _window_unbiased)  # the negative control
    broken, _ = sample(s=65)
    assert _pvalue(broken, dist) < 1e-6
