"""The Qwen3 family: Llama's block with an RMSNorm over each head's q and k (before rope), no qkv bias.

Its block is the Llama block (`specjax.models.llama.Block`) with the `qk_norm` option: the shared
attention layer holds the norms. Checkpoints: HF `Qwen3ForCausalLM`, GGUF `qwen3`.
"""

from __future__ import annotations

from specjax.models import hf_config, llama
from specjax.models.transformer import Transformer


class Qwen3(Transformer):
    Block = llama.Block


HF_ARCHITECTURES = ("Qwen3ForCausalLM",)
GGUF_ARCHITECTURES = ("qwen3",)
HF_LAYER_NAMES = {**llama.HF_LAYER_NAMES,
                  "self_attn.q_norm.weight": "attn.q_norm.scale", "self_attn.k_norm.weight": "attn.k_norm.scale"}
GGUF_LAYER_NAMES = {**llama.GGUF_LAYER_NAMES,
                    "attn_q_norm.weight": "attn.q_norm.scale", "attn_k_norm.weight": "attn.k_norm.scale"}


def hf_options(c: dict, arch: str, where: str) -> dict:
    """q/k norm, rope, bias (none unless `attention_bias`), the sliding window as Qwen2's."""
    theta, scaling = hf_config.rope_from_hf(c, where)
    return dict(qk_norm=True, qkv_bias=bool(c.get("attention_bias", False)), rope_theta=theta,
                rope_scaling=scaling, **hf_config.qwen_layer_kinds(c, where))


def gguf_options(get, arch: str, tensors: set[str]) -> dict:
    if get("attention.sliding_window") is not None:  # llama.cpp's qwen3 has no sliding layers
        raise ValueError(f"{arch}.attention.sliding_window is set: a sliding-window qwen3 GGUF is not supported")
    return dict(qk_norm=True)
