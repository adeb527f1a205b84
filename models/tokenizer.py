"""Text <-> token ids, built from GGUF metadata or a Hugging Face tokenizer directory.

A GGUF file carries no `tokenizer.json`: it stores the vocabulary, the merges, the token types and a
pre-tokenizer name under llama.cpp's keys. We rebuild the tokenizer from those with the `tokenizers`
library: byte-level BPE following llama.cpp's choice of split per `tokenizer.ggml.pre` (which is also
what the original `tokenizer.json` of each model does), or Gemma's SentencePiece BPE (`_gemma_sentencepiece`):

    tok = Tokenizer.from_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    ids = tok.encode(prompt)
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import pathlib

import gguf
import jinja2
import jinja2.ext
import jinja2.sandbox
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _Backend

# llama.cpp's token types (gguf.TokenType): CONTROL tokens are special (skipped by skip_special),
# USER_DEFINED ones are matched whole in text but decoded like ordinary text.
_CONTROL, _USER_DEFINED = 3, 4

# Tokens that end a turn in the chat formats we meet; each becomes a stop id when the vocab has it.
_END_OF_TURN = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<|end|>",
                "<end_of_turn>")

# Split patterns of llama.cpp's pre-tokenizer names (same strings as the models' tokenizer.json).
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _byte_level_pipeline(pre: str) -> tuple[pre_tokenizers.PreTokenizer, normalizers.Normalizer | None, bool]:
    """(pre-tokenizer, normalizer, ignore_merges) for a `tokenizer.ggml.pre` name."""
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("default", "gpt2"):
        return gpt2, None, False
    if pre == "smollm":
        # SmolLM was trained with every digit its own pre-token; the vocab has no digit merges, but
        # without this split "  1" would lose the "ĠĠ" merge that a separate "  " chunk gets.
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2]), None, False
    split = {"qwen2": _QWEN2_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT}.get(pre)
    if split is None:
        raise ValueError(f"unsupported tokenizer.ggml.pre {pre!r}: expected one of default, gpt2, smollm, "
                         "qwen2, llama-bpe, llama3")
    # The regex already did GPT-2's job, so ByteLevel only maps bytes to its alphabet.
    pipeline = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    # Qwen2's tokenizer.json normalizes to NFC; Llama 3's looks a whole pre-token up before merging.
    return pipeline, normalizers.NFC() if pre == "qwen2" else None, pre != "qwen2"


def _byte_level(reader: gguf.GGUFReader, tokens: list[str], types: list[int]) -> _Backend:
    """Byte-level BPE from the vocabulary, the merges and llama.cpp's pre-tokenizer name."""
    pre = _field(reader, "tokenizer.ggml.pre", "default")
    pre_tokenizer, normalizer, ignore_merges = _byte_level_pipeline(pre)
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges", [])]
    backend = _Backend(models.BPE({t: i for i, t in enumerate(tokens)}, merges, ignore_merges=ignore_merges))
    backend.pre_tokenizer = pre_tokenizer
    backend.normalizer = normalizer
    backend.decoder = decoders.ByteLevel()
    # Added tokens reuse their vocab ids (the contents are already in the vocab), so the size stays put;
    # without them "<|im_start|>" in text would be cut into byte pieces.
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, ty in zip(tokens, types) if ty == _CONTROL])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, ty in zip(tokens, types) if ty == _USER_DEFINED])
    return backend


_SENTENCEPIECE_ARCHS = ("gemma3",)


def _gemma_sentencepiece(reader: gguf.GGUFReader, tokens: list[str], types: list[int]) -> _Backend:
    """Gemma's SentencePiece BPE (spaces as "▁", byte fallback, no prefix space) from a GGUF.

    The file has the vocabulary but no merges, and spells its whitespace-only tokens with real spaces.
    As transformers' GGUF conversion: those tokens are spelled with "▁" (one per character), the
    merges are every split of a token into two vocabulary tokens, ranked by the token's place in the
    file (Gemma's scores do not follow its merge order), and the pipeline is `GemmaTokenizer`'s.
    """
    spelled = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {t: i for i, t in enumerate(spelled)}
    rank = {t: -i for i, t in enumerate(spelled)}  # the file's order: earlier is merged first
    unk = _field(reader, "tokenizer.ggml.unknown_token_id")
    backend = _Backend(models.BPE(vocab, _merges_by_rank(vocab, rank), unk_token=None if unk is None else spelled[unk],
                                  fuse_unk=True, byte_fallback=True))
    backend.normalizer = normalizers.Replace(" ", "\u2581")
    backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, ty in zip(tokens, types) if ty == _CONTROL])
    # user-defined tokens ("\n", "\n\n", "<table>", ...) match whole in the text; a respelled
    # whitespace token is matched by the BPE instead, as in transformers
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, ty in zip(tokens, types) if ty == _USER_DEFINED and t in vocab])
    return backend


def _merges_by_rank(vocab: dict[str, int], rank: dict[str, int]) -> list[tuple[str, str]]:
    """The merges a vocabulary implies: each token split into two vocabulary tokens at every place
    that works, best rank first; ties: longer left, then longer right piece first (each token's own
    splits first ordered by the pieces' ids)."""
    merges = []
    for token, score in rank.items():
        splits = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in vocab and token[i:] in vocab]
        splits.sort(key=lambda lr: (vocab[lr[0]], vocab[lr[1]]))
        merges += [(left, right, score) for left, right in splits]
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _field(reader: gguf.GGUFReader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _read_json(path: pathlib.Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _token_id(backend: _Backend, token) -> int | None:
    # tokenizer_config.json writes special tokens either as strings or as AddedToken dicts.
    content = token.get("content") if isinstance(token, dict) else token
    return None if content is None else backend.token_to_id(content)


class Tokenizer:
    """A BPE tokenizer (byte-level, or SentencePiece's with byte fallback) with the special ids and chat
    template of one checkpoint.

    Attributes:
        vocab_size: Number of ids, special tokens included.
        bos_id, eos_id, pad_id: Special ids, None when the checkpoint has none.
        stop_ids: Ids that end generation: eos plus the end-of-turn tokens found in the vocab.
        chat_template: Jinja chat template, or None.
        add_bos: Whether `encode` prepends bos by default.
    """

    def __init__(self, backend: _Backend, *, bos_id: int | None, eos_id: int | None, pad_id: int | None = None,
                 unk_id: int | None = None, chat_template: str | None = None, add_bos: bool = False,
                 extra_stop_ids: tuple[int, ...] = ()):
        self._backend = backend
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.bos_id, self.eos_id, self.pad_id, self._unk_id = bos_id, eos_id, pad_id, unk_id
        self.chat_template = chat_template
        self.add_bos = bool(add_bos) and bos_id is not None
        found = (backend.token_to_id(t) for t in _END_OF_TURN)
        stops = [eos_id, *extra_stop_ids, *found]
        self.stop_ids = tuple(dict.fromkeys(i for i in stops if i is not None))

    @classmethod
    def from_gguf(cls, path_or_reader: str | os.PathLike | gguf.GGUFReader) -> Tokenizer:
        """Builds the tokenizer described by a GGUF file's `tokenizer.*` metadata.

        Args:
            path_or_reader: Path to a .gguf file, or an open `gguf.GGUFReader`.

        Raises:
            ValueError: The file's tokenizer model or pre-tokenizer is not supported.
        """
        reader = path_or_reader if isinstance(path_or_reader, gguf.GGUFReader) else gguf.GGUFReader(path_or_reader)
        kind = _field(reader, "tokenizer.ggml.model")
        arch = _field(reader, "general.architecture")
        tokens = _field(reader, "tokenizer.ggml.tokens")
        types = _field(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
        if kind == "gpt2":
            backend = _byte_level(reader, tokens, types)
        elif kind == "llama" and arch in _SENTENCEPIECE_ARCHS:
            backend = _gemma_sentencepiece(reader, tokens, types)
        else:
            raise ValueError(f"unsupported tokenizer.ggml.model {kind!r} for architecture {arch!r}: supported are "
                             "byte-level BPE ('gpt2') and Gemma's SentencePiece ('llama' in a "
                             f"{'/'.join(_SENTENCEPIECE_ARCHS)} file)")
        get_id = lambda key: _field(reader, f"tokenizer.ggml.{key}_token_id")  # noqa: E731
        return cls(backend, bos_id=get_id("bos"), eos_id=get_id("eos"), pad_id=get_id("padding"),
                   unk_id=get_id("unknown"), chat_template=_field(reader, "tokenizer.chat_template"),
                   add_bos=_field(reader, "tokenizer.ggml.add_bos_token", False))

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike) -> Tokenizer:
        """Loads `tokenizer.json` plus `tokenizer_config.json` (special tokens, add_bos, chat template).

        Also reads `chat_template.jinja` and `generation_config.json`'s eos ids when present.
        """
        path = pathlib.Path(path)
        backend = _Backend.from_file(str(path / "tokenizer.json"))
        config = _read_json(path / "tokenizer_config.json")
        get_id = lambda name: _token_id(backend, config.get(name))  # noqa: E731
        bos_id = get_id("bos_token")
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
            template = {t["name"]: t["template"] for t in template}.get("default")
        if (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text(encoding="utf-8")
        add_bos = config.get("add_bos_token")
        if add_bos is None:  # Llama-style tokenizer.json adds bos in its post-processor instead.
            add_bos = bos_id is not None and bos_id in backend.encode("", add_special_tokens=True).ids
        gen_eos = _read_json(path / "generation_config.json").get("eos_token_id", [])
        return cls(backend, bos_id=bos_id, eos_id=get_id("eos_token"), pad_id=get_id("pad_token"),
                   unk_id=get_id("unk_token"), chat_template=template, add_bos=add_bos,
                   extra_stop_ids=tuple(gen_eos if isinstance(gen_eos, list) else [gen_eos]))

    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`; special tokens written in the text (e.g. `<|im_start|>`) stay whole.

        Args:
            text: The text to encode.
            add_bos: Prepend bos; defaults to the checkpoint's `add_bos`.
        """
        # The post-processor is bypassed so bos is added exactly once, here, whatever tokenizer.json says.
        # encode_batch releases the GIL while it works (encode does not): a server tokenizing in a
        # worker thread keeps its event loop running.
        ids = self._backend.encode_batch([text], add_special_tokens=False)[0].ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids = [self.bos_id, *ids]
        return ids

    def decode(self, ids, *, skip_special: bool = False) -> str:
        """Text of `ids` (any iterable of ints, e.g. a numpy array); incomplete UTF-8 becomes U+FFFD."""
        return self._backend.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocab entry of `token_id` as the vocabulary spells it ("Ġhello" byte-level, "▁hello" SentencePiece)."""
        return self._backend.id_to_token(int(token_id))

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True, **kwargs) -> str:
        """Renders `messages` with the checkpoint's chat template, as HF's `apply_chat_template(tokenize=False)`.

        Args:
            messages: `[{"role": ..., "content": ...}, ...]`.
            add_generation_prompt: End with the header that opens the assistant's turn.
            **kwargs: Extra template variables (e.g. `tools`).

        Raises:
            ValueError: The checkpoint has no chat template.
        """
        if not self.chat_template:
            raise ValueError("this checkpoint has no chat template (no tokenizer.chat_template / chat_template); "
                             "format the prompt yourself")
        names = {"bos_token": self.bos_id, "eos_token": self.eos_id, "pad_token": self.pad_id,
                 "unk_token": self._unk_id}
        specials = {k: self._backend.id_to_token(i) for k, i in names.items() if i is not None}
        return _compile(self.chat_template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                   **{**specials, **kwargs})

    def decode_stream(self, *, skip_special: bool = False) -> StreamDecoder:
        """A `StreamDecoder` over this tokenizer."""
        return StreamDecoder(self, skip_special=skip_special)


@functools.lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    # Chat templates come from downloaded files, so they run sandboxed; the settings and helpers match
    # transformers' so that templates written for it render the same.
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[jinja2.ext.loopcontrols])

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    # Jinja's own tojson escapes HTML characters, which would change the prompt.
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(template)


class StreamDecoder:
    """Incremental detokenizer: feed ids as they arrive, get back only complete UTF-8 text.

    A multi-byte character (emoji, CJK) can be spread over several byte-level tokens; until its last
    byte arrives the tail decodes to U+FFFD, so that tail is held back. Each step decodes a short
    window, starting at the previous step's tokens (context for decoders that strip a leading space),
    instead of everything so far.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special: bool = False):
        self._tokenizer, self._skip_special = tokenizer, skip_special
        self._ids: list[int] = []
        self._prefix = self._read = 0  # window start; end of the tokens whose text is all out
        self._extra = 0  # characters already out beyond the text of ids[prefix:read]

    def _decode(self, ids) -> str:
        return self._tokenizer.decode(ids, skip_special=self._skip_special)

    def push(self, ids) -> str:
        """Adds one id or an iterable of ids; returns the newly completed text (maybe "")."""
        try:
            self._ids.extend(int(i) for i in ids)
        except TypeError:  # a single id: int, numpy or 0-d array scalar
            self._ids.append(int(ids))
        return self._emit(final=False)

    def flush(self) -> str:
        """Returns whatever is held back (invalid bytes as U+FFFD), e.g. when generation stops."""
        return self._emit(final=True)

    def _emit(self, *, final: bool) -> str:
        start = len(self._decode(self._ids[self._prefix:self._read])) + self._extra
        text = self._decode(self._ids[self._prefix:])
        if not final and text.endswith("\ufffd"):  # an unfinished character: out up to it, keep the window
            new = text.rstrip("\ufffd")[start:]
            self._extra += len(new)
            return new
        self._prefix, self._read, self._extra = self._read, len(self._ids), 0
        return text[start:]
