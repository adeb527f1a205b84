"""Reads GGUF checkpoints of any registered family (llama, qwen2, qwen3, gemma3) with the `gguf` package.

Weights are dequantized to numpy float32 in our layout (`x @ W`, so `[in, out]`) by the `gguf`
package's numpy dequantizers, or (`packed=True`) the quantized projections are kept as the file's
blocks (`specjax.models.quant.PackedWeight`, `[N, K]` rows) and dequantized in the graph. The shapes every family shares are read here; the family
(`specjax.models.families`, found by `general.architecture`) reads its own options, names its
block's tensors and undoes how llama.cpp's converter stored them (Llama's q/k rows permuted for its
interleaved RoPE, Gemma's norms as `1 + w`). Every tensor of the file must be one the model has: an
unknown one is an error naming it, never a silent skip.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from specjax.models import families, quant
from specjax.models.config import ROPE_SCALING_KINDS, ModelConfig, RopeKind, RopeScaling

SUPPORTED_TYPES = (
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
)
ROPE_FREQS = "rope_freqs.weight"  # llama3 rope scaling, read into the config (`rope_scaling_from_gguf`)


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
    freqs = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
    if freqs is None:
        return None if factor == 1.0 else RopeScaling(kind=RopeKind.LINEAR, factor=factor)
    divisors = _dequantize(freqs).reshape(-1)
    if divisors.size != head_dim // 2:
        raise GGUFError(f"rope_freqs.weight has {divisors.size} entries; head_dim={head_dim} needs "
                        f"{head_dim // 2}: the file is not a consistent model")
    return RopeScaling(kind=RopeKind.ROPE_FREQS, divisors=tuple(float(d) for d in divisors * np.float32(factor)))


def config_from_gguf(reader, *, name: str = "custom", **overrides) -> ModelConfig:
    """Builds a `ModelConfig` from GGUF metadata (the family by `general.architecture`)."""
    arch = _field(reader, "general.architecture")
    try:
        family = families.for_gguf(arch)
    except ValueError as e:
        raise GGUFError(str(e)) from None
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
        family=family.name,
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
    try:
        kw.update(family.gguf_options(get, arch, tensors))
    except ValueError as e:
        raise GGUFError(str(e)) from None
    kw.update(overrides)
    return ModelConfig(**kw)


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


DENSE_TYPES = ("F32", "F16", "BF16")  # read as fp32 whether or not the quantized ones stay packed


def weights_from_gguf(reader, config: ModelConfig, *, progress=None, packed: bool = False,
                      strict: bool = True) -> dict[str, Any]:
    """Returns `{flat param path: float32 array}` in our layout (see `specjax.models.transformer`).

    `packed`: every quantized projection and a quantized embedding come as a `quant.PackedWeight` of
    the file's bytes instead (`[N, K]` rows, whatever `config.weight_layout`; the embedding `[V, D]`);
    F32/F16/BF16 ones as fp32. `strict=False`: a tensor in a block type that cannot stay packed is
    dequantized instead of refused (the loader's default mode, which the user did not ask for).

    Raises:
      GGUFError: a tensor the model has no place for (named), or one that cannot be dequantized.
      quant.UnsupportedBlockType: `packed` and a projection in a block type that cannot stay packed.
    """
    arch = _field(reader, "general.architecture")
    family = families.get(config.family)
    names = family.gguf_layer_names
    out: dict[str, np.ndarray] = {}
    for tensor in progress(reader.tensors) if progress else reader.tensors:
        name = tensor.name
        if name == ROPE_FREQS:
            continue  # read into config.rope_scaling (`rope_scaling_from_gguf`)
        key = _param_name(name, names, config)
        if key is None:
            raise GGUFError(f"tensor {name!r} has no place in specjax's {config.family} model "
                            f"({config.num_layers} layers; a bias, norm or layer this family does not have?): "
                            "this checkpoint variant is not supported")
        qtype = tensor.tensor_type.name
        if packed and len(tensor.shape) == 2 and qtype not in DENSE_TYPES and (strict or qtype in quant.BLOCKS):
            if qtype not in quant.BLOCKS:
                raise quant.UnsupportedBlockType(
                    f"tensor {name!r} is {qtype}, which cannot be kept packed (packed types: "
                    f"{', '.join(quant.PACKED_TYPES)}); load with weights='dequantized' to read it as fp32")
            k, n = (int(d) for d in tensor.shape)
            # the family's fix-ups of a projection reorder whole rows (llama's q/k), so they apply to
            # rows of blocks as to rows of weights
            rows = family.gguf_tensor(name, np.asarray(tensor.data, dtype=np.uint8).reshape(n, -1), config, arch)
            if key == "embed":  # token rows, the vocabulary's (a file may pad it)
                rows, n = rows[: config.vocab_size], min(n, config.vocab_size)
            out[key] = quant.PackedWeight(np.ascontiguousarray(rows), qtype, (n, k))
            continue
        w = family.gguf_tensor(name, _dequantize(tensor), config, arch)
        if key == "embed":
            w = w[: config.vocab_size]
        out[key] = w.T if w.ndim == 2 and key != "embed" else w
    return out


def _param_name(name: str, names: dict[str, str], config: ModelConfig) -> str | None:
    """Our flat parameter path of GGUF tensor `name`, or None."""
    top = {"token_embd.weight": "embed", "output_norm.weight": "norm.scale", "output.weight": "lm_head"}
    if name in top:
        return top[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and int(parts[1]) < config.num_layers \
            and parts[2] in names:
        return f"layers.{parts[1]}.{names[parts[2]]}"
    return None
