"""Model configurations: frozen, hashable, with named presets.

Dimension alphabet (einsums and type hints): see `specjax.models.llama`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax.numpy as jnp


ROPE_SCALING_KINDS = ("llama3", "linear")  # what a checkpoint may ask for; "rope_freqs" is GGUF's form


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """How a checkpoint rescales its RoPE frequencies (`specjax.models.llama.rope_inv_freq` applies it).

    Kinds (each divides the default inverse frequencies `theta ** (-2i / H)`):
      "linear": all of them by `factor` (position interpolation: positions / factor).
      "llama3": Llama 3.1+, as HF's `_compute_llama3_parameters`: wavelengths below
        `original_context / high_freq_factor` kept, above `original_context / low_freq_factor`
        divided by `factor`, smoothly interpolated between.
      "rope_freqs": each by its own entry of `divisors` (H / 2 of them): the `rope_freqs` tensor
        llama.cpp's converter writes into a GGUF for llama3 scaling (llama.cpp divides each angle by it).

    Hashable like the `ModelConfig` that holds it.
    """

    kind: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_context: int = 8192
    divisors: tuple[float, ...] = ()

    def __post_init__(self):
        if self.kind not in (*ROPE_SCALING_KINDS, "rope_freqs"):
            raise ValueError(f"rope scaling {self.kind!r} is not supported; supported: "
                             f"{', '.join(map(repr, ROPE_SCALING_KINDS))} (or none)")
        object.__setattr__(self, "divisors", tuple(float(d) for d in self.divisors))
        if not (math.isfinite(self.factor) and self.factor > 0):
            raise ValueError(f"rope scaling {self.kind!r}: factor={self.factor} must be a positive number")
        if self.kind == "llama3" and not (0 < self.low_freq_factor < self.high_freq_factor):
            raise ValueError(f"llama3 rope scaling needs 0 < low_freq_factor < high_freq_factor; got "
                             f"{self.low_freq_factor} and {self.high_freq_factor}")
        if self.kind == "llama3" and self.original_context < 1:
            raise ValueError(f"llama3 rope scaling: original_context={self.original_context} must be >= 1")
        if self.kind == "rope_freqs" and not (
                self.divisors and all(math.isfinite(d) and d > 0 for d in self.divisors)):
            raise ValueError("rope scaling 'rope_freqs' needs H / 2 positive finite divisors; got "
                             f"{self.divisors[:8]}{'...' if len(self.divisors) > 8 else ''}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder (Llama, SmolLM2, Qwen2).

    Hashable: it is part of the static side of every jitted function.
    """

    name: str = "custom"
    vocab_size: int
    dim: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_dim: int
    rope_theta: float = 10_000.0
    rope_scaling: RopeScaling | None = None  # None: the plain frequencies
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    qkv_bias: bool = False
    max_seq_len: int = 8192
    dtype: str = "float32"  # compute dtype: fp32 on CPU, bf16 for GPU/TPU
    param_dtype: str = "float32"
    # how projection weights are stored: "kn" w[K, N], or "nk" w[N, K] (CPU, the few-row kernel);
    # chosen at load time by `specjax.models.linear.preferred_layout`, see that module
    weight_layout: str = "kn"

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
        if isinstance(self.rope_scaling, dict):  # read back from a JSON manifest (dataclasses.asdict)
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
        rs = self.rope_scaling
        if rs is not None and rs.kind == "rope_freqs" and len(rs.divisors) != self.head_dim // 2:
            raise ValueError(f"rope_freqs has {len(rs.divisors)} divisors; head_dim={self.head_dim} needs "
                             f"{self.head_dim // 2}")

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

    @property
    def num_params(self) -> int:
        attn = self.dim * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        if self.qkv_bias:
            attn += self.head_dim * (self.num_heads + 2 * self.num_kv_heads)
        block = attn + 3 * self.dim * self.ffn_dim + 2 * self.dim
        head = 0 if self.tie_embeddings else self.vocab_size * self.dim
        return self.vocab_size * self.dim + self.num_layers * block + self.dim + head


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
