"""Model configurations: frozen, hashable, with named presets.

Every option a family may set is an explicit field here (norm form, q/k norm, query scalar, MLP
activation, embedding scale, per-layer attention kind, local/global rope); a family module
(`specjax.models.llama`, `gemma3`, `qwen3`) composes the shared layers (`specjax.models.layers`) and
reads them. Dimension alphabet (einsums and type hints): see `specjax.models.llama`.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Any

import jax.numpy as jnp


class RopeKind(enum.StrEnum):
    """How a checkpoint rescales its RoPE frequencies (see `RopeScaling`)."""

    LINEAR = "linear"
    LLAMA3 = "llama3"
    ROPE_FREQS = "rope_freqs"  # GGUF's form of llama3 scaling: one divisor per frequency


ROPE_SCALING_KINDS = (RopeKind.LLAMA3.value, RopeKind.LINEAR.value)  # what a checkpoint may name


class AttnKind(enum.StrEnum):
    """What a layer's queries see: every earlier position, or the last `sliding_window` of them."""

    GLOBAL = "global"
    LOCAL = "local"  # a query at p sees positions p - W + 1 .. p (gemma's LOCAL_SLIDING, HF's sliding_attention)


class Activation(enum.StrEnum):
    """The gate activation of the gated MLP."""

    SILU = "silu"  # Llama, Qwen, Mistral
    GELU_TANH = "gelu_tanh"  # Gemma (HF's gelu_pytorch_tanh)


def _enum(kind: type[enum.StrEnum], value, what: str):
    """`value` as a member of `kind`, or one ValueError naming what is supported."""
    try:
        return kind(value)
    except ValueError:
        raise ValueError(f"{what} {value!r} is not supported; supported: "
                         f"{', '.join(repr(k.value) for k in kind)}") from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """How a checkpoint rescales its RoPE frequencies (`specjax.models.layers.rope.inv_freq` applies it).

    Kinds (each divides the default inverse frequencies `theta ** (-2i / H)`):
      "linear": all of them by `factor` (position interpolation: positions / factor).
      "llama3": Llama 3.1+, as HF's `_compute_llama3_parameters`: wavelengths below
        `original_context / high_freq_factor` kept, above `original_context / low_freq_factor`
        divided by `factor`, smoothly interpolated between.
      "rope_freqs": each by its own entry of `divisors` (H / 2 of them): the `rope_freqs` tensor
        llama.cpp's converter writes into a GGUF for llama3 scaling (llama.cpp divides each angle by it).

    Hashable like the `ModelConfig` that holds it.
    """

    kind: RopeKind
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_context: int = 8192
    divisors: tuple[float, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "kind", _enum(RopeKind, self.kind, "rope scaling"))
        object.__setattr__(self, "divisors", tuple(float(d) for d in self.divisors))
        if not (math.isfinite(self.factor) and self.factor > 0):
            raise ValueError(f"rope scaling {self.kind!r}: factor={self.factor} must be a positive number")
        if self.kind == RopeKind.LLAMA3 and not (0 < self.low_freq_factor < self.high_freq_factor):
            raise ValueError(f"llama3 rope scaling needs 0 < low_freq_factor < high_freq_factor; got "
                             f"{self.low_freq_factor} and {self.high_freq_factor}")
        if self.kind == RopeKind.LLAMA3 and self.original_context < 1:
            raise ValueError(f"llama3 rope scaling: original_context={self.original_context} must be >= 1")
        if self.kind == RopeKind.ROPE_FREQS and not (
                self.divisors and all(math.isfinite(d) and d > 0 for d in self.divisors)):
            raise ValueError("rope scaling 'rope_freqs' needs H / 2 positive finite divisors; got "
                             f"{self.divisors[:8]}{'...' if len(self.divisors) > 8 else ''}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shape, options and numerics of a decoder of one family (`family`: a name registered in
    `specjax.models.families`; the defaults are Llama's).

    Hashable: it is part of the static side of every jitted function. Read back from a JSON manifest
    (`dataclasses.asdict`) it takes strings and lists for the enums and tuples.
    """

    name: str = "custom"
    family: str = "llama"
    vocab_size: int
    dim: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_dim: int
    rope_theta: float = 10_000.0  # the global layers' rope base
    rope_scaling: RopeScaling | None = None  # the global layers' (None: the plain frequencies)
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    qkv_bias: bool = False
    max_seq_len: int = 8192
    dtype: str = "float32"  # compute dtype: fp32 on CPU, bf16 for GPU/TPU
    param_dtype: str = "float32"
    # how projection weights are stored: "kn" w[K, N], or "nk" w[N, K] (CPU, the few-row kernel);
    # chosen at load time by `specjax.models.linear.preferred_layout`, see that module
    weight_layout: str = "kn"
    # how GGUF weights kept packed are multiplied: "exact" (gguf's fp32 weights, HF's numbers) or "q8"
    # (llama.cpp's int8 activations and integer dots; `specjax.models.quant`); chosen at load time
    weights_arith: str = "exact"
    # ---- the options families differ in (Llama's defaults) ----
    layer_kinds: tuple[AttnKind, ...] = ()  # one per layer; () is every layer GLOBAL
    sliding_window: int | None = None  # W of the LOCAL layers
    rope_local_theta: float | None = None  # the LOCAL layers' rope base, unscaled; None: the global rope
    qk_norm: bool = False  # RMSNorm over each head's q and k before rope (Qwen3, Gemma 3)
    norm_offset: float = 0.0  # every RMSNorm scales by norm_offset + w (Gemma: 1.0)
    query_pre_attn_scalar: float | None = None  # scores scaled by its -1/2 power; None: head_dim's
    mlp_activation: Activation = Activation.SILU
    embed_scale: bool = False  # token embeddings times sqrt(dim) (Gemma)

    def __post_init__(self):
        for f in ("vocab_size", "dim", "num_layers", "num_heads", "num_kv_heads", "head_dim", "ffn_dim"):
            if getattr(self, f) < 1:
                raise ValueError(f"{f}={getattr(self, f)}: must be >= 1")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim}: must be even (rotary embedding pairs)")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                    f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}"
            )
        for f in ("dtype", "param_dtype"):
            if getattr(self, f) not in ("float32", "bfloat16", "float16"):
                raise ValueError(f"{f}={getattr(self, f)!r}: use 'float32', 'bfloat16' or 'float16'")
        if self.weight_layout not in ("kn", "nk"):
            raise ValueError(f"weight_layout={self.weight_layout!r}: use 'kn' (w[K, N]) or 'nk' (w[N, K])")
        if self.weights_arith not in ("exact", "q8"):
            raise ValueError(f"weights_arith={self.weights_arith!r}: use 'exact' or 'q8'")
        if isinstance(self.rope_scaling, dict):  # read back from a JSON manifest (dataclasses.asdict)
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
        rs = self.rope_scaling
        if rs is not None and rs.kind == RopeKind.ROPE_FREQS and len(rs.divisors) != self.head_dim // 2:
            raise ValueError(f"rope_freqs has {len(rs.divisors)} divisors; head_dim={self.head_dim} needs "
                             f"{self.head_dim // 2}")
        object.__setattr__(self, "mlp_activation", _enum(Activation, self.mlp_activation, "MLP activation"))
        kinds = tuple(_enum(AttnKind, k, "attention kind") for k in self.layer_kinds)
        object.__setattr__(self, "layer_kinds", kinds)
        if kinds and len(kinds) != self.num_layers:
            raise ValueError(f"layer_kinds has {len(kinds)} entries for {self.num_layers} layers: give one per "
                             "layer, or none (every layer global)")
        if AttnKind.LOCAL in kinds and not (self.sliding_window and self.sliding_window >= 1):
            raise ValueError(f"local (sliding-window) layers need sliding_window >= 1; got {self.sliding_window}")
        if self.query_pre_attn_scalar is not None and not self.query_pre_attn_scalar > 0:
            raise ValueError(f"query_pre_attn_scalar={self.query_pre_attn_scalar}: must be positive")

    def kind(self, layer: int) -> AttnKind:
        """Layer `layer`'s attention kind."""
        return self.layer_kinds[layer] if self.layer_kinds else AttnKind.GLOBAL

    @property
    def local_layers(self) -> tuple[int, ...]:
        """The sliding-window layers."""
        return tuple(i for i in range(self.num_layers) if self.kind(i) == AttnKind.LOCAL)

    @property
    def groups(self) -> int:
        """Query heads per kv head (G)."""
        return self.num_heads // self.num_kv_heads

    @property
    def compute_dtype(self) -> Any:
        return jnp.dtype(self.dtype)

    @property
    def weight_dtype(self) -> Any:
        return jnp.dtype(self.param_dtype)


PRESETS: dict[str, ModelConfig] = {
    "smollm2-135m": ModelConfig(
        name="smollm2-135m", vocab_size=49152, dim=576, num_layers=30, num_heads=9,
        num_kv_heads=3, head_dim=64, ffn_dim=1536, rope_theta=100_000.0, norm_eps=1e-5,
        tie_embeddings=True, max_seq_len=8192,
    ),
    "qwen2.5-coder-0.5b": ModelConfig(
        name="qwen2.5-coder-0.5b", vocab_size=151936, dim=896, num_layers=24, num_heads=14,
        num_kv_heads=2, head_dim=64, ffn_dim=4864, rope_theta=1_000_000.0, norm_eps=1e-6,
        tie_embeddings=True, qkv_bias=True, max_seq_len=32768,
    ),
    "qwen2.5-coder-1.5b": ModelConfig(
        name="qwen2.5-coder-1.5b", vocab_size=151936, dim=1536, num_layers=28, num_heads=12,
        num_kv_heads=2, head_dim=128, ffn_dim=8960, rope_theta=1_000_000.0, norm_eps=1e-6,
        tie_embeddings=True, qkv_bias=True, max_seq_len=32768,
    ),
    "gemma3-270m": ModelConfig(
        name="gemma3-270m", family="gemma3", vocab_size=262144, dim=640, num_layers=18, num_heads=4,
        num_kv_heads=1, head_dim=256, ffn_dim=2048, rope_theta=1_000_000.0, rope_local_theta=10_000.0,
        norm_eps=1e-6, tie_embeddings=True, max_seq_len=32768, sliding_window=512,
        layer_kinds=tuple(AttnKind.GLOBAL if (i + 1) % 6 == 0 else AttnKind.LOCAL for i in range(18)),
        qk_norm=True, norm_offset=1.0, query_pre_attn_scalar=256.0, mlp_activation=Activation.GELU_TANH,
        embed_scale=True,
    ),
    "tiny": ModelConfig(
        name="tiny", vocab_size=64, dim=32, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=8, ffn_dim=64, rope_theta=10_000.0, max_seq_len=512,
    ),
}


def preset(name: str, **overrides) -> ModelConfig:
    """Returns the named preset, with `dataclasses.replace` overrides."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known presets: {sorted(PRESETS)}")
    return dataclasses.replace(PRESETS[name], **overrides)
