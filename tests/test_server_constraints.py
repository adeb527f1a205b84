"""Structured answers over HTTP: `response_format` (json_schema, json_object), `regex` and `choice` on a
tiny random model with a byte-level tokenizer that can spell JSON (64 tokens: the tiny model's vocabulary).

The answers parse and validate under their schema, equal `Engine.generate` with the same constraint,
and compile nothing after the warm-up; malformed, doubled or oversized constraints are 400s naming the
field, and a server without a pool says how to start one.
"""

import functools
import json
import re

import httpx
import jsonschema
import pytest
from tiny_server import CHATML, running
from tokenizers import decoders, models, pre_tokenizers
from tokenizers import Tokenizer as Backend

from specjax.models import config as model_config
from specjax.models import loader
from specjax.models.tokenizer import Tokenizer
from specjax.serving import server as srv
from specjax.serving.constraints import ConstraintLimits
from specjax.serving.engine import Engine
from specjax.serving.server.protocol import APIError

MODEL = "tiny-json"
MAX_TOKENS = 48
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# byte-level spellings ("Ġ" is the space): JSON's punctuation, digits, lowercase letters, a few more
CHARS = list('{}[]":,') + ["Ġ"] + list("0123456789abcdefghijklmnopqrstuvwxyz.-_ABCDEFGHIJKLMN")
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "blue"]},
                                           "tag": {"type": "string", "maxLength": 3}},
          "required": ["ok", "color", "tag"], "additionalProperties": False}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA, "strict": True}}
PROMPT = "an item"


@functools.cache
def json_engine() -> Engine:
    vocab = {t: i for i, t in enumerate(SPECIALS + CHARS)}
    backend = Backend(models.BPE(vocab, [], unk_token="_"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(SPECIALS)
    tok = Tokenizer(backend, bos_id=None, eos_id=0, chat_template=CHATML)
    return Engine(loader.init_model(model_config.preset("tiny"), seed=0), tok, buckets=(32,), name=MODEL)


def _server(eng, pool):
    sched = srv.scheduler_for(eng, method="none", slots=2, max_tokens=MAX_TOKENS, max_prompt_tokens=32, chunk=4,
                              history=16, constraint_pool=pool)
    return srv.Server(sched, srv.ServeConfig(model_name=MODEL))


@pytest.fixture(scope="module")
def served():
    eng = json_engine()
    server = _server(eng, ConstraintLimits(states=64, classes=32))
    with running(server) as url:
        yield eng, server, url


def _chat(url, **fields):
    body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": MAX_TOKENS,
            "return_token_ids": True, **fields}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=120)


def test_json_schema_answer_validates_and_equals_generate(served):
    eng, server, url = served
    compiled = eng.compile_count  # the warm-up compiled every program (the pool's upload included)
    r = _chat(url, response_format=JSON_SCHEMA)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
    assert choice["finish_reason"] == "stop"
    assert eng.compile_count == compiled
    want = eng.generate([PROMPT], chat=True, max_new_tokens=MAX_TOKENS, response_format=JSON_SCHEMA)[0]
    assert choice["token_ids"] == want.tokens
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=120, json={
            "model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": MAX_TOKENS,
            "response_format": JSON_SCHEMA, "stream": True}) as streamed:
        events = [json.loads(line[6:]) for line in streamed.iter_lines() if line.startswith("data: {")]
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == choice["message"]["content"]
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


def test_choice_regex_and_json_object_answers_follow_them(served):
    eng, server, url = served
    compiled = eng.compile_count
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "pick", "max_tokens": MAX_TOKENS,
                                                  "choice": ["yes", "no", "maybe"]}, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] in ("yes", "no", "maybe")
    r = _chat(url, regex=r"[a-c]{2,4}x")
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["message"]["content"]
    assert 3 <= len(text) <= 5 and set(text[:-1]) <= set("abc") and text[-1] == "x", text
    r = _chat(url, response_format={"type": "text"})  # no constraint
    assert r.status_code == 200, r.text
    info = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]
    assert info["constraints"] == {"states": 64, "classes": 32}
    assert eng.compile_count == compiled


@pytest.mark.parametrize("fields, param, match", [
    (dict(response_format={"type": "xml"}), "response_format", "response_format type 'xml'"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": 5}}), "response_format",
     "json_schema"),
    (dict(response_format=JSON_SCHEMA, choice=["a"]), "response_format", "response_format and choice given together"),
    (dict(choice=[]), "choice", "non-empty"),
    (dict(regex="(ab"), "regex", "cannot be compiled"),
    (dict(response_format={"type": "json_object"}), "response_format", r"automaton states; .* at most 64.*"
                                                                       r"--constraint-states"),
])
def test_bad_constraints_are_400s_naming_the_field(served, fields, param, match):
    r = _chat(served[2], **fields)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert re.search(match, err["message"]), err["message"]


def test_a_server_without_a_pool_says_how_to_start_one():
    """Checked in the parser (the worker-thread step before the engine): the server is not started."""
    server = _server(json_engine(), None)
    raw = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": PROMPT}],
                      "response_format": JSON_SCHEMA}).encode()
    with pytest.raises(APIError) as e:
        server._prepare(raw, "chat")
    assert e.value.status == 400 and e.value.param == "response_format"
    assert "--constraint-states N --constraint-classes M" in e.value.message
    server._parser.shutdown(wait=False)


@pytest.mark.parametrize("flags, pool", [
    ([], ConstraintLimits()),
    (["--constraint-states", "100", "--constraint-classes", "50"], ConstraintLimits(states=100, classes=50)),
    (["--constraint-states", "0"], None),
])
def test_serve_command_sizes_its_constraint_pool(monkeypatch, flags, pool):
    """`specjax serve` carries a pool by default (4096 states, 512 classes); 0 turns it off."""
    from specjax.cli import commands as cli

    built = {}
    monkeypatch.setattr(Engine, "load", classmethod(lambda cls, *a, **k: json_engine()))
    monkeypatch.setattr(srv, "run", lambda server, **kw: built.setdefault("server", server) and 0)
    assert cli.main(["serve", "--model", MODEL, "--method", "none", "--slots", "2", "--max-tokens", "8",
                     "--max-prompt-tokens", "16", *flags]) == 0
    assert built["server"].sched.constraint_pool == pool
    built["server"]._parser.shutdown(wait=False)


def test_serve_command_refuses_a_negative_pool_size(capsys):
    from specjax.cli import commands as cli

    assert cli.main(["serve", "--model", MODEL, "--constraint-classes", "-1"]) == 2
    assert "--constraint-classes=-1: must be >= 0" in capsys.readouterr().err
