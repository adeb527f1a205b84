"""Compiles a constraint with outlines-core over a tokenizer's vocabulary and lowers it to small tables.

The tables a device needs to mask logits: `token_class[V]` maps each token to an equivalence class of
tokens with the same transition from every state, `next_state[S, C]` is the state after a class
(-1: not allowed), `accepting[S]` marks the states where the answer may end (EOS is allowed exactly
there), and `forced[S, F]` holds the tokens the constraint forces from each state (its fixed text,
tokenized as the tokenizer would: the `forced` method's drafts). Compiled tables are cached by
(constraint, tokenizer vocabulary).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re

import numpy as np
import outlines_core
from outlines_core.json_schema import build_regex_from_schema


@dataclasses.dataclass(frozen=True, eq=False)
class TokenTables:
    """One constraint lowered over one vocabulary.

    Attributes:
        token_class: int32[V], the class of each token id; special tokens other than EOS get class 0,
            which no state allows.
        next_state: int32[S, C], the state after a token of class c from state s, -1 where not allowed.
        accepting: bool[S], the states where the answer is complete (EOS allowed).
        initial: The start state (always 0).
        eos_id: The id that ends an answer; its class moves an accepting state to itself.
        forced: int32[S, F] or None, the tokens the automaton forces from each state (-1 padded).
    """

    token_class: np.ndarray
    next_state: np.ndarray
    accepting: np.ndarray
    initial: int
    eos_id: int
    forced: np.ndarray | None = None

    @property
    def num_states(self) -> int:
        return int(self.next_state.shape[0])

    @property
    def num_classes(self) -> int:
        return int(self.next_state.shape[1])

    def allowed(self, state: int) -> np.ndarray:
        """bool[V]: the tokens allowed from `state`."""
        return self.next_state[state][self.token_class] >= 0

    def step(self, state: int, token: int) -> int:
        """The state after `token` from `state`, -1 if the token is not allowed."""
        return int(self.next_state[state, self.token_class[token]])


_GPT2_BYTES = None


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character standing for each byte, reversed."""
    global _GPT2_BYTES
    if _GPT2_BYTES is None:
        bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
        cs = bs[:]
        n = 0
        for b in range(256):
            if b not in bs:
                bs.append(b)
                cs.append(256 + n)
                n += 1
        _GPT2_BYTES = {chr(c): b for b, c in zip(bs, cs)}
    return _GPT2_BYTES


_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def token_bytes(tokenizer) -> dict[int, bytes]:
    """The bytes each ordinary token writes, by id (special and control tokens left out).

    Handles the two spellings the repo's tokenizers use: byte-level BPE ("Ġ" for a space, every byte a
    printable character) and SentencePiece ("▁" for a space, "<0xNN>" byte-fallback tokens).

    Raises:
        ValueError: The vocabulary is spelled neither way.
    """
    decoder = _byte_decoder()
    added = tokenizer._backend.get_added_tokens_decoder()  # {id: AddedToken}: specials, and literal text
    special = set(tokenizer.stop_ids) | {i for i in (tokenizer.bos_id, tokenizer.pad_id) if i is not None}
    # Added tokens spelled like markup ("<table>", "<start_of_image>") are left out as llguidance does:
    # the answer can still write that text with ordinary tokens.
    special |= {i for i, a in added.items() if a.special or (a.content.startswith("<") and a.content.endswith(">"))}
    spellings = {i: tokenizer.id_to_token(i) for i in range(tokenizer.vocab_size)}
    space = [tokenizer.id_to_token(i) for i in tokenizer.encode(" a", add_bos=False)]
    byte_level = any("Ġ" in s for s in space)
    sentencepiece = any("▁" in s for s in space)
    if not (byte_level or sentencepiece):
        raise ValueError(f"cannot tell how the vocabulary spells a space ({space!r} for ' a'): constraints "
                         "support byte-level BPE ('Ġ') and SentencePiece ('▁') vocabularies")
    out = {}
    for i, s in spellings.items():
        if i in special or not s:
            continue
        if i in added:  # a non-special added token writes its content as is
            out[i] = added[i].content.encode("utf-8")
        elif byte_level:
            if all(c in decoder for c in s):
                out[i] = bytes(decoder[c] for c in s)
        else:
            m = _BYTE_TOKEN.match(s)
            if m:
                out[i] = bytes([int(m.group(1), 16)])
            else:
                out[i] = s.replace("▁", " ").encode("utf-8")
    return out


def _vocab_key(tokenizer) -> tuple:
    return (tokenizer.vocab_size, tokenizer.eos_id,
            tuple(tokenizer.id_to_token(i) for i in range(tokenizer.vocab_size)))


@functools.lru_cache(maxsize=8)
def _vocabulary(key: tuple, tokenizer) -> tuple[outlines_core.Vocabulary, dict[int, bytes]]:
    tokens = token_bytes(tokenizer)
    by_bytes: dict[bytes, list[int]] = {}
    for i, b in tokens.items():
        by_bytes.setdefault(b, []).append(i)
    return outlines_core.Vocabulary(tokenizer.eos_id, by_bytes), tokens


def _lower(index: outlines_core.Index, vocab_size: int, eos_id: int) -> TokenTables:
    transitions = index.get_transitions()  # {state: {token: next}}
    finals = set(index.get_final_states())
    initial = index.get_initial_state()
    states = sorted(transitions.keys() | finals | {initial}, key=lambda s: (s != initial, s))
    renum = {s: n for n, s in enumerate(states)}
    full = np.full((len(states), vocab_size), -1, np.int32)
    lookup = np.full(max(states) + 1, -1, np.int32)
    lookup[states] = np.arange(len(states))
    for s, moves in transitions.items():
        toks = np.fromiter(moves.keys(), np.int64, len(moves))
        full[renum[s], toks] = lookup[np.fromiter(moves.values(), np.int64, len(moves))]
    accepting = np.array([s in finals for s in states])
    full[:, eos_id] = np.where(accepting, np.arange(len(states)), -1)
    # Class 0 is the all-dead column (special tokens and any token no state allows).
    dead = np.full((len(states), 1), -1, np.int32)
    # unique columns as one opaque value each (np.unique over axis=1 sorts them lexicographically:
    # 30 s for a 262k vocabulary, against 1 s this way)
    rows = np.ascontiguousarray(np.concatenate([dead, full], axis=1).T)  # [V + 1, S]
    keys = rows.view(np.dtype((np.void, rows.dtype.itemsize * rows.shape[1])))[:, 0]
    _, first, token_class = np.unique(keys, return_index=True, return_inverse=True)
    columns = rows[first].T
    token_class = token_class.reshape(-1)
    order = np.argsort(token_class[:1] != np.arange(columns.shape[1]), kind="stable")  # dead column first
    rank = np.empty_like(order)
    rank[order] = np.arange(order.size)
    return TokenTables(token_class=rank[token_class[1:]].astype(np.int32),
                       next_state=np.ascontiguousarray(columns[:, order]).astype(np.int32),
                       accepting=accepting, initial=0, eos_id=int(eos_id))


FORCED_TOKENS = 16  # forced tokens kept per state
_FORCED_BYTES = 96  # the longest forced text looked for per state


def _forced(tables: TokenTables, tokens: dict[int, bytes], tokenizer, width: int = FORCED_TOKENS) -> np.ndarray:
    """int32[S, width]: per state, the tokens of the text every answer continues with from it (-1 padded).

    The forced text of a state is the longest common prefix of every continuation the automaton
    allows there (empty in an accepting state, where the answer may end; EOS alone in an accepting
    state that allows nothing else). It is tokenized as the tokenizer tokenizes that text alone, and
    the prefix of those tokens the automaton takes from the state is kept: drafts only, so a split the
    model would not write costs acceptance, never correctness.
    """
    n = tables.num_states
    spell = np.zeros(tables.token_class.shape[0], object)
    first = np.full(tables.token_class.shape[0], -1, np.int32)
    for i, b in tokens.items():
        if b and i < spell.shape[0]:
            spell[i], first[i] = b, b[0]
    allowed = [np.nonzero((tables.next_state[st][tables.token_class] >= 0) & (first >= 0))[0] for st in range(n)]
    memo: dict[tuple[int, int], bytes] = {}

    def common(a: bytes, b: bytes) -> bytes:
        k = 0
        while k < min(len(a), len(b)) and a[k] == b[k]:
            k += 1
        return a[:k]

    def text(st: int, budget: int) -> bytes:
        if budget <= 0 or tables.accepting[st]:
            return b""
        if (st, budget) in memo:
            return memo[st, budget]
        ids = allowed[st]
        out = b""
        if len(ids) and (first[ids] == first[ids[0]]).all():
            out = None
            for t in ids:
                b = spell[t]
                cand = b[:budget] if len(b) >= budget else b + text(tables.step(st, int(t)), budget - len(b))
                out = cand if out is None else common(out, cand)
                if not out:
                    break
        memo[st, budget] = out
        return out

    forced = np.full((n, width), -1, np.int32)
    eos = tables.eos_id
    for st in range(n):
        if tables.accepting[st]:
            if not len(allowed[st]) or (len(allowed[st]) == 1 and allowed[st][0] == eos):
                forced[st, 0] = eos
            continue
        raw = text(st, _FORCED_BYTES)
        if not raw:
            continue
        words = raw.decode("utf-8", errors="ignore")  # a cut multi-byte character is left out
        cur = st
        for j, t in enumerate(tokenizer.encode(words, add_bos=False)[:width]):
            cur = tables.step(cur, t)
            if cur < 0:
                break
            forced[st, j] = t
    return forced


@functools.lru_cache(maxsize=64)
def _compile(regex: str, key: tuple, tokenizer) -> TokenTables:
    vocab, tokens = _vocabulary(key, tokenizer)
    try:
        index = outlines_core.Index(regex, vocab)
    except Exception as e:  # outlines-core raises a plain ValueError/RuntimeError naming the cause
        raise ValueError(f"the constraint cannot be compiled over this vocabulary: {e}") from e
    tables = _lower(index, tokenizer.vocab_size, tokenizer.eos_id)
    if not tables.allowed(tables.initial).any():
        raise ValueError("the constraint allows no answer: no token can start it")
    return dataclasses.replace(tables, forced=_forced(tables, tokens, tokenizer))


def compile_regex(regex: str, tokenizer) -> TokenTables:
    """Tables for answers matching `regex` (whole answer), cached by (regex, vocabulary)."""
    if tokenizer.eos_id is None:
        raise ValueError("constraints need a tokenizer with an EOS id to end an answer")
    return _compile(regex, _vocab_key(tokenizer), tokenizer)


def compile_schema(schema: dict | str, tokenizer, *, whitespace: str | None = None) -> TokenTables:
    """Tables for JSON answers valid under `schema`; compact JSON unless `whitespace` (a regex) is given."""
    text = schema if isinstance(schema, str) else json.dumps(schema)  # key order kept: it is the answer's property order
    try:
        regex = build_regex_from_schema(text, whitespace if whitespace is not None else "")
    except Exception as e:
        raise ValueError(f"unsupported JSON schema: {e}") from e
    return compile_regex(regex, tokenizer)


def compile_choice(choices: list[str], tokenizer) -> TokenTables:
    """Tables for an answer that is exactly one of `choices`."""
    if not choices or not all(isinstance(c, str) and c for c in choices):
        raise ValueError("choice needs a non-empty list of non-empty strings")
    return compile_regex("|".join(f"({re.escape(c)})" for c in choices), tokenizer)


def from_request(tokenizer, *, response_format: dict | None = None, regex: str | None = None,
                 choice: list[str] | None = None) -> TokenTables | None:
    """The tables of a request's constraint, given the OpenAI way or by the extension fields, or None.

    Args:
      response_format: `{"type": "text"}` (none), `{"type": "json_object"}` (any JSON object), or
        `{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}`.
      regex: the whole answer matches this regular expression (extension field).
      choice: the answer is exactly one of these strings (extension field).

    Raises:
      ValueError: more than one constraint, a malformed `response_format`, or a constraint the
        automaton cannot take (recursive `$ref`, a pattern outlines-core refuses), saying why.
    """
    given = [n for n, v in (("response_format", response_format), ("regex", regex), ("choice", choice))
             if v is not None and v != {"type": "text"}]
    if len(given) > 1:
        raise ValueError(f"{' and '.join(given)} given together: give one constraint")
    if not given:
        return None
    if regex is not None:
        if not isinstance(regex, str) or not regex:
            raise ValueError("regex must be a non-empty string (the whole answer matches it)")
        return compile_regex(regex, tokenizer)
    if choice is not None:
        return compile_choice(choice, tokenizer)
    if not isinstance(response_format, dict):
        raise ValueError("response_format must be an object: {\"type\": \"json_schema\", \"json_schema\": {...}}")
    kind = response_format.get("type")
    if kind == "json_object":
        return compile_schema({"type": "object"}, tokenizer)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise ValueError("response_format json_schema needs {\"json_schema\": {\"name\": ..., \"schema\": {...}}}")
        return compile_schema(spec["schema"], tokenizer)
    raise ValueError(f"response_format type {kind!r}: use \"text\", \"json_object\" or \"json_schema\"")
