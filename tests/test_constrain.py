"""specjax.constrain: constraints compiled with outlines-core and lowered to token-class tables.

The tables are checked state by state against llguidance's masks (an independent engine over the same
tokenizer) on randomly sampled paths, for SmolLM2's byte-level and Gemma 3's SentencePiece vocabulary.
"""

import json

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
