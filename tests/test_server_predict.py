"""The server's request surface beyond sampling: `prediction` (OpenAI's Predicted Outputs) with its
usage counts, `logit_bias` and `logprobs` under speculation, and a 400 naming every field that would change the answer
and is not supported (never a silent drop), driven by the official `openai` client against a tiny model
with a predict option."""

import pytest
from conftest import need_module
from tiny_server import MAX_TOKENS, MODEL, running, shared_engine

from specjax.methods.config import SpecConfig
from specjax.serving import server as srv
from specjax.serving.server import logprobs

PROMPT = "abc abc abc"


@pytest.fixture(scope="module")
def served():
    eng = shared_engine()
    sched = srv.scheduler_for(eng, method="predict", spec=SpecConfig.make("predict", k=4, prediction_cap=48),
                              slots=2, max_tokens=MAX_TOKENS, max_prompt_tokens=64, chunk=4, history=16)
    server = srv.Server(sched, srv.ServeConfig(model_name=MODEL))
    with running(server) as url:
        yield eng, server, url


@pytest.fixture(scope="module")
def client(served):
    openai = need_module("openai")
    return openai.OpenAI(base_url=served[2] + "/v1", api_key="test", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def answer(served):
    """The plain greedy answer (tokens, text) to PROMPT as a chat turn."""
    eng = served[0]
    toks = eng.generate([PROMPT], chat=True, max_new_tokens=MAX_TOKENS)[0].tokens
    return toks, eng.tokenizer.decode(toks, skip_special=True)


def _chat(client, **kw):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}],
                                          max_tokens=MAX_TOKENS, **kw)


def test_a_right_prediction_is_accepted_and_reported(client, answer):
    toks, text = answer
    r = _chat(client, prediction={"type": "content", "content": text}, extra_body={"return_token_ids": True})
    assert r.choices[0].message.content == text
    details = r.usage.completion_tokens_details
    assert details.rejected_prediction_tokens == 0 and details.accepted_prediction_tokens > 0
    spec = r.model_extra["metrics"]["speculative_decoding"]
    assert spec["chunks"].get("predict:4") and spec["num_accepted_tokens"] > 0


def test_a_wrong_prediction_changes_nothing_but_its_usage(client, answer):
    toks, text = answer
    wrong = "zzzz " + text[::-1]
    parts = [{"type": "text", "text": wrong[:5]}, {"type": "text", "text": wrong[5:]}]
    r = _chat(client, prediction={"type": "content", "content": parts})
    assert r.choices[0].message.content == text
    d = r.usage.completion_tokens_details
    assert d.accepted_prediction_tokens + d.rejected_prediction_tokens == len(wrong) and d.rejected_prediction_tokens > 0
    streamed = _chat(client, prediction={"type": "content", "content": wrong}, stream=True,
                     stream_options={"include_usage": True})
    chunks = list(streamed)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens_details.rejected_prediction_tokens == d.rejected_prediction_tokens
    assert _chat(client).usage.completion_tokens_details is None  # no prediction: no prediction counts


@pytest.mark.parametrize("field, value", [
    ("frequency_penalty", 0.5), ("presence_penalty", -1.0), ("tools", [{"type": "function", "function": {"name": "f"}}]),
    ("tool_choice", "required"), ("reasoning_effort", "low"), ("modalities", ["text", "audio"]),
    ("response_format", {"type": "json_object"}), ("n", 2),
])
def test_fields_that_would_change_the_answer_are_400s_naming_them(client, field, value):
    openai = need_module("openai")
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, **{field: value})
    assert e.value.body["param"] == field, e.value.body


def test_logit_bias_biases_every_position_as_engine_generate_does(client, served, answer):
    """A bias that bans the plain answer's first token and favours another, with the plain answer as
    the prediction (the predict option verifies windows of it): the answer is `Engine.generate`'s
    plain loop under the same bias, token for token, and not the unbiased one."""
    openai = need_module("openai")
    eng, (toks, text) = served[0], answer
    bias = {str(toks[0]): -100, str(toks[1]): 5}
    want = eng.generate([PROMPT], chat=True, max_new_tokens=MAX_TOKENS,
                        logit_bias={int(k): v for k, v in bias.items()})[0].tokens
    r = _chat(client, logit_bias=bias, prediction={"type": "content", "content": text},
              extra_body={"return_token_ids": True})
    got = r.choices[0].model_extra["token_ids"]
    assert got == want and got != toks and toks[0] not in got
    assert r.model_extra["metrics"]["speculative_decoding"]["chunks"].get("predict:4")
    for bad, says in (({"x": 1}, "token ids are integers"), ({"5": 101}, "in [-100, 100]"),
                      ({"999999": 1}, "a token id in [0, 64)")):
        with pytest.raises(openai.BadRequestError) as e:
            _chat(client, logit_bias=bad)
        assert e.value.body["param"] == "logit_bias" and says in e.value.body["message"], e.value.body
    for most in (0, 2):  # the scheduler's width (a server's --logit-bias)
        sched = srv.scheduler_for(eng, method="none", slots=1, max_tokens=MAX_TOKENS, logit_bias=most)
        with pytest.raises(ValueError, match=f"3 entries; this host takes at most {most}"):
            sched.submit(PROMPT, logit_bias={1: 1, 2: 2, 3: 3})


def _top(entry) -> list[tuple[str, float]]:
    return [(t.token, t.logprob) for t in entry.top_logprobs]


def test_logprobs_are_engine_generates_under_speculation(client, served, answer):
    """Chat (`logprobs`, `top_logprobs`), streamed or not, and completions (`logprobs: n`), with the
    answer as the prediction (the predict option's verify windows score most tokens): each token's
    entry is `Engine.generate(logprobs=)`'s plain-loop record, spelled by the tokenizer."""
    openai = need_module("openai")
    eng, (toks, text) = served[0], answer
    fmt = logprobs.Formatter(eng.tokenizer)
    want = eng.generate([PROMPT], chat=True, max_new_tokens=MAX_TOKENS, logprobs=3)[0]
    assert want.tokens == toks
    r = _chat(client, logprobs=True, top_logprobs=3, prediction={"type": "content", "content": text})
    assert r.usage.completion_tokens_details.accepted_prediction_tokens > 0  # windows ran
    got = r.choices[0].logprobs.content
    assert [e.token for e in got] == [fmt.text_of(t) for t in toks]
    assert [e.bytes for e in got] == [list(fmt.bytes_of(t)) for t in toks]
    for e, w in zip(got, want.logprobs, strict=True):
        assert e.logprob == pytest.approx(w.logprob, abs=1e-4)
        assert _top(e) == [(fmt.text_of(i), pytest.approx(v, abs=1e-4)) for i, v in w.top]
    streamed = [e for c in _chat(client, logprobs=True, top_logprobs=3, stream=True)
                if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, _top(e)) for e in streamed] == [(e.token, _top(e)) for e in got]
    assert _chat(client, logprobs=False).choices[0].logprobs is None

    plain = eng.generate([PROMPT], max_new_tokens=MAX_TOKENS, logprobs=2)[0]
    c = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, logprobs=2).choices[0]
    lp = c.logprobs
    assert lp.tokens == [fmt.text_of(t) for t in plain.tokens]
    assert lp.token_logprobs == pytest.approx([w.logprob for w in plain.logprobs], abs=1e-4)
    assert [list(d) for d in lp.top_logprobs] == [[fmt.text_of(i) for i, _ in w.top] for w in plain.logprobs]
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]

    for kw, field in [(dict(top_logprobs=2), "top_logprobs"), (dict(logprobs=True, top_logprobs=21), "top_logprobs"),
                      (dict(logprobs=2), "logprobs")]:
        with pytest.raises(openai.BadRequestError) as e:
            _chat(client, **kw)
        assert e.value.body["param"] == field, e.value.body
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, logprobs=21)
    assert e.value.body["param"] == "logprobs" and "at most 20" in e.value.body["message"]
    sched = srv.scheduler_for(eng, method="none", slots=1, max_tokens=MAX_TOKENS, logprobs=None)
    with pytest.raises(ValueError, match="records at most None"):
        sched.submit(PROMPT, top_logprobs=0)


def test_unknown_fields_and_bad_predictions_are_400s(client, served):
    openai = need_module("openai")
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, extra_body={"repetition_penalty": 1.2})
    assert e.value.body["param"] == "repetition_penalty" and "unknown field" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, prediction={"type": "content", "content": "x" * 49})  # 49 tokens: one past the cap
    assert e.value.body["param"] == "prediction" and "at most 48" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, prediction={"type": "content", "content": [{"type": "image_url", "image_url": "u"}]})
    assert e.value.body["param"] == "prediction.content"


def test_neutral_values_and_inert_fields_are_accepted(client, answer):
    r = _chat(client, frequency_penalty=0, presence_penalty=0.0, tools=[], tool_choice="none", metadata={"a": "1"},
              store=False, response_format={"type": "text"}, modalities=["text"], n=1)
    assert r.choices[0].message.content == answer[1]
