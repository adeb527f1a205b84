"""Reads Llama-family GGUF checkpoints (llama, qwen2) with the `gguf` package.

Weights are dequantized to numpy float32 in our layout (`x @ W`, so `[in, out]`). llama.cpp's
converter permutes the q/k rows of `llama` checkpoints for its interleaved RoPE; they are
permuted back here so the model can use the rotate-half RoPE of the HF reference.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from specjax.models.config import ROPE_SCALING_KINDS, ModelConfig, RopeScaling

SUPPORTED_TYPES = (
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
)
SUPPORTED_ARCHS = ("llama", "qwen2")


class GGUFError(ValueError):
    """A GGUF file that cannot be used, with what is wrong and how to fix it."""


def open_reader(path: str | os.PathLike):
    """Opens a GGUF file; a truncated or malformed file raises `GGUFError`."""
    import gguf

    if not os.path.isfile(path):
        raise GGUFError(f"GGUF file {str(path)!r} does not exist; pass a .gguf path or a registry name")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # the reader raises assorted errors on bad bytes
        raise GGUFError(
            f"{str(path)!r} is not a readable GGUF file ({type(e).__name__}: {e}); it is truncated "
            "or malformed: delete it and fetch it again (registry models re-download on next use)"
        ) from e
    return reader


def _field(reader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def rope_scaling_from_gguf(reader, arch: str, head_dim: int) -> RopeScaling | None:
    """The rope scaling llama.cpp would apply: `{arch}.rope.scaling.*` and the `rope_freqs` tensor.

    llama.cpp's converter writes "llama3" scaling as `rope_freqs` (one divisor per frequency, no
    scaling type) and "linear" as `rope.scaling.type` "linear" + `rope.scaling.factor`. Like
    llama.cpp, a factor without a type is linear, and a linear factor with `rope_freqs` applies both.
    Any other type (yarn, longrope, ...) raises one line.
    """
    get = lambda k, d=None: _field(reader, f"{arch}.{k}", d)
    rope_dims = get("rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != head_dim:
        raise GGUFError(f"{arch}.rope.dimension_count={rope_dims} but head_dim={head_dim}: RoPE on part of "
                        "each head is not supported")
    factor = get("rope.scaling.factor", get("rope.scale_linear"))
    kind = get("rope.scaling.type") or ("linear" if factor is not None else "none")
    if kind not in ("none", "linear"):
        raise GGUFError(f"GGUF rope scaling {kind!r} ({arch}.rope.scaling.type) is not supported; supported: "
                        f"{', '.join(map(repr, ROPE_SCALING_KINDS))} (llama3 as the rope_freqs tensor) or none")
    if kind == "linear" and factor is None:
        raise GGUFError(f"{arch}.rope.scaling.type is 'linear' but {arch}.rope.scaling.factor is missing")
    factor = 1.0 if kind == "none" or not factor else float(factor)  # llama.cpp: 0 means no scaling
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is None:
        return None if factor == 1.0 else RopeScaling(kind="linear", factor=factor)
    divisors = _dequantize(freqs).reshape(-1)
    if divisors.size != head_dim // 2:
        raise GGUFError(f"rope_freqs.weight has {divisors.size} entries; head_dim={head_dim} needs "
                        f"{head_dim // 2}: the file is not a consistent model")
    return RopeScaling(kind="rope_freqs", divisors=tuple(float(d) for d in divisors * np.float32(factor)))


def config_from_gguf(reader, *, name: str = "custom", **overrides) -> ModelConfig:
    """Builds a `ModelConfig` from GGUF metadata."""
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise GGUFError(
            f"GGUF architecture {arch!r} is not supported; supported: {SUPPORTED_ARCHS} "
            "(Llama-family decoders)"
        )
    get = lambda k, d=None: _field(reader, f"{arch}.{k}", d)
    tensors = {t.name for t in reader.tensors}
    num_heads = int(get("attention.head_count"))
    dim = int(get("embedding_length"))
    embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embed is None:
        raise GGUFError("GGUF file has no token_embd.weight tensor; it is not a complete model")
    embed_rows = int(embed.shape[1])
    head_dim = int(get("attention.key_length", dim // num_heads))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = get("vocab_size") or (len(tokens.data) if tokens is not None else embed_rows)
    kw = dict(
        name=name,
        vocab_size=int(max(vocab, embed_rows)),
        dim=dim,
        num_layers=int(get("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(get("attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        ffn_dim=int(get("feed_forward_length")),
        rope_theta=float(get("rope.freq_base", 10_000.0)),
        rope_scaling=rope_scaling_from_gguf(reader, arch, head_dim),
        norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        tie_embeddings="output.weight" not in tensors,
        qkv_bias="blk.0.attn_q.bias" in tensors,
        max_seq_len=int(get("context_length", 8192)),
    )
    kw.update(overrides)
    return ModelConfig(**kw)


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Inverts llama.cpp's q/k row permutation (rows = heads x head_dim, torch `[out, in]`)."""
    rows = w.shape[0]
    half = rows // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _dequantize(tensor) -> np.ndarray:
    from gguf import quants

    qtype = tensor.tensor_type.name
    if qtype not in SUPPORTED_TYPES:
        raise GGUFError(
            f"tensor {tensor.name!r} uses quantization type {qtype}, which specjax does not read; "
            f"supported: {', '.join(SUPPORTED_TYPES)}. Re-export the model with one of them "
            "(e.g. llama.cpp's convert script with --outtype f16)"
        )
    try:
        out = quants.dequantize(tensor.data, tensor.tensor_type)
    except Exception as e:
        raise GGUFError(f"tensor {tensor.name!r} ({qtype}) could not be dequantized: {e}; "
                        "the file is probably truncated: delete it and fetch it again") from e
    return np.asarray(out, dtype=np.float32).reshape(tuple(int(d) for d in reversed(tensor.shape)))


_BLOCK_NAMES = {
    "attn_norm.weight": "attn_norm.scale",
    "ffn_norm.weight": "mlp_norm.scale",
    "attn_q.weight": "attn.wq", "attn_k.weight": "attn.wk", "attn_v.weight": "attn.wv",
    "attn_output.weight": "attn.wo",
    "attn_q.bias": "attn.bq", "attn_k.bias": "attn.bk", "attn_v.bias": "attn.bv",
    "ffn_gate.weight": "mlp.w_gate", "ffn_up.weight": "mlp.w_up", "ffn_down.weight": "mlp.w_down",
}


def weights_from_gguf(reader, config: ModelConfig, *, progress=None) -> dict[str, np.ndarray]:
    """Returns `{flat param path: float32 array}` in our layout (see `llama.Llama`)."""
    arch = _field(reader, "general.architecture")
    out: dict[str, np.ndarray] = {}
    for tensor in progress(reader.tensors) if progress else reader.tensors:
        name = tensor.name
        w = _dequantize(tensor)
        if name == "token_embd.weight":
            out["embed"] = w[: config.vocab_size]
        elif name == "output_norm.weight":
            out["norm.scale"] = w
        elif name == "output.weight":
            out["lm_head"] = w.T
        elif name.startswith("blk."):
            _, idx, rest = name.split(".", 2)
            if int(idx) >= config.num_layers or rest not in _BLOCK_NAMES:
                continue  # e.g. rope_freqs: derived from the config instead
            if arch == "llama" and rest in ("attn_q.weight", "attn_k.weight"):
                w = _unpermute(w, config.num_heads if rest == "attn_q.weight" else config.num_kv_heads)
            out[f"layers.{idx}.{_BLOCK_NAMES[rest]}"] = w.T if w.ndim == 2 else w
    return out
