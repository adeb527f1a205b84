"""Predicted outputs (`specjax.methods.predict`): greedy output equals plain token for token whatever
the prediction, a right prediction is accepted whole, one program serves every prediction length,
the cursor finds the answer again after an edit, and the usage counts follow OpenAI's definition."""

import jax.numpy as jnp
import numpy as np
import pytest

from specjax.core.decoder import Inputs
from specjax.methods.config import SpecConfig
from specjax.methods.predict.proposer import find
from specjax.methods.predict.usage import prediction_usage
from specjax.serving.engine import Engine

PROMPTS = [
    [5, 9, 12, 5, 9, 12, 5, 9],
    list(range(1, 20)),
    [40, 41, 42, 43, 40, 41],
    [7, 3],
]
NEW = 32
K = 4
M = 21  # (M - 1) % (K + 1) == 0: a prediction that is always right gives tau == K + 1


@pytest.fixture(scope="module")
def eng(tiny_model):
    return Engine(tiny_model)


@pytest.fixture(scope="module")
def ref(eng):
    """Plain greedy continuations (the oracle)."""
    return [r.tokens for r in eng.generate(PROMPTS, max_new_tokens=NEW)]


def _edited(tokens, vocab):
    """A prediction the answer departs from: a token changed, three deleted, two inserted."""
    t = list(tokens)
    t[6] = (t[6] + 1) % vocab
    del t[11:14]
    return t[:17] + [(t[17] + 3) % vocab, (t[17] + 5) % vocab] + t[17:]


def _spec(**kw):
    return SpecConfig.make("predict", k=K, prediction_cap=64, **kw)


def test_greedy_equals_plain_whatever_the_prediction(eng, ref):
    vocab = eng.config.vocab_size
    preds = [ref[0], _edited(ref[1], vocab), None, list(np.random.default_rng(0).integers(0, vocab, 40))]
    res = eng.generate(PROMPTS, max_new_tokens=M, spec=_spec(), prediction=preds)
    for r, want in zip(res, ref):
        assert r.tokens == want[:M]
    right, edited, none, junk = res
    assert right.tau == K + 1  # every step accepts all K drafts and the bonus follows the prediction
    assert right.counters.accept_hist == [0] * K + [(M - 1) // (K + 1)]
    assert edited.counters.num_accepted_tokens >= 2 * K  # it finds the answer again after the edits
    assert right.prediction == (M, NEW - M)  # the answer is the prediction's first M tokens
    assert none.prediction is None and edited.prediction[0] + edited.prediction[1] == len(preds[1])


def test_predicted_rows_leave_other_rows_alone(eng, ref):
    """A row's prediction drafts only its own row: rows without one run prompt lookup exactly."""
    res = eng.generate(PROMPTS, max_new_tokens=M, spec=_spec(), prediction=[ref[0], None, None, None])
    lookup = eng.generate(PROMPTS, max_new_tokens=M, spec=SpecConfig.make("ngram", k=K))
    for a, b in zip(res[1:], lookup[1:]):
        assert a.tokens == b.tokens and a.counters == b.counters


def test_sampled_rows_equal_plain_sampled_rows_in_law_smoke(eng):
    """Temperature > 0 runs through the same proposer (the chi-square test is in test_lossless)."""
    res = eng.generate(PROMPTS[:2], max_new_tokens=8, spec=_spec(), prediction=[[5, 9], None], temperature=0.8)
    assert all(1 <= r.new_tokens <= 8 for r in res)


def test_one_program_for_every_prediction_length(eng, ref):
    eng.generate(PROMPTS, max_new_tokens=M, spec=_spec(), prediction=[ref[0], None, [1], ref[3][:5]])
    before = eng.compile_count
    eng.generate(PROMPTS, max_new_tokens=M, spec=_spec(), prediction=[None, ref[1], ref[2] * 2, None])
    eng.generate(PROMPTS, max_new_tokens=M, spec=_spec())
    assert eng.compile_count == before


def test_a_prediction_past_the_cap_is_refused(eng):
    with pytest.raises(ValueError, match=r"prediction of 65 tokens exceeds prediction_cap=64"):
        eng.generate(PROMPTS[:1], max_new_tokens=4, spec=_spec(), prediction=[[1] * 65])
    with pytest.raises(ValueError, match="one per prompt"):
        eng.generate(PROMPTS[:2], max_new_tokens=4, spec=_spec(), prediction=[[1]])
    with pytest.raises(ValueError, match="outside"):
        eng.generate(PROMPTS[:1], max_new_tokens=4, spec=_spec(), prediction=[[eng.config.vocab_size]])
    with pytest.raises(ValueError, match="prediction_cap"):
        SpecConfig.make("predict", prediction_cap=0)
    with pytest.raises(ValueError, match="exceeds prediction_bucket=2"):
        Inputs.create([[1, 2]], prediction=[[1, 2, 3]], prediction_bucket=2)


def test_other_methods_report_the_usage_and_ignore_the_prediction(eng, ref):
    res = eng.generate(PROMPTS[:1], max_new_tokens=M, prediction=[ref[0][:10]])
    assert res[0].tokens == ref[0][:M] and res[0].prediction == (10, 0)
    assert res[0].to_dict()["accepted_prediction_tokens"] == 10


def test_the_cursor_is_found_again_nearest_ahead():
    pred = jnp.asarray([[7, 1, 2, 9, 1, 2, 8, 1, 2, 5, 0, 0]], jnp.int32)
    plen = jnp.asarray([10])
    tokens = jnp.asarray([[3, 4, 1, 2]], jnp.int32)
    lengths = jnp.asarray([4])
    for cursor, want in [(0, 3), (3, 3), (4, 6), (7, 9), (10, 9)]:  # the occurrence at or after, else before
        at, found = find(pred, plen, tokens, lengths, jnp.asarray([cursor]), 2, 3)
        assert bool(found[0]) and int(at[0]) == want, cursor
    at, found = find(pred, jnp.asarray([5]), tokens, lengths, jnp.asarray([6]), 1, 3)
    assert int(at[0]) == 3  # occurrences past the prediction's length do not count
    one = jnp.asarray([[3, 4, 1, 9]], jnp.int32)  # only the last token matches: 9 at index 3
    assert int(find(pred, plen, one, lengths, jnp.asarray([2]), 1, 1, near=2)[0][0]) == 4
    assert not bool(find(pred, plen, one, lengths, jnp.asarray([8]), 1, 1, near=2)[1][0])  # too far
    none = jnp.asarray([[6, 6, 6, 6]], jnp.int32)
    assert not bool(find(pred, plen, none, lengths, jnp.asarray([0]), 1, 3)[1][0])


def test_prediction_usage_counts_tokens_of_the_prediction_in_the_completion():
    assert prediction_usage([1, 2, 3, 4], [1, 2, 3, 4, 0]) == (4, 0)
    assert prediction_usage([1, 2, 3, 4, 5, 6], [1, 2, 9, 5, 6]) == (4, 2)  # 3, 4 changed to 9
    assert prediction_usage([1, 2, 3], []) == (0, 3)
    assert prediction_usage([], [1, 2]) == (0, 0)
    assert prediction_usage([1, 1, 1], [1]) == (1, 2)  # a completion token counts once


# ---- through the scheduler (the server's path): insert into a running batch ---------------------


def _scheduled(eng, spec, preds, **kw):
    from specjax.serving.engine import GenerateOptions
    from specjax.serving.scheduler import Scheduler

    s = Scheduler(eng, slots=2, spec=spec, opts=GenerateOptions(max_new_tokens=M), chunk=4,
                  max_prompt_tokens=32, **kw)
    rids = [s.submit(p, prediction=q) for p, q in zip(PROMPTS, preds)]
    s.run()
    return [s.request(r) for r in rids] if all(s.request(r) for r in rids) else s.requests


def test_scheduled_requests_with_predictions_equal_plain(eng, ref):
    vocab = eng.config.vocab_size
    preds = [ref[0], _edited(ref[1], vocab), None, ref[3][:M]]
    out = _scheduled(eng, _spec(), preds)
    assert [r.tokens for r in out] == [t[:M] for t in ref]  # four requests through two slots
    assert out[0].tau == K + 1 and out[3].tau == K + 1
    assert out[2].prediction_tokens is None and out[3].prediction_tokens == (M, 0)


def test_auto_runs_predict_beside_prompt_lookup(eng, ref):
    from specjax.serving.controller import ControllerConfig

    out = _scheduled(eng, "auto", [ref[0], None, None, ref[3]],
                     controller=ControllerConfig(ks=(0, 4), methods=("ngram", "predict")))
    assert [r.tokens for r in out] == [t[:M] for t in ref]  # every option's state follows every row


def test_a_scheduler_refuses_a_prediction_past_its_cap(eng):
    from specjax.serving.engine import GenerateOptions
    from specjax.serving.scheduler import Scheduler

    s = Scheduler(eng, slots=1, spec=_spec(), opts=GenerateOptions(max_new_tokens=4))
    with pytest.raises(ValueError, match="prediction of 65 tokens exceeds prediction_cap=64"):
        s.submit([1, 2], prediction=[1] * 65)


def test_prompt_files_carry_predictions(tmp_path):
    from specjax.bench.prompts import read_prompts

    f = tmp_path / "edits.jsonl"
    f.write_text('{"question_id": "e", "task": "edit", "turns": ["fix it"], "prediction": "a: 1\\n"}\n'
                 '{"question_id": "f", "turns": ["no prediction"]}\n')
    a, b = read_prompts(f)
    assert a.prediction == "a: 1\n" and b.prediction is None
    f.write_text('{"question_id": "e", "turns": ["fix it"], "prediction": [1, 2]}\n')
    with pytest.raises(ValueError, match="prediction must be a string"):
        read_prompts(f)


# ---- the command line: --prediction FILE --------------------------------------------------------


@pytest.fixture
def tiny_cli(tiny_model, monkeypatch):
    from test_cli import _CharTokenizer

    monkeypatch.setattr(Engine, "load", classmethod(lambda cls, name, **kw: Engine(tiny_model, _CharTokenizer(),
                                                                                   name="tiny")))


def test_generate_takes_a_prediction_file(tiny_cli, tmp_path, capsys):
    import json

    from specjax.cli import commands as cli

    f = tmp_path / "pred.txt"
    f.write_text("abcabcabc")
    argv = ["generate", "--prompt", "abcabc", "--max-new-tokens", "8", "--json", "--prediction", str(f)]
    assert cli.main([*argv, "--method", "predict", "--k", "4"]) == 0
    (rec,) = [json.loads(ln) for ln in capsys.readouterr().out.splitlines()]
    assert rec["accepted_prediction_tokens"] + rec["rejected_prediction_tokens"] == 9
    assert cli.main([*argv, "--method", "auto", "--auto-methods", "ngram,predict", "--repeats", "1"]) == 0
    (auto,) = [json.loads(ln) for ln in capsys.readouterr().out.splitlines()]
    assert auto["identical_to_plain"] is True and auto["tokens"] == rec["tokens"]
    assert cli.main([*argv[:-1], str(tmp_path / "missing.txt")]) == 2
    assert "no such file" in capsys.readouterr().err
