"""Reads HF-format checkpoint directories: config.json + *.safetensors, of any registered family.

The shapes every family shares are read here; the family (`specjax.models.families`, found by
`architectures`) reads its own options and names its block's tensors. Every tensor of the files
must be one the model has: an unknown one is an error naming it, never a silent skip.
"""

from __future__ import annotations

import json
import pathlib
import numpy as np

from specjax.models import families
from specjax.models.config import ModelConfig

def config_from_hf(path: str | pathlib.Path, *, name: str = "custom", **overrides) -> ModelConfig:
    """Builds a `ModelConfig` from an HF `config.json` (the family by its `architectures`)."""
    path = pathlib.Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"{str(path)!r} has no config.json; an HF model directory needs "
                         "config.json and *.safetensors")
    c = json.loads(cfg_file.read_text())
    where = str(cfg_file)
    family, arch = families.for_hf(c.get("architectures") or ["LlamaForCausalLM"], where)
    heads = c["num_attention_heads"]
    kw = dict(
        name=name,
        family=family.name,
        vocab_size=c["vocab_size"],
        dim=c["hidden_size"],
        num_layers=c["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=c.get("num_key_value_heads", heads),
        head_dim=c.get("head_dim") or c["hidden_size"] // heads,
        ffn_dim=c["intermediate_size"],
        norm_eps=float(c.get("rms_norm_eps", 1e-5)),
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        max_seq_len=int(c.get("max_position_embeddings", 8192)),
    )
    kw.update(family.hf_options(c, arch, where))
    kw.update(overrides)
    return ModelConfig(**kw)


def weights_from_hf(path: str | pathlib.Path, config: ModelConfig) -> dict[str, np.ndarray]:
    """Returns `{flat param path: float32 array}` from the directory's safetensors files.

    Raises:
      ValueError: a tensor the model has no place for, named.
    """
    from safetensors.flax import load_file  # handles bf16, unlike the numpy reader

    names = families.get(config.family).hf_layer_names
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
                if not config.tie_embeddings:  # a tied checkpoint may store the copy too; HF ignores it
                    out["lm_head"] = w.T
            elif name.startswith("model.layers.") and (parts := name.split(".", 3))[2].isdigit() \
                    and int(parts[2]) < config.num_layers and parts[3] in names:
                out[f"layers.{parts[2]}.{names[parts[3]]}"] = w.T if w.ndim == 2 else w
            else:
                raise ValueError(
                    f"{f.name}: tensor {name!r} has no place in specjax's {config.family} model ({config.num_layers} "
                    "layers; a bias, norm or layer this family does not have?): this checkpoint variant is "
                    "not supported")
    return out
