"""Checkpoint loaders: HF directory and GGUF round trips of tiny random models, and their errors."""

import dataclasses
import functools
import json
import pathlib

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from gguf import GGMLQuantizationType
from safetensors.numpy import save_file
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as Backend

from specjax.models import catalog, gguf_loader, hf_loader, linear, loader, quant
from specjax.models.config import ModelConfig
from specjax.models.gguf_loader import GGUFError

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
B, T = 2, 12

CONFIGS = {
    # GQA, tied head, non-default rope theta / eps / context, so the metadata must be read
    "llama": ModelConfig(name="src", vocab_size=64, dim=32, num_layers=2, num_heads=4, num_kv_heads=2,
                         head_dim=8, ffn_dim=64, rope_theta=50_000.0, norm_eps=1e-6, max_seq_len=256),
    # own LM head, and head_dim * heads != dim
    "llama-untied": ModelConfig(name="src", vocab_size=64, dim=32, num_layers=2, num_heads=4, num_kv_heads=1,
                                head_dim=16, ffn_dim=64, tie_embeddings=False, max_seq_len=128),
    # Qwen2: q/k/v biases, no q/k permutation in its GGUF
    "qwen2": ModelConfig(name="src", vocab_size=64, dim=32, num_layers=2, num_heads=4, num_kv_heads=2,
                         head_dim=8, ffn_dim=64, rope_theta=1_000_000.0, norm_eps=1e-6, qkv_bias=True,
                         tie_embeddings=False, max_seq_len=512),
    # Qwen3: q/k norm, no bias, head_dim * heads != dim
    "qwen3": ModelConfig(name="src", family="qwen3", vocab_size=64, dim=32, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=16, ffn_dim=64, rope_theta=1_000_000.0, norm_eps=1e-6,
                         qk_norm=True, max_seq_len=512),
    # Gemma 3: four 1 + w norms a block, a global layer between sliding ones, its own local rope base
    "gemma3": ModelConfig(name="src", family="gemma3", vocab_size=64, dim=32, num_layers=3, num_heads=4,
                          num_kv_heads=1, head_dim=8, ffn_dim=64, rope_theta=1_000_000.0, rope_local_theta=100.0,
                          norm_eps=1e-6, max_seq_len=512, layer_kinds=("local", "global", "local"),
                          sliding_window=4, qk_norm=True, norm_offset=1.0, query_pre_attn_scalar=8.0,
                          mlp_activation="gelu_tanh", embed_scale=True),
}


# ---- helpers -----------------------------------------------------------------------------------


def random_model(config: ModelConfig, seed: int):
    """A random model built in numpy (no eager jax ops to compile): norms and biases not 1 and 0."""
    abstract = nnx.eval_shape(lambda: loader.init_model(config))
    rng = np.random.default_rng(seed)
    weights = {}
    for path, v in nnx.to_flat_state(nnx.state(abstract, nnx.Param)):
        name, shape = ".".join(map(str, path)), v.shape
        if len(shape) == 2:
            w = rng.normal(size=shape) * (1.0 if name == "embed" else shape[0] ** -0.5)
        else:
            w = (1.0 if name.endswith("scale") else 0.0) + 0.2 * rng.normal(size=shape)
        weights[name] = w.astype(np.float32)
    return loader.model_from_weights(config, weights)


def flat_weights(model) -> dict[str, np.ndarray]:
    """`{"layers.0.attn.wq": array}`: the names (and the [K, N] form) `loader.model_from_weights` takes,
    whichever layout the model stores (`specjax.models.linear`)."""
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    return {".".join(map(str, path)): np.asarray(v[...]).T if v.get_metadata().get("dense_layout") == "nk"
            else np.asarray(v[...]) for path, v in flat}


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _logits(graphdef, params, tokens):
    model = nnx.merge(graphdef, params)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    return model(tokens, positions, model.init_cache(*tokens.shape)).logits


def logits(model) -> np.ndarray:
    tokens = np.random.default_rng(0).integers(0, model.config.vocab_size, (B, T), dtype=np.int32)
    graphdef, params = nnx.split(model)
    return np.asarray(_logits(graphdef, params, jnp.asarray(tokens)))


@pytest.fixture(scope="module")
def sources():
    return {name: random_model(c, seed=i) for i, (name, c) in enumerate(CONFIGS.items())}


@pytest.fixture(scope="module")
def source_logits(sources):
    return {name: logits(m) for name, m in sources.items()}


def _assert_same_config(loaded: ModelConfig, source: ModelConfig):
    assert loaded.norm_eps == pytest.approx(source.norm_eps, rel=1e-6)  # GGUF stores it as float32
    assert loaded.weight_layout == linear.preferred_layout()  # the load-time layout choice
    assert dataclasses.replace(loaded, name=source.name, norm_eps=source.norm_eps,
                               weight_layout=source.weight_layout) == source


def _byte_alphabet() -> list[str]:
    """GPT-2's bytes_to_unicode: printable stand-ins for the 256 bytes, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


def _vocab(n: int) -> list[str]:
    """n token strings: the special tokens, then single byte-level characters."""
    return [*SPECIALS, *_byte_alphabet()[ord("a"):][: n - len(SPECIALS)]]


# ---- HF directory ------------------------------------------------------------------------------

# Written out here, not inverted from hf_loader's table, so a wrong entry there cannot cancel out.
_HF_LAYER = {
    "attn_norm.scale": "input_layernorm.weight", "mlp_norm.scale": "post_attention_layernorm.weight",
    "attn.wq": "self_attn.q_proj.weight", "attn.wk": "self_attn.k_proj.weight",
    "attn.wv": "self_attn.v_proj.weight", "attn.wo": "self_attn.o_proj.weight",
    "attn.bq": "self_attn.q_proj.bias", "attn.bk": "self_attn.k_proj.bias", "attn.bv": "self_attn.v_proj.bias",
    "mlp.w_gate": "mlp.gate_proj.weight", "mlp.w_up": "mlp.up_proj.weight",
    "mlp.w_down": "mlp.down_proj.weight",
}


def write_hf_dir(path: pathlib.Path, model, arch: str) -> pathlib.Path:
    """config.json + model.safetensors in HF naming ([out, in] matrices) + a tiny tokenizer.json."""
    c = model.config
    path.mkdir(parents=True, exist_ok=True)
    cfg = {
        "architectures": [arch], "vocab_size": c.vocab_size, "hidden_size": c.dim,
        "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim, "intermediate_size": c.ffn_dim,
        "rope_theta": c.rope_theta, "rms_norm_eps": c.norm_eps, "tie_word_embeddings": c.tie_embeddings,
        "max_position_embeddings": c.max_seq_len,
    }
    (path / "config.json").write_text(json.dumps(cfg))
    tensors = {}
    for name, w in flat_weights(model).items():
        if name == "embed":
            hf = "model.embed_tokens.weight"
        elif name == "norm.scale":
            hf = "model.norm.weight"
        elif name == "lm_head":
            hf = "lm_head.weight"
        else:
            _, idx, rest = name.split(".", 2)
            hf = f"model.layers.{idx}.{_HF_LAYER[rest]}"
        tensors[hf] = np.ascontiguousarray(w.T if w.ndim == 2 and name != "embed" else w)
    if c.tie_embeddings:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]  # some exports store it anyway
    save_file(tensors, str(path / "model.safetensors"))

    vocab = _vocab(c.vocab_size)
    backend = Backend(models.BPE({t: i for i, t in enumerate(vocab)}, []))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True) for t in SPECIALS])
    backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    return path


@pytest.mark.parametrize("name, arch", [("llama", "LlamaForCausalLM"), ("llama-untied", "LlamaForCausalLM"),
                                        ("qwen2", "Qwen2ForCausalLM")])
def test_hf_dir_round_trip(tmp_path, sources, source_logits, name, arch):
    src = sources[name]
    path = write_hf_dir(tmp_path / "src", src, arch)
    lm = loader.load(str(path))
    assert lm.source == str(path) and len(lm.weights_id) == 16
    _assert_same_config(lm.config, src.config)
    loaded, want = flat_weights(lm.model), flat_weights(src)
    assert loaded.keys() == want.keys()
    for k in want:
        np.testing.assert_array_equal(loaded[k], want[k], err_msg=k)
    np.testing.assert_allclose(logits(lm.model), source_logits[name], rtol=0, atol=1e-5)
    assert lm.tokenizer.eos_id == SPECIALS.index("<|im_end|>")
    assert lm.tokenizer.eos_id in lm.tokenizer.stop_ids
    assert lm.tokenizer.encode("abc") == [3, 4, 5]


def test_hf_bf16_checkpoint(tmp_path, sources):
    """bf16 safetensors are widened to the model's float32 exactly."""
    from safetensors.flax import load_file, save_file as save_flax

    src = sources["qwen2"]
    path = write_hf_dir(tmp_path / "src", src, "Qwen2ForCausalLM")
    f = path / "model.safetensors"
    save_flax({k: v.astype(jnp.bfloat16) for k, v in load_file(str(f)).items()}, str(f))
    weights = hf_loader.weights_from_hf(path, hf_loader.config_from_hf(path))
    for k, w in flat_weights(src).items():
        want = np.asarray(jnp.asarray(w).astype(jnp.bfloat16), np.float32)
        np.testing.assert_array_equal(weights[k], want, err_msg=k)


def test_hf_errors(tmp_path, sources):
    with pytest.raises(ValueError, match="no config.json"):
        hf_loader.config_from_hf(tmp_path)
    path = write_hf_dir(tmp_path / "hf", sources["llama"], "GPT2LMHeadModel")
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*not supported"):
        hf_loader.config_from_hf(path)
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        hf_loader.weights_from_hf(tmp_path, CONFIGS["llama"])


# ---- GGUF --------------------------------------------------------------------------------------

# llama.cpp's names, from the gguf package's own table (not from gguf_loader's)
_T = gguf.MODEL_TENSOR
_GGUF_LAYER = {
    ours: gguf.TENSOR_NAMES[t].removeprefix("blk.{bid}.") + suffix
    for ours, t, suffix in [
        ("attn_norm.scale", _T.ATTN_NORM, ".weight"), ("mlp_norm.scale", _T.FFN_NORM, ".weight"),
        ("attn.wq", _T.ATTN_Q, ".weight"), ("attn.wk", _T.ATTN_K, ".weight"),
        ("attn.wv", _T.ATTN_V, ".weight"), ("attn.wo", _T.ATTN_OUT, ".weight"),
        ("attn.bq", _T.ATTN_Q, ".bias"), ("attn.bk", _T.ATTN_K, ".bias"), ("attn.bv", _T.ATTN_V, ".bias"),
        ("mlp.w_gate", _T.FFN_GATE, ".weight"), ("mlp.w_up", _T.FFN_UP, ".weight"),
        ("mlp.w_down", _T.FFN_DOWN, ".weight"),
        ("attn.q_norm.scale", _T.ATTN_Q_NORM, ".weight"), ("attn.k_norm.scale", _T.ATTN_K_NORM, ".weight"),
        ("post_attn_norm.scale", _T.ATTN_POST_NORM, ".weight"), ("post_mlp_norm.scale", _T.FFN_POST_NORM, ".weight"),
    ]
}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py `LlamaModel.permute` (HF rotate-half rows -> interleaved)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path: pathlib.Path, model, *, arch: str = "llama", qtype: str = "F32", tokenizer: bool = True,
               permute: bool = True, vocab_key: bool = True, extra=None) -> pathlib.Path:
    """A GGUF as llama.cpp's converter writes it: torch-layout tensors, q/k permuted for `llama`,
    Gemma's norms stored as 1 + w with its window, layer pattern and local rope base.

    qtype applies to the 2-D matrices; norms and biases stay F32, as in llama.cpp's exports.
    Without `tokenizer`, `{arch}.vocab_size` says the vocabulary size instead (unless not `vocab_key`).
    `extra(writer)`, when given, adds more metadata and tensors (rope scaling) before the weights.
    """
    c = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(c.num_layers)
    writer.add_context_length(c.max_seq_len)
    writer.add_embedding_length(c.dim)
    writer.add_feed_forward_length(c.ffn_dim)
    writer.add_head_count(c.num_heads)
    writer.add_head_count_kv(c.num_kv_heads)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_rope_freq_base(c.rope_theta)
    writer.add_layer_norm_rms_eps(c.norm_eps)
    if tokenizer:
        writer.add_tokenizer_model("gpt2")
        writer.add_token_list(_vocab(c.vocab_size))
        writer.add_token_types([gguf.TokenType.CONTROL] * len(SPECIALS)
                               + [gguf.TokenType.NORMAL] * (c.vocab_size - len(SPECIALS)))
        writer.add_eos_token_id(SPECIALS.index("<|im_end|>"))
    elif vocab_key:
        writer.add_vocab_size(c.vocab_size)
    if arch == "gemma3":
        writer.add_sliding_window(c.sliding_window)
        writer.add_sliding_window_pattern([k == "local" for k in c.layer_kinds])
        writer.add_rope_freq_base_swa(c.rope_local_theta)
    if extra is not None:
        extra(writer)
    for name, w in flat_weights(model).items():
        if arch == "gemma3" and name.endswith("norm.scale"):
            w = w + np.float32(1.0)
        if name == "embed":
            g = gguf.TENSOR_NAMES[_T.TOKEN_EMBD] + ".weight"
        elif name == "norm.scale":
            g = gguf.TENSOR_NAMES[_T.OUTPUT_NORM] + ".weight"
        elif name == "lm_head":
            g, w = gguf.TENSOR_NAMES[_T.OUTPUT] + ".weight", w.T
        else:
            _, idx, rest = name.split(".", 2)
            g = f"blk.{idx}.{_GGUF_LAYER[rest]}"
            w = w.T if w.ndim == 2 else w
            if arch == "llama" and permute and rest in ("attn.wq", "attn.wk"):
                w = llama_cpp_permute(w, c.num_heads if rest == "attn.wq" else c.num_kv_heads)
        w = np.ascontiguousarray(w, np.float32)
        if w.ndim == 1 or qtype == "F32":
            writer.add_tensor(g, w)
        elif qtype == "F16":
            writer.add_tensor(g, w.astype(np.float16))
        else:
            q = GGMLQuantizationType[qtype]
            writer.add_tensor(g, gguf.quants.quantize(w, q), raw_dtype=q)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def load_gguf(path) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    reader = gguf_loader.open_reader(path)
    config = gguf_loader.config_from_gguf(reader, name="src")
    return config, gguf_loader.weights_from_gguf(reader, config)


@pytest.mark.parametrize("name, arch", [("llama", "llama"), ("llama-untied", "llama"), ("qwen2", "qwen2"),
                                        ("qwen3", "qwen3"), ("gemma3", "gemma3")])
def test_gguf_round_trip_f32(tmp_path, sources, source_logits, name, arch):
    """F32 tensors come back bit-exact, q/k un-permuted, and the model gives the source's logits."""
    src = sources[name]
    path = write_gguf(tmp_path / "src.gguf", src, arch=arch)
    lm = loader.load(str(path))
    _assert_same_config(lm.config, src.config)
    loaded, want = flat_weights(lm.model), flat_weights(src)
    assert loaded.keys() == want.keys()
    for k in want:  # Gemma's norms come back from 1 + w: equal to float32 rounding
        np.testing.assert_allclose(loaded[k], want[k], rtol=0, atol=1e-6 if arch == "gemma3" else 0, err_msg=k)
    ref = source_logits[name]
    np.testing.assert_allclose(logits(lm.model), ref, rtol=0, atol=2e-6 * max(5.0, np.abs(ref).max()))
    assert lm.tokenizer.eos_id in lm.tokenizer.stop_ids and lm.tokenizer.encode("abc") == [3, 4, 5]


def test_gguf_without_permutation_differs(tmp_path, sources, source_logits):
    """The un-permutation matters: an unpermuted llama file loads to different logits."""
    src = sources["llama"]
    config, weights = load_gguf(write_gguf(tmp_path / "src.gguf", src, permute=False, tokenizer=False))
    assert np.abs(logits(loader.model_from_weights(config, weights)) - source_logits["llama"]).max() > 1e-2


def test_gguf_vocab_from_embedding_without_tokenizer(tmp_path, sources):
    path = write_gguf(tmp_path / "src.gguf", sources["llama"], tokenizer=False, vocab_key=False)
    config = gguf_loader.config_from_gguf(gguf_loader.open_reader(path))
    assert config.vocab_size == 64


def test_gguf_f16(tmp_path, sources, source_logits):
    src = sources["llama-untied"]
    config, weights = load_gguf(write_gguf(tmp_path / "src.gguf", src, qtype="F16", tokenizer=False))
    for k, w in flat_weights(src).items():
        want = w.astype(np.float16).astype(np.float32) if w.ndim == 2 else w
        np.testing.assert_array_equal(weights[k], want, err_msg=k)
    out = logits(loader.model_from_weights(config, weights))
    ref = source_logits["llama-untied"]
    np.testing.assert_allclose(out, ref, rtol=0, atol=2e-3 * np.abs(ref).max())


def test_gguf_q8_0(tmp_path, sources, source_logits):
    src = sources["qwen2"]
    path = write_gguf(tmp_path / "src.gguf", src, arch="qwen2", qtype="Q8_0", tokenizer=False)
    config, weights = load_gguf(path)
    for k, w in flat_weights(src).items():
        # Q8_0: blocks of 32 along the input dim, one scale = max|block| / 127; error <= scale / 2
        # (plus the scale's own f16 rounding)
        if w.ndim == 2:
            torch_layout = w if k in ("embed",) else w.T
            scale = np.abs(torch_layout.reshape(torch_layout.shape[0], -1, 32)).max(-1, keepdims=True) / 127
            err = np.abs(weights[k] - w)
            err = err if k == "embed" else err.T
            assert np.all(err.reshape(scale.shape[0], -1, 32) <= scale * 0.6 + 1e-6), k
            assert np.abs(weights[k] - w).max() > 0, k  # really quantized
        else:
            np.testing.assert_array_equal(weights[k], w, err_msg=k)
    out = logits(loader.model_from_weights(config, weights))
    ref = source_logits["qwen2"]
    np.testing.assert_allclose(out, ref, rtol=0, atol=2e-2 * np.abs(ref).max())
    assert np.mean(out.argmax(-1) == ref.argmax(-1)) > 0.9


# ---- GGUF errors -------------------------------------------------------------------------------


def test_gguf_truncated(tmp_path, sources):
    path = write_gguf(tmp_path / "src.gguf", sources["llama"])
    data = path.read_bytes()
    for cut in (len(data) // 2, 64, 3):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(GGUFError, match="truncated or malformed"):
            load_gguf(bad)
        with pytest.raises(GGUFError, match=f"{bad.name}.*truncated"):
            loader.load(str(bad))


def test_gguf_missing_file(tmp_path):
    with pytest.raises(GGUFError, match="does not exist"):
        gguf_loader.open_reader(tmp_path / "nope.gguf")


@pytest.mark.parametrize("dtype", ["F64", "IQ2_XXS"])
def test_gguf_unsupported_quantization(tmp_path, dtype):
    writer = gguf.GGUFWriter(str(tmp_path / "q.gguf"), "llama")
    if dtype == "F64":
        writer.add_tensor("token_embd.weight", np.ones((64, 32), np.float64))
    else:  # raw blocks: 66 bytes per 256 weights
        blocks = np.zeros((64, 66), np.uint8)
        writer.add_tensor("token_embd.weight", blocks, raw_dtype=GGMLQuantizationType.IQ2_XXS)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reader = gguf_loader.open_reader(tmp_path / "q.gguf")
    with pytest.raises(GGUFError, match=f"'token_embd.weight' uses quantization type {dtype}.*supported: F32.*"
                                         "Re-export"):
        gguf_loader.weights_from_gguf(reader, CONFIGS["llama"])


def test_gguf_supported_types_are_checked(tmp_path, sources, monkeypatch):
    """The check reads the tensor's real type: dropping F16 from the list rejects an F16 file."""
    path = write_gguf(tmp_path / "src.gguf", sources["llama"], qtype="F16", tokenizer=False)
    without_f16 = tuple(t for t in gguf_loader.SUPPORTED_TYPES if t != "F16")
    monkeypatch.setattr(gguf_loader, "SUPPORTED_TYPES", without_f16)
    with pytest.raises(GGUFError, match="quantization type F16"):
        load_gguf(path)


def test_gguf_block_type_that_cannot_stay_packed(tmp_path, sources, monkeypatch):
    """Asked for packed (strict), a tensor whose block type cannot stay packed is refused by name; the
    loader's default mode (strict=False) dequantizes it to what the dequantized load reads."""
    path = write_gguf(tmp_path / "src.gguf", sources["qwen2"], arch="qwen2", qtype="Q8_0", tokenizer=False)
    reader = gguf_loader.open_reader(path)
    config = gguf_loader.config_from_gguf(reader, name="src")
    ref = gguf_loader.weights_from_gguf(reader, config)
    monkeypatch.delitem(quant.BLOCKS, "Q8_0")  # as if Q8_0 were a type the kernel does not read
    with pytest.raises(quant.UnsupportedBlockType, match="is Q8_0, which cannot be kept packed"):
        gguf_loader.weights_from_gguf(reader, config, packed=True)
    got = gguf_loader.weights_from_gguf(reader, config, packed=True, strict=False)
    assert set(got) == set(ref) and not any(isinstance(w, quant.PackedWeight) for w in got.values())
    for key in ref:
        np.testing.assert_array_equal(got[key], ref[key])


def test_gguf_unknown_architecture(tmp_path, sources):
    path = write_gguf(tmp_path / "src.gguf", sources["llama"], arch="mamba", tokenizer=False)
    with pytest.raises(GGUFError, match="architecture 'mamba' is not supported.*llama"):
        gguf_loader.config_from_gguf(gguf_loader.open_reader(path))


def _with_tensor(path, name, shape=(8,)):
    """A copy of GGUF `path` with one more F32 tensor `name`."""
    reader = gguf_loader.open_reader(path)
    out = path.with_name("extra.gguf")
    writer = gguf.GGUFWriter(str(out), reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith(("GGUF.", "general.architecture")):
            continue
        value = field.contents()
        types = field.types
        if types[0] == gguf.GGUFValueType.ARRAY:
            writer.add_array(key, value)
        else:
            writer.add_key_value(key, value, types[0])
    for t in reader.tensors:
        writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    writer.add_tensor(name, np.ones(shape, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.mark.parametrize("extra", ["blk.0.attn_q_norm.weight", "blk.0.ffn_gate_inp.weight", "blk.7.attn_norm.weight",
                                   "rope_factors_long.weight"])
def test_gguf_unknown_tensor_is_named(tmp_path, sources, extra):
    """A tensor the model has no place for (a q/k norm in a llama file, a MoE router, a layer past
    the block count) is refused by name; nothing is half-loaded."""
    path = _with_tensor(write_gguf(tmp_path / "src.gguf", sources["llama"], tokenizer=False), extra)
    with pytest.raises(GGUFError, match=f"tensor '{extra}' has no place in specjax's llama model"):
        load_gguf(path)


@pytest.mark.parametrize("arch, key, match", [
    ("llama", "llama.attention.sliding_window", "sliding window in a 'llama' GGUF is not supported"),
    ("qwen3", "qwen3.attention.sliding_window", "sliding-window qwen3 GGUF is not supported"),
])
def test_gguf_sliding_window_it_cannot_place_is_refused(tmp_path, sources, arch, key, match):
    path = write_gguf(tmp_path / "src.gguf", sources["qwen3" if arch == "qwen3" else "llama"], arch=arch,
                      tokenizer=False, extra=lambda w: w.add_uint32(key, 16))
    with pytest.raises(GGUFError, match=match):
        gguf_loader.config_from_gguf(gguf_loader.open_reader(path))


@pytest.mark.parametrize("extra, match", [
    ("model.layers.0.self_attn.q_norm.weight", "tensor 'model.layers.0.self_attn.q_norm.weight' has no place"),
    ("model.layers.2.mlp.up_proj.weight", "tensor 'model.layers.2.mlp.up_proj.weight' has no place"),
    ("model.layers.0.self_attn.o_proj.bias", "tensor 'model.layers.0.self_attn.o_proj.bias' has no place"),
    ("model.layers.0.self_attn.q_proj.bias", r"parameters the llama model with this config does not "
                                             r"\(\['layers.0.attn.bq'\]\)"),
])
def test_hf_unknown_tensor_is_named(tmp_path, sources, extra, match):
    """A Llama directory with a tensor its config gives no place (a q/k norm, a layer past the
    count, an o_proj bias, a q bias without attention_bias) is refused by name."""
    from safetensors.numpy import load_file

    path = write_hf_dir(tmp_path / "src", sources["llama"], "LlamaForCausalLM")
    tensors = load_file(str(path / "model.safetensors"))
    save_file({**tensors, extra: np.ones((32,), np.float32)}, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=match):
        loader.load(str(path))


@pytest.mark.parametrize("change, match", [
    (dict(layer_types=["sliding_attention", "chunked_attention"], sliding_window=4),
     "layer type 'chunked_attention' is not supported"),
    (dict(layer_types=["sliding_attention", "full_attention"]), "names sliding layers but sliding_window is None"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope scaling 'yarn' is not supported"),
])
def test_hf_config_it_cannot_honour_is_refused(tmp_path, sources, change, match):
    path = write_hf_dir(tmp_path / "src", sources["qwen2"], "Qwen2ForCausalLM")
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(ValueError, match=match):
        hf_loader.config_from_hf(path)


def test_config_options_are_enums_refused_in_one_line():
    base = dict(vocab_size=64, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, ffn_dim=64)
    with pytest.raises(ValueError, match="rope scaling 'yarn' is not supported; supported: 'linear', 'llama3'"):
        ModelConfig(**base, rope_scaling={"kind": "yarn"})
    with pytest.raises(ValueError, match="MLP activation 'relu' is not supported"):
        ModelConfig(**base, mlp_activation="relu")
    with pytest.raises(ValueError, match="attention kind 'chunked' is not supported"):
        ModelConfig(**base, layer_kinds=("chunked", "global"))
    with pytest.raises(ValueError, match="local .sliding-window. layers need sliding_window"):
        ModelConfig(**base, layer_kinds=("local", "global"))
    with pytest.raises(ValueError, match="layer_kinds has 1 entries for 2 layers"):
        ModelConfig(**base, layer_kinds=("global",))


# ---- model_from_weights and names --------------------------------------------------------------


def test_model_from_weights_missing_parameter(sources):
    src = sources["llama"]
    weights = flat_weights(src)
    del weights["layers.1.mlp.w_up"]
    with pytest.raises(ValueError, match=r"lacks parameters \['layers.1.mlp.w_up'\]"):
        loader.model_from_weights(src.config, weights)


def test_model_from_weights_wrong_shape(sources):
    src = sources["llama"]
    weights = flat_weights(src)
    weights["layers.0.attn.wq"] = weights["layers.0.attn.wq"].T[:, :16]
    with pytest.raises(ValueError, match=r"layers.0.attn.wq: checkpoint shape \(32, 16\), model expects "
                                         r"\(32, 32\)"):
        loader.model_from_weights(src.config, weights)


def test_model_from_weights_casts_to_param_dtype(sources):
    src = sources["llama"]
    config = dataclasses.replace(src.config, param_dtype="bfloat16")
    model = loader.model_from_weights(config, flat_weights(src))
    assert {x.dtype for x in jax.tree.leaves(nnx.state(model, nnx.Param))} == {jnp.dtype(jnp.bfloat16)}


def test_unknown_model_name():
    with pytest.raises(catalog.ModelNotFoundError, match="unknown model 'no-such-model'.*smollm2-135m"):
        loader.load("no-such-model")
