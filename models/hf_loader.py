"""Reads HF-format checkpoint directories: config.json + *.safetensors (Llama, Qwen2)."""

from __future__ import annotations

import json
import pathlib

import numpy as np

from specjax.models.config import ROPE_SCALING_KINDS, ModelConfig, RopeScaling

_ARCHS = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")

_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.scale",
    "post_attention_layernorm.weight": "mlp_norm.scale",
    "self_attn.q_proj.weight": "attn.wq", "self_attn.k_proj.weight": "attn.wk",
    "self_attn.v_proj.weight": "attn.wv", "self_attn.o_proj.weight": "attn.wo",
    "self_attn.q_proj.bias": "attn.bq", "self_attn.k_proj.bias": "attn.bk",
    "self_attn.v_proj.bias": "attn.bv",
    "mlp.gate_proj.weight": "mlp.w_gate", "mlp.up_proj.weight": "mlp.w_up",
    "mlp.down_proj.weight": "mlp.w_down",
}


def rope_from_hf(c: dict, where: str = "config.json") -> tuple[float, RopeScaling | None]:
    """(rope_theta, rope scaling) of an HF config dict, read as transformers reads it.

    The parameters sit under `rope_scaling` (transformers < 5; it wins when both are there, as in
    transformers) or `rope_parameters` (>= 5), their kind under `rope_type` or the legacy `type`;
    "default" or none is no scaling. A kind other than "llama3" or "linear" raises one line.
    """
    params = c.get("rope_scaling") or c.get("rope_parameters") or {}
    if not isinstance(params, dict) or any(isinstance(v, dict) for v in params.values()):
        raise ValueError(f"{where}: per-layer rope parameters {params!r} are not supported; "
                         "specjax reads one rope_scaling dict")
    theta = float(params.get("rope_theta") or c.get("rope_theta") or 10_000.0)
    kind = params.get("rope_type", params.get("type")) or "default"
    if float(params.get("partial_rotary_factor", c.get("partial_rotary_factor") or 1.0)) != 1.0:
        raise ValueError(f"{where}: partial_rotary_factor != 1 (RoPE on part of each head) is not supported")
    if kind == "default":
        return theta, None
    if kind not in ROPE_SCALING_KINDS:
        raise ValueError(f"{where}: rope scaling {kind!r} is not supported; supported: "
                         f"{', '.join(map(repr, ROPE_SCALING_KINDS))} or none (rope_type 'default')")
    need = ("factor",) if kind == "linear" else ("factor", "low_freq_factor", "high_freq_factor")
    missing = [k for k in need if params.get(k) is None]
    if missing:
        raise ValueError(f"{where}: rope scaling {kind!r} lacks {', '.join(missing)}")
    if kind == "linear":
        return theta, RopeScaling(kind="linear", factor=float(params["factor"]))
    # as transformers' standardize_rope_params: a top-level original_max_position_embeddings wins
    original = (c.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
                or c.get("max_position_embeddings", 8192))
    return theta, RopeScaling(kind="llama3", factor=float(params["factor"]),
                              low_freq_factor=float(params["low_freq_factor"]),
                              high_freq_factor=float(params["high_freq_factor"]), original_context=int(original))


def config_from_hf(path: str | pathlib.Path, *, name: str = "custom", **overrides) -> ModelConfig:
    """Builds a `ModelConfig` from an HF `config.json`."""
    path = pathlib.Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"{str(path)!r} has no config.json; an HF model directory needs "
                         "config.json and *.safetensors")
    c = json.loads(cfg_file.read_text())
    archs = c.get("architectures") or []
    if archs and not set(archs) & set(_ARCHS):
        raise ValueError(f"HF architecture {archs} is not supported; supported: {_ARCHS}")
    heads = c["num_attention_heads"]
    rope_theta, rope_scaling = rope_from_hf(c, str(cfg_file))
    kw = dict(
        name=name,
        vocab_size=c["vocab_size"],
        dim=c["hidden_size"],
        num_layers=c["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=c.get("num_key_value_heads", heads),
        head_dim=c.get("head_dim") or c["hidden_size"] // heads,
        ffn_dim=c["intermediate_size"],
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        norm_eps=float(c.get("rms_norm_eps", 1e-5)),
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        qkv_bias=bool(c.get("attention_bias", "Qwen2ForCausalLM" in archs)),
        max_seq_len=int(c.get("max_position_embeddings", 8192)),
    )
    kw.update(overrides)
    return ModelConfig(**kw)


def weights_from_hf(path: str | pathlib.Path, config: ModelConfig) -> dict[str, np.ndarray]:
    """Returns `{flat param path: float32 array}` from the directory's safetensors files."""
    from safetensors.flax import load_file  # handles bf16, unlike the numpy reader

    files = sorted(pathlib.Path(path).glob("*.safetensors"))
    if not files:
        raise ValueError(f"{str(path)!r} has no *.safetensors files")
    out: dict[str, np.ndarray] = {}
    for f in files:
        for name, w in load_file(f).items():
            w = np.asarray(w, dtype=np.float32)
            if name == "model.embed_tokens.weight":
                out["embed"] = w
            elif name == "model.norm.weight":
                out["norm.scale"] = w
            elif name == "lm_head.weight":
                if not config.tie_embeddings:
                    out["lm_head"] = w.T
            elif name.startswith("model.layers."):
                _, _, idx, rest = name.split(".", 3)
                if rest not in _LAYER_NAMES:
                    raise ValueError(
                        f"{name}: specjax's Llama has no such parameter (an o_proj or MLP bias?); "
                        "this checkpoint variant is not supported")
                out[f"layers.{idx}.{_LAYER_NAMES[rest]}"] = w.T if w.ndim == 2 else w
    return out
