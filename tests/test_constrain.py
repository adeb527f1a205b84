"""specjax.constrain: constraints compiled with outlines-core and lowered to token-class tables.

The tables are checked state by state against llguidance's masks (an independent engine over the same
tokenizer) on randomly sampled paths, for SmolLM2's byte-level and Gemma 3's SentencePiece vocabulary.
"""

import json
import re

import jsonschema
import llguidance
import numpy as np
import pytest
from outlines_core.json_schema import build_regex_from_schema

from specjax.constrain import compile_choice, compile_regex, compile_schema
from specjax.models.tokenizer import Tokenizer

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "n": {"type": "integer"}, "on": {"type": "boolean"}},
          "required": ["name", "n", "on"]}


@pytest.fixture(scope="module", params=["smollm2_path", "gemma3_path"])
def tokenizer(request):
    return Tokenizer.from_gguf(request.getfixturevalue(request.param))


def _ll_mask(matcher, vocab_size):
    bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), np.uint8), bitorder="little")
    return bits[:vocab_size].astype(bool)


@pytest.mark.parametrize("regex", [build_regex_from_schema(json.dumps(SCHEMA), ""), r"(yes|no|maybe)", r"[a-c]{2,5}x?"])
def test_tables_match_llguidance_masks_on_sampled_paths(tokenizer, regex):
    tables = compile_regex(regex, tokenizer)
    lltok = llguidance.LLTokenizer(tokenizer._backend.to_str(), n_vocab=tokenizer.vocab_size,
                                   eos_token=tokenizer.eos_id)
    grammar = llguidance.LLMatcher.grammar_from_regex(regex)
    rng = np.random.default_rng(0)
    checked = 0
    for _ in range(4):
        matcher = llguidance.LLMatcher(lltok, grammar)
        assert not matcher.is_error(), matcher.get_error()
        state = tables.initial
        for _ in range(40):
            ours, theirs = tables.allowed(state), _ll_mask(matcher, tokenizer.vocab_size)
            # llguidance also forbids a token that is a strict prefix of the bytes the grammar forces
            # when a longer token covers them (its canonical-tokenization rule); every other token agrees.
            forced = matcher.compute_ff_bytes()
            extra = [int(i) for i in np.nonzero(ours & ~theirs)[0] if not forced.startswith(lltok.decode_bytes([int(i)]))]
            assert not (theirs & ~ours).any(), f"llguidance allows {np.nonzero(theirs & ~ours)[0][:8]} the tables forbid"
            assert extra == [], f"the tables allow {extra[:8]} llguidance forbids"
            assert ours[tokenizer.eos_id] == tables.accepting[state] == matcher.is_accepting()
            checked += 1
            token = int(rng.choice(np.nonzero(ours)[0]))
            if token == tokenizer.eos_id:
                break
            assert matcher.consume_token(token)
            state = tables.step(state, token)
            assert state >= 0
    assert checked >= 8


def test_schema_tables_walk_valid_answers_and_refuse_invalid(smollm2_path):
    tokenizer = Tokenizer.from_gguf(smollm2_path)
    tables = compile_schema(SCHEMA, tokenizer)

    def walk(text):
        state = tables.initial
        for token in tokenizer.encode(text, add_bos=False):
            state = tables.step(state, token)
            if state < 0:
                return state
        return tables.step(state, tokenizer.eos_id)

    good = '{"name":"ab","n":-12,"on":true}'
    jsonschema.validate(json.loads(good), SCHEMA)
    assert walk(good) >= 0
    assert walk('{"name":"ab","n":1}') < 0  # incomplete: EOS only in accepting states
    assert walk('{"name":"abcdefghi","n":1,"on":true}') < 0  # maxLength
    assert walk('{"name": "ab","n":1,"on":true}') < 0  # compact JSON by default
    spaced = compile_schema(SCHEMA, tokenizer, whitespace=r"[ ]?")
    state = spaced.initial
    for token in tokenizer.encode('{"name": "ab", "n": 1, "on": true}', add_bos=False) + [tokenizer.eos_id]:
        state = spaced.step(state, token)
    assert state >= 0


def test_random_accepting_paths_are_schema_valid(smollm2_path):
    tokenizer = Tokenizer.from_gguf(smollm2_path)
    tables = compile_schema(SCHEMA, tokenizer)
    rng = np.random.default_rng(1)
    ends = 0
    for _ in range(20):
        state, ids = tables.initial, []
        for _ in range(200):
            allowed = np.nonzero(tables.allowed(state))[0]
            # prefer ending and closing so walks finish: EOS when allowed, else any token
            token = tokenizer.eos_id if tables.accepting[state] else int(rng.choice(allowed))
            if token == tokenizer.eos_id:
                break
            ids.append(token)
            state = tables.step(state, token)
        else:
            continue
        jsonschema.validate(json.loads(tokenizer.decode(ids)), SCHEMA)
        ends += 1
    assert ends >= 5


def test_classes_are_few_and_cached(smollm2_path):
    tokenizer = Tokenizer.from_gguf(smollm2_path)
    tables = compile_choice(["yes", "no"], tokenizer)
    assert tables.num_classes < 50 and tables.token_class.shape == (tokenizer.vocab_size,)
    assert not tables.allowed(tables.initial)[list(tokenizer.stop_ids)].any()  # EOS not before an answer
    assert not (tables.next_state[:, 0] >= 0).any()  # class 0 is allowed nowhere
    assert compile_choice(["yes", "no"], tokenizer) is tables


def test_bad_constraints_are_refused_saying_why(smollm2_path):
    tokenizer = Tokenizer.from_gguf(smollm2_path)
    with pytest.raises(ValueError, match="unsupported JSON schema"):
        compile_schema({"type": "object", "properties": {"x": {"$ref": "#/nope"}}, "required": ["x"]}, tokenizer)
    with pytest.raises(ValueError, match="choice needs"):
        compile_choice([], tokenizer)
    with pytest.raises(ValueError, match="cannot be compiled|allows no answer"):
        compile_regex("(", tokenizer)


CONFIG_SCHEMA = {"type": "object", "properties": {"host": {"type": "string", "maxLength": 24}, "port": {"type": "integer"},
                                                  "debug": {"type": "boolean"},
                                                  "log_level": {"enum": ["debug", "info", "warning", "error"]}},
                 "required": ["host", "port", "debug", "log_level"]}


def test_greedy_answers_under_a_schema_validate_on_smollm2(smollm2):
    """The shipped demo prompts under a schema, on the real model, inside the loop: every greedy answer
    (plain and prompt lookup, which agree token for token) is JSON valid under the schema, and ends
    with a stop token the automaton allowed in an accepting state."""
    from specjax.bench import prompts as shipped
    from specjax.core.constraint import PoolSpec
    from specjax.core.decoder import Decoder, Inputs, cache_length, generate, new_tokens
    from specjax.methods.config import SpecConfig
    from specjax.serving.engine import Engine

    tok = smollm2.tokenizer
    tables = compile_schema(CONFIG_SCHEMA, tok)
    eng = Engine(smollm2.model, tok)
    texts = [p.text for p in shipped.read_prompts(shipped.shipped("demo")) if p.response_format is None]
    ids = eng.encode(texts, chat=True)
    bucket = -(-max(map(len, ids)) // 64) * 64  # the demo prompts' length, in steps of 64
    inputs = Inputs.create(ids, bucket=bucket, max_new_tokens=96, stop_ids=tok.stop_ids, constraint=1)
    outs = []
    for spec in (None, SpecConfig(method="ngram", k=4)):
        proposer, pparams = eng.proposer(spec) if spec else (None, None)
        dec = Decoder(cache_length=cache_length(bucket, 96, 8), proposer=proposer,
                      constraints=PoolSpec(vocab=smollm2.config.vocab_size))
        outs.append(new_tokens(generate(smollm2.model, inputs, decoder=dec, pparams=pparams, constraints=(tables,))))
    assert outs[0] == outs[1]
    for toks in outs[0]:
        assert toks[-1] in tok.stop_ids, tok.decode(toks)
        jsonschema.validate(json.loads(tok.decode(toks[:-1])), CONFIG_SCHEMA)


def test_forced_tokens_are_the_text_the_schema_fixes(tokenizer):
    """Walking a valid compact answer, wherever the tables force tokens they are the answer's own next
    tokens (its keys, quotes and punctuation, tokenized as the tokenizer does), and EOS once complete."""
    tables = compile_schema(CONFIG_SCHEMA, tokenizer)
    good = '{"host":"127.0.0.1","port":8080,"debug":true,"log_level":"info"}'
    ids = tokenizer.encode(good, add_bos=False) + [tokenizer.eos_id]
    state, forced_at = tables.initial, 0
    for i, t in enumerate(ids):
        forced = [int(x) for x in tables.forced[state] if x >= 0]
        if forced:
            assert forced == ids[i:i + len(forced)], (i, tokenizer.decode(forced))
            forced_at += 1
        state = tables.step(state, t)
        assert state >= 0
    assert forced_at >= 10 and [int(x) for x in tables.forced[tables.step(0, ids[0])][:1]] == [ids[1]]


def test_engine_generate_takes_response_format_regex_and_choice(smollm2):
    """`Engine.generate(response_format=, regex=, choice=)`: constrained answers, equal for plain and the
    forced method (which needs fewer target forwards: the schema's fixed text comes as drafts)."""
    from specjax.methods.config import SpecConfig
    from specjax.serving.engine import Engine

    eng = Engine(smollm2.model, smollm2.tokenizer)
    prompt = ["Write a Python dictionary with the settings of a web server: host, port, debug and log level."]
    fmt = {"type": "json_schema", "json_schema": {"name": "server", "schema": CONFIG_SCHEMA, "strict": True}}
    plain, forced = (eng.generate(prompt, chat=True, max_new_tokens=80, spec=s, response_format=fmt)[0]
                     for s in (SpecConfig(), SpecConfig(method="forced", k=6)))
    assert plain.tokens == forced.tokens and plain.stop_reason == "stop_token"
    jsonschema.validate(json.loads(plain.text), CONFIG_SCHEMA)
    assert forced.target_forwards < 0.75 * plain.target_forwards, (forced.target_forwards, plain.target_forwards)
    assert eng.generate(prompt, chat=True, max_new_tokens=8, choice=["yes", "no"])[0].text in ("yes", "no")
    assert re.fullmatch(r"[0-9]{3}", eng.generate(prompt, chat=True, max_new_tokens=8, regex=r"[0-9]{3}")[0].text)
    with pytest.raises(ValueError, match="give one constraint"):
        eng.generate(prompt, regex="a", choice=["a"])
    with pytest.raises(ValueError, match="response_format type 'xml'"):
        eng.generate(prompt, response_format={"type": "xml"})
