"""Oracles from outside: the same weights in HF transformers give the same logits and tokens.

The real SmolLM2-135M GGUF, loaded by transformers' own GGUF reader (its own dequantization and
q/k un-permutation), and tiny random HF checkpoints written by transformers' `save_pretrained`.
"""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import need_module
from flax import nnx

from specjax.serving.engine import Engine
from specjax.models import loader

pytestmark = pytest.mark.oracle
transformers = need_module("transformers")
torch = need_module("torch")

NEW_TOKENS = 32



@functools.partial(jax.jit, static_argnames=("graphdef",))
def _logits(graphdef, params, tokens):
    model = nnx.merge(graphdef, params)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    return model(tokens, positions, model.init_cache(*tokens.shape)).logits


def our_logits(model, ids) -> np.ndarray:
    graphdef, params = nnx.split(model)
    return np.asarray(_logits(graphdef, params, jnp.asarray([ids], jnp.int32)))[0]


def hf_logits(model, ids) -> np.ndarray:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float().numpy()


# ---- SmolLM2-135M from its GGUF ----------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_smollm2(smollm2_path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm2_path.parent), gguf_file=smollm2_path.name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def chat_prompts(smollm2):
    """Two chat-formatted prompts of different lengths (the first ~30 tokens)."""
    tok = smollm2.tokenizer
    out = []
    for text in ("What is the capital of France?", "Hi!"):
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), add_bos=False)
        out.append(ids)
    assert len(out[0]) != len(out[1])
    return out


@pytest.fixture(scope="module")
def smollm2_engine(smollm2):
    return Engine(smollm2.model, smollm2.tokenizer)


def test_smollm2_logits_match_transformers(smollm2, hf_smollm2, chat_prompts):
    """fp32 logits at every prompt position: max |ours - HF| < 1e-3, and the same argmax everywhere.

    Observed: 1.3e-4 (jax 0.10.2 vs torch 2.13 on CPU) on logits up to |37.6|; a wrong RoPE,
    permutation or norm gives differences of order 1-10.
    """
    ids = chat_prompts[0]
    ours, ref = our_logits(smollm2.model, ids), hf_logits(hf_smollm2, ids)
    assert ours.shape == ref.shape == (len(ids), 49152)
    assert np.abs(ref).max() > 10  # a real model's logits, not a degenerate all-zero output
    np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-3)
    np.testing.assert_array_equal(ours.argmax(-1), ref.argmax(-1))


def test_smollm2_greedy_matches_transformers_generate(smollm2_engine, hf_smollm2, chat_prompts):
    """32 greedy tokens, neither side stopping at <|im_end|> (which this prompt reaches at token 8).

    HF gets eos_token_id=None, not min_new_tokens: the latter masks eos out of the logits and so
    changes which token is the argmax.
    """
    ids = chat_prompts[0]
    (ours,) = smollm2_engine.generate([ids], max_new_tokens=NEW_TOKENS, stop_ids=())
    with torch.inference_mode():
        out = hf_smollm2.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=NEW_TOKENS, eos_token_id=None, do_sample=False, pad_token_id=0)
    ref = out[0, len(ids):].tolist()
    assert len(ref) == NEW_TOKENS
    tok = smollm2_engine.tokenizer
    assert ours.tokens == ref, (tok.decode(ours.tokens), tok.decode(ref))


def test_smollm2_batch_of_two_equals_batch_of_one(smollm2_engine, chat_prompts):
    pair = smollm2_engine.generate(chat_prompts, max_new_tokens=NEW_TOKENS, stop_ids=())
    for prompt, row in zip(chat_prompts, pair):
        (alone,) = smollm2_engine.generate([prompt], max_new_tokens=NEW_TOKENS, stop_ids=())
        assert row.tokens == alone.tokens
    assert pair[0].tokens != pair[1].tokens


# ---- tiny random checkpoints written by transformers -------------------------------------------

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6)


def _tokenizer_json(path):
    """A minimal tokenizer.json (loader.load wants one next to the weights)."""
    from tokenizers import Tokenizer, models

    vocab = {f"t{i}": i for i in range(64)}
    Tokenizer(models.WordLevel(vocab, unk_token="t0")).save(str(path / "tokenizer.json"))


def _save_hf(tmp_path, cls, config_cls, **overrides):
    torch.manual_seed(0)
    hf = cls(config_cls(**{**TINY, **overrides})).eval()
    with torch.no_grad():  # random norms and biases too, not their 1 / 0 init
        for name, p in hf.named_parameters():
            if p.ndim == 1:
                p.add_(0.2 * torch.randn_like(p))
    hf.save_pretrained(tmp_path)
    _tokenizer_json(tmp_path)
    return hf


@pytest.mark.parametrize(
    "arch, overrides",
    [
        pytest.param("llama", {"tie_word_embeddings": True}, id="llama-tied"),
        pytest.param("llama", {"tie_word_embeddings": False, "head_dim": 16}, id="llama-untied-head_dim16"),
        pytest.param("qwen2", {"tie_word_embeddings": False}, id="qwen2-untied"),
        pytest.param("qwen2", {"tie_word_embeddings": True}, id="qwen2-tied"),
        pytest.param("llama", {"rope_theta": 50_000.0}, id="llama-rope_theta"),
    ],
)
def test_tiny_hf_checkpoint_matches_transformers(tmp_path, arch, overrides):
    classes = {"llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig),
               "qwen2": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config)}
    hf = _save_hf(tmp_path, *classes[arch], **overrides)
    saved = json.loads((tmp_path / "config.json").read_text())
    lm = loader.load(str(tmp_path))
    assert lm.config.tie_embeddings == saved["tie_word_embeddings"]
    ids = list(np.random.default_rng(0).integers(0, 64, 12))
    ours, ref = our_logits(lm.model, ids), hf_logits(hf, ids)
    np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-4 * max(1.0, np.abs(ref).max()))


# ---- tiny random checkpoints of the other families, greedy against transformers' generate --------

W = 4  # a sliding window the prompts and the generation cross several times
WINDOWED = dict(num_hidden_layers=3, head_dim=8)
FAMILIES = {
    "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig", dict(
        WINDOWED, sliding_window=W, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        query_pre_attn_scalar=16, rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                                   "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", dict(head_dim=16, tie_word_embeddings=False)),
    "qwen3-window": ("Qwen3ForCausalLM", "Qwen3Config", dict(WINDOWED, use_sliding_window=True, sliding_window=W,
                                                             max_window_layers=1)),
    "mistral-window": ("MistralForCausalLM", "MistralConfig", dict(WINDOWED, sliding_window=W)),
}
RAGGED = [list(np.random.default_rng(i).integers(0, 64, n)) for i, n in enumerate((11, 6, 15))]


def _save_family(path, family):
    cls, config_cls, overrides = FAMILIES[family]
    torch.manual_seed(0)
    hf = getattr(transformers, cls)(getattr(transformers, config_cls)(**{**TINY, **overrides})).eval()
    with torch.no_grad():  # weights of unit-scale activations (HF's 0.02 init gives near-uniform logits)
        for name, p in hf.named_parameters():
            p.copy_(0.2 * torch.randn_like(p) if p.ndim == 1 else torch.randn_like(p) * p.shape[-1] ** -0.5)
        hf.get_input_embeddings().weight.normal_()
    hf.save_pretrained(path)
    _tokenizer_json(path)
    return hf


def _hf_greedy(hf, ids, n):
    with torch.inference_mode():
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_family_greedy_matches_transformers(tmp_path, family):
    """Three ragged prompts in one batch, 24 greedy tokens each: ours equal HF's generate token for
    token (Gemma 3's four norms, q/k norm, GELU-tanh, scaled embedding, query scalar and per-kind rope;
    Qwen3's q/k norm; the sliding window of Gemma 3, Qwen3 and Mistral, in a ring)."""
    hf = _save_family(tmp_path, family)
    lm = loader.load(str(tmp_path))
    windowed = "sliding_window" in FAMILIES[family][2]
    assert bool(lm.config.local_layers) == windowed
    ours = Engine(lm.model, lm.tokenizer).generate(RAGGED, max_new_tokens=24, stop_ids=())
    for ids, row in zip(RAGGED, ours):
        assert row.tokens == _hf_greedy(hf, ids, 24)
    ids = RAGGED[0]
    ref = hf_logits(hf, ids)
    np.testing.assert_allclose(our_logits(lm.model, ids), ref, rtol=0, atol=1e-4 * max(1.0, np.abs(ref).max()))


def test_without_its_window_mistral_decodes_otherwise(tmp_path):
    """The control for the windowed cases: the same Mistral weights read without `sliding_window`
    (what specjax did before) give other tokens, so the identity above depends on the window."""
    hf = _save_family(tmp_path, "mistral-window")
    saved = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**saved, "sliding_window": None}))
    lm = loader.load(str(tmp_path))
    assert not lm.config.local_layers
    ours = Engine(lm.model, lm.tokenizer).generate(RAGGED, max_new_tokens=24, stop_ids=())
    assert sum(row.tokens != _hf_greedy(hf, ids, 24) for ids, row in zip(RAGGED, ours)) >= 2
