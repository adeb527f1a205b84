"""The model families: a name -> its model class and how its checkpoints name things.

A family is one module (its block over the shared layers, its tensor name maps, how it reads its
options from a checkpoint) and one `register(Family(...))` entry. The loaders find a family by a
checkpoint's architecture (HF `architectures`, GGUF `general.architecture`); a model is built from
`config.family`. Nothing else in the code branches on a family.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, Mapping

import jax
import numpy as np
from flax import nnx

from specjax.models import gemma3, llama, qwen3
from specjax.models.config import ModelConfig
from specjax.models.transformer import Transformer


def _no_options(*_) -> dict:
    return {}


def _as_stored(name: str, w: np.ndarray, config: ModelConfig, arch: str) -> np.ndarray:
    return w


@dataclasses.dataclass(frozen=True, kw_only=True)
class Family:
    """One model family.

    Attributes:
      name: `ModelConfig.family` of its models.
      model: its `Transformer` subclass.
      hf_architectures: the `architectures` of HF `config.json` it reads.
      hf_options: `(config.json dict, architecture, where) -> ModelConfig fields` beyond the shapes
        every family shares (rope, window, norms, ...); raises on a value it does not support.
      hf_layer_names: a block's tensors, HF's name after `model.layers.{i}.` -> ours in the block.
      gguf_architectures, gguf_options, gguf_layer_names: the same for GGUF (`gguf_options` gets
        `get(key, default)` over `{arch}.` keys, the architecture and the tensor names); names after
        `blk.{i}.`.
      gguf_tensor: `(GGUF name, array, config, arch) -> array`: undoes how llama.cpp's converter stored
        a tensor (Llama's q/k row permutation, Gemma's norms stored as 1 + w).
    """

    name: str
    model: type[Transformer]
    hf_architectures: tuple[str, ...] = ()
    hf_options: Callable[[dict, str, str], dict] = _no_options
    hf_layer_names: Mapping[str, str] = dataclasses.field(default_factory=dict)
    gguf_architectures: tuple[str, ...] = ()
    gguf_options: Callable[..., dict] = _no_options
    gguf_layer_names: Mapping[str, str] = dataclasses.field(default_factory=dict)
    gguf_tensor: Callable[[str, np.ndarray, ModelConfig, str], np.ndarray] = _as_stored


FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    """Adds `family`; its name and architectures must be new."""
    if family.name in FAMILIES:
        raise ValueError(f"model family {family.name!r} is already registered")
    for other in FAMILIES.values():
        clash = (set(family.hf_architectures) & set(other.hf_architectures)) | (
            set(family.gguf_architectures) & set(other.gguf_architectures))
        if clash:
            raise ValueError(f"family {family.name!r}: architecture {sorted(clash)[0]!r} already belongs to "
                             f"family {other.name!r}")
    FAMILIES[family.name] = family
    return family


def unregister(name: str) -> None:
    """Removes a family (a test's toy family)."""
    FAMILIES.pop(name, None)


def get(name: str) -> Family:
    if name not in FAMILIES:
        raise ValueError(f"unknown model family {name!r}; registered: {', '.join(sorted(FAMILIES))}")
    return FAMILIES[name]


def build(config: ModelConfig, rngs: nnx.Rngs) -> Transformer:
    """A randomly initialised model of `config`'s family."""
    return get(config.family).model(config, rngs=rngs)


@functools.lru_cache(maxsize=64)
def num_params(config: ModelConfig) -> int:
    """Parameters of the model `config` builds (counted on its abstract shapes: nothing allocated)."""
    abstract = nnx.eval_shape(lambda: build(config, nnx.Rngs(0)))
    return sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))


def for_hf(architectures: list[str], where: str) -> tuple[Family, str]:
    """The family reading one of these HF architectures, and which one."""
    for family in FAMILIES.values():
        for arch in architectures:
            if arch in family.hf_architectures:
                return family, arch
    known = sorted(a for f in FAMILIES.values() for a in f.hf_architectures)
    raise ValueError(f"{where}: HF architecture {architectures} is not supported; supported: {', '.join(known)}")


def for_gguf(arch: str) -> Family:
    """The family reading GGUF architecture `arch`."""
    for family in FAMILIES.values():
        if arch in family.gguf_architectures:
            return family
    known = sorted(a for f in FAMILIES.values() for a in f.gguf_architectures)
    raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: {', '.join(known)}")


register(Family(name="llama", model=llama.Llama, hf_architectures=llama.HF_ARCHITECTURES,
                hf_options=llama.hf_options, hf_layer_names=llama.HF_LAYER_NAMES,
                gguf_architectures=llama.GGUF_ARCHITECTURES, gguf_options=llama.gguf_options,
                gguf_layer_names=llama.GGUF_LAYER_NAMES, gguf_tensor=llama.gguf_tensor))
register(Family(name="qwen3", model=qwen3.Qwen3, hf_architectures=qwen3.HF_ARCHITECTURES,
                hf_options=qwen3.hf_options, hf_layer_names=qwen3.HF_LAYER_NAMES,
                gguf_architectures=qwen3.GGUF_ARCHITECTURES, gguf_options=qwen3.gguf_options,
                gguf_layer_names=qwen3.GGUF_LAYER_NAMES))
register(Family(name="gemma3", model=gemma3.Gemma3, hf_architectures=gemma3.HF_ARCHITECTURES,
                hf_options=gemma3.hf_options, hf_layer_names=gemma3.HF_LAYER_NAMES,
                gguf_architectures=gemma3.GGUF_ARCHITECTURES, gguf_options=gemma3.gguf_options,
                gguf_layer_names=gemma3.GGUF_LAYER_NAMES, gguf_tensor=gemma3.gguf_tensor))
