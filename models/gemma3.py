"""The Gemma 3 family (text): four `x * (1 + w)` RMSNorms per block, q/k norm, GELU-tanh gated MLP,
embeddings scaled by `sqrt(D)`, scores by `query_pre_attn_scalar ** -0.5`, sliding-window layers
(rope base 10k) between global ones (rope base 1M, scaled), a tied head.

The block over the shared layers, and how its checkpoints name things: HF `Gemma3ForCausalLM`
(`model_type` "gemma3_text") and GGUF `gemma3`, which llama.cpp's converter writes with every norm
stored as `1 + w` and without the layer pattern (llama.cpp's gemma3: one global layer in six).
"""

from __future__ import annotations

import numpy as np
from flax import nnx
from jaxtyping import Array, Float

from specjax.models import cpu_attention, hf_config
from specjax.models.config import Activation, AttnKind, ModelConfig
from specjax.models.kv_cache import Access
from specjax.models.layers.attention import Attention
from specjax.models.layers.mlp import MLP
from specjax.models.layers.norms import RMSNorm
from specjax.models.transformer import Transformer

PATTERN = 6  # llama.cpp's and HF's default: layers 6, 12, ... (1-based) global, the rest sliding
LOCAL_THETA = 10_000.0  # the sliding layers' rope base where a checkpoint does not say


class Block(nnx.Module):
    """`x + post_attn_norm(attn(attn_norm(x)))`, then `x + post_mlp_norm(mlp(mlp_norm(x)))`."""

    def __init__(self, config: ModelConfig, layer: int, rngs: nnx.Rngs):
        c, wd = config, config.weight_dtype
        norm = lambda: RMSNorm(c.dim, c.norm_eps, wd, offset=c.norm_offset)  # noqa: E731
        self.attn_norm, self.post_attn_norm = norm(), norm()
        self.attn = Attention(c, rngs, c.kind(layer))
        self.mlp_norm, self.post_mlp_norm = norm(), norm()
        self.mlp = MLP(c, rngs)

    def __call__(self, x: Float[Array, "B T D"], access: Access, k_buf: Float[Array, "B S Kv H"],
                 v_buf: Float[Array, "B S Kv H"]) -> tuple[Float[Array, "B T D"], Float[Array, "B S Kv H"],
                                                           Float[Array, "B S Kv H"]]:
        h, k_buf, v_buf = self.attn(self.attn_norm(x), access, k_buf, v_buf)
        x = cpu_attention.residual(x, self.post_attn_norm(h))
        return cpu_attention.residual(x, self.post_mlp_norm(self.mlp(self.mlp_norm(x)))), k_buf, v_buf


class Gemma3(Transformer):
    Block = Block


# the options every Gemma 3 has (HF's and llama.cpp's implementations hard-code them)
OPTIONS = dict(qk_norm=True, norm_offset=1.0, mlp_activation=Activation.GELU_TANH,
               embed_scale=True, qkv_bias=False)


def layer_kinds(num_layers: int, period: int = PATTERN) -> tuple[AttnKind, ...]:
    """Every `period`-th layer (1-based) global, the others sliding."""
    return tuple(AttnKind.GLOBAL if (i + 1) % period == 0 else AttnKind.LOCAL for i in range(num_layers))


# ---- checkpoints ---------------------------------------------------------------------------------

HF_ARCHITECTURES = ("Gemma3ForCausalLM",)
GGUF_ARCHITECTURES = ("gemma3",)

HF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.scale",
    "post_attention_layernorm.weight": "post_attn_norm.scale",
    "pre_feedforward_layernorm.weight": "mlp_norm.scale",
    "post_feedforward_layernorm.weight": "post_mlp_norm.scale",
    "self_attn.q_proj.weight": "attn.wq", "self_attn.k_proj.weight": "attn.wk",
    "self_attn.v_proj.weight": "attn.wv", "self_attn.o_proj.weight": "attn.wo",
    "self_attn.q_norm.weight": "attn.q_norm.scale", "self_attn.k_norm.weight": "attn.k_norm.scale",
    "mlp.gate_proj.weight": "mlp.w_gate", "mlp.up_proj.weight": "mlp.w_up",
    "mlp.down_proj.weight": "mlp.w_down",
}
GGUF_LAYER_NAMES = {
    "attn_norm.weight": "attn_norm.scale",
    "post_attention_norm.weight": "post_attn_norm.scale",
    "ffn_norm.weight": "mlp_norm.scale",
    "post_ffw_norm.weight": "post_mlp_norm.scale",
    "attn_q.weight": "attn.wq", "attn_k.weight": "attn.wk", "attn_v.weight": "attn.wv",
    "attn_output.weight": "attn.wo",
    "attn_q_norm.weight": "attn.q_norm.scale", "attn_k_norm.weight": "attn.k_norm.scale",
    "ffn_gate.weight": "mlp.w_gate", "ffn_up.weight": "mlp.w_up", "ffn_down.weight": "mlp.w_down",
}


def hf_options(c: dict, arch: str, where: str) -> dict:
    """Gemma 3's options from `config.json`: the per-layer-type rope, the window and which layers
    slide, the query scalar; softcapping and bidirectional attention are refused."""
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if c.get(key) is not None:
            raise ValueError(f"{where}: {key}={c[key]} is not supported (Gemma 3 has none; Gemma 2 does)")
    if c.get("use_bidirectional_attention"):
        raise ValueError(f"{where}: use_bidirectional_attention (an embedding model) is not supported")
    act = c.get("hidden_activation") or c.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"{where}: hidden_activation {act!r} is not supported; Gemma 3 uses 'gelu_pytorch_tanh'")
    period = int(c.get("sliding_window_pattern") or PATTERN)
    kinds = hf_config.layer_kinds(c, where, c.get("sliding_window"), lambda i: (i + 1) % period != 0)
    glob, local = _hf_rope(c, where)
    return dict(OPTIONS, **kinds, **glob, rope_local_theta=local,
                query_pre_attn_scalar=float(c.get("query_pre_attn_scalar") or 256))


def _hf_rope(c: dict, where: str) -> tuple[dict, float]:
    """(global rope fields, the local rope base) of `rope_parameters` per layer type (transformers
    >= 5) or the older `rope_theta` / `rope_local_base_freq` / `rope_scaling` (global only)."""
    params = c.get("rope_parameters")
    if isinstance(params, dict) and set(params) & {"full_attention", "sliding_attention"}:
        full = dict(params.get("full_attention") or {})
        local = dict(params.get("sliding_attention") or {})
        if (local.get("rope_type") or "default") != "default":
            raise ValueError(f"{where}: rope scaling {local['rope_type']!r} on the sliding layers is not supported")
        theta, scaling = hf_config.rope_from_hf({"rope_parameters": full, "rope_theta": 1_000_000.0}, where)
        return dict(rope_theta=theta, rope_scaling=scaling), float(local.get("rope_theta") or LOCAL_THETA)
    theta, scaling = hf_config.rope_from_hf({"rope_theta": 1_000_000.0, **c}, where)
    return dict(rope_theta=theta, rope_scaling=scaling), float(c.get("rope_local_base_freq") or LOCAL_THETA)


def gguf_options(get, arch: str, tensors: set[str]) -> dict:
    """llama.cpp's gemma3 hyper-parameters: the window, one global layer in six (or the file's
    `attention.sliding_window_pattern`), local rope base 10k (or `rope.freq_base_swa`), and its query
    scale (`n_embd / n_head` for the 27B, 62 layers; the head dim otherwise)."""
    n = int(get("block_count"))
    window = get("attention.sliding_window")
    if window is None:
        raise ValueError(f"{arch}.attention.sliding_window is missing: the file is not a complete gemma3")
    pattern = get("attention.sliding_window_pattern", PATTERN)
    if isinstance(pattern, list):  # one flag per layer: true for a sliding layer
        if len(pattern) != n:
            raise ValueError(f"{arch}.attention.sliding_window_pattern has {len(pattern)} entries for {n} layers")
        kinds = tuple(AttnKind.LOCAL if p else AttnKind.GLOBAL for p in pattern)
    else:
        kinds = layer_kinds(n, int(pattern))
    dim, heads = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", dim // heads))
    return dict(OPTIONS, layer_kinds=kinds, sliding_window=int(window),
                rope_local_theta=float(get("rope.freq_base_swa", LOCAL_THETA)),
                query_pre_attn_scalar=float(dim // heads if n == 62 else head_dim))


def gguf_tensor(name: str, w: np.ndarray, config: ModelConfig, arch: str) -> np.ndarray:
    """llama.cpp stores every Gemma norm weight as `1 + w`; the model's norm adds the 1 itself."""
    return w - np.float32(1.0) if name.endswith("norm.weight") else w
