"""The Llama family (Llama, SmolLM2, Qwen2, Mistral): two norms per block, SiLU-gated MLP, `x * w`
RMSNorm; Qwen2's qkv bias and Mistral's / Qwen2's sliding window are config options.

The family's block over the shared layers (`specjax.models.layers`), and how its checkpoints name
their tensors and options (HF `config.json` + safetensors, GGUF `llama` / `qwen2`). The model
interface itself is `specjax.models.transformer.Transformer`.

Dimension alphabet, the one meaning of each letter in `specjax`'s type hints and einsum strings
(tests/test_names.py fails on a type hint that uses another):
    B batch, T query length, S cache length, N query heads, G query heads per kv head, Kv kv heads,
    H head dim, D model dim, F ffw dim, V vocab, L layers, K draft length (a chain's drafts, a
    tree's nodes);
    W verify window: the pending token and the drafts (K + 1), P prompt bucket, E stop ids per row,
    A accept depth: most drafts one step can keep (a chain's K, a tree's depth), R a kept path's
    window slots (A + 1), M the Medusa heads, Vd a draft vocabulary (a subset of V), Df an EAGLE
    head's feature width (its taps side by side: a multiple of D), Z table slots (an n-gram table's,
    token recycling's second-order table's), Ng n-gram key length, Kf followers an n-gram table
    keeps per key, Kt the target's top candidates kept per scored token (token recycling), Sr a
    sliding-window layer's ring entries (`specjax.models.kv_cache`), Q a row's predicted-output
    buffer (`specjax.methods.predict`), Cs constraint pool slots, Sa a constraint automaton's states,
    Ca its token classes, Kc forced tokens kept per automaton state (`specjax.core.constraint`),
    Lb a row's logit_bias entries (`specjax.core.sampling`), Tl top alternatives recorded per
    generated token (`top_logprobs`, `specjax.core.logprobs`).
Einsum subscripts are single letters: kv heads (Kv) are written C there, the output side of a
square [D, D] weight O, and a vocabulary subset V; lowercase m, n, k are a plain matmul's rows,
columns and contraction (`specjax.models.linear`), outside the alphabet.
"""

from __future__ import annotations

import numpy as np
from flax import nnx
from jaxtyping import Array, Float

from specjax.models import hf_config
from specjax.models.config import ModelConfig
from specjax.models.kv_cache import Access
from specjax.models.layers.attention import Attention
from specjax.models.layers.mlp import MLP
from specjax.models.layers.norms import RMSNorm
from specjax.models.transformer import Output, Transformer

__all__ = ["Block", "Llama", "Output"]


class Block(nnx.Module):
    """`x + attn(norm(x))`, then `x + mlp(norm(x))`."""

    def __init__(self, config: ModelConfig, layer: int, rngs: nnx.Rngs):
        c, wd = config, config.weight_dtype
        self.attn_norm = RMSNorm(c.dim, c.norm_eps, wd, offset=c.norm_offset)
        self.attn = Attention(c, rngs, c.kind(layer))
        self.mlp_norm = RMSNorm(c.dim, c.norm_eps, wd, offset=c.norm_offset)
        self.mlp = MLP(c, rngs)

    def __call__(self, x: Float[Array, "B T D"], access: Access, k_buf: Float[Array, "B S Kv H"],
                 v_buf: Float[Array, "B S Kv H"]) -> tuple[Float[Array, "B T D"], Float[Array, "B S Kv H"],
                                                           Float[Array, "B S Kv H"]]:
        h, k_buf, v_buf = self.attn(self.attn_norm(x), access, k_buf, v_buf)
        x = x + h
        return x + self.mlp(self.mlp_norm(x)), k_buf, v_buf


class Llama(Transformer):
    """Llama, SmolLM2, Qwen2, Mistral."""

    Block = Block


# ---- checkpoints ---------------------------------------------------------------------------------

HF_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
GGUF_ARCHITECTURES = ("llama", "qwen2")

# a block's tensors: HF's name after "model.layers.{i}." and GGUF's after "blk.{i}." -> ours
HF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.scale",
    "post_attention_layernorm.weight": "mlp_norm.scale",
    "self_attn.q_proj.weight": "attn.wq", "self_attn.k_proj.weight": "attn.wk",
    "self_attn.v_proj.weight": "attn.wv", "self_attn.o_proj.weight": "attn.wo",
    "self_attn.q_proj.bias": "attn.bq", "self_attn.k_proj.bias": "attn.bk",
    "self_attn.v_proj.bias": "attn.bv",
    "mlp.gate_proj.weight": "mlp.w_gate", "mlp.up_proj.weight": "mlp.w_up",
    "mlp.down_proj.weight": "mlp.w_down",
}
GGUF_LAYER_NAMES = {
    "attn_norm.weight": "attn_norm.scale",
    "ffn_norm.weight": "mlp_norm.scale",
    "attn_q.weight": "attn.wq", "attn_k.weight": "attn.wk", "attn_v.weight": "attn.wv",
    "attn_output.weight": "attn.wo",
    "attn_q.bias": "attn.bq", "attn_k.bias": "attn.bk", "attn_v.bias": "attn.bv",
    "ffn_gate.weight": "mlp.w_gate", "ffn_up.weight": "mlp.w_up", "ffn_down.weight": "mlp.w_down",
}


def hf_options(c: dict, arch: str, where: str) -> dict:
    """The family's options from an HF `config.json`: rope, Qwen2's bias, the sliding window
    (Mistral's on every layer; Qwen2's with `use_sliding_window` on layers from `max_window_layers`)."""
    theta, scaling = hf_config.rope_from_hf(c, where)
    opts = dict(qkv_bias=bool(c.get("attention_bias", arch == "Qwen2ForCausalLM")), rope_theta=theta,
                rope_scaling=scaling)
    if arch == "MistralForCausalLM":
        opts.update(hf_config.layer_kinds(c, where, c.get("sliding_window"), lambda i: True))
    elif arch == "Qwen2ForCausalLM":
        opts.update(hf_config.qwen_layer_kinds(c, where))
    return opts


def gguf_options(get, arch: str, tensors: set[str]) -> dict:
    """The family's options from GGUF metadata (`get(key, default)` reads `{arch}.{key}`)."""
    window = get("attention.sliding_window")
    if window is not None:  # llama.cpp's llama / qwen2 ignore it: we cannot tell which layers slide
        raise ValueError(f"{arch}.attention.sliding_window={window}: a sliding window in a {arch!r} GGUF is "
                         "not supported (llama.cpp ignores it for this architecture, HF applies it to every "
                         "layer); convert the checkpoint from its HF directory instead")
    return {}


def gguf_tensor(name: str, w: np.ndarray, config: ModelConfig, arch: str) -> np.ndarray:
    """Undoes llama.cpp's q/k row permutation of `llama` checkpoints (for its interleaved RoPE; the
    model's is HF's rotate-half)."""
    if arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
        heads = config.num_heads if name.endswith("attn_q.weight") else config.num_kv_heads
        half = w.shape[0] // heads // 2
        return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    return w
