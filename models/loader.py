"""Loads a model and its tokenizer from a registry name, a .gguf file or an HF directory."""

from __future__ import annotations

import dataclasses
import hashlib
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.models import families, gguf_loader, hf_loader, linear, quant
from specjax.models.config import PRESETS, ModelConfig
from specjax.models.transformer import Transformer


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    """A model ready to decode: NNX module, tokenizer, config, where it came from."""

    model: Transformer
    tokenizer: object  # specjax.models.tokenizer.Tokenizer
    config: ModelConfig
    source: str  # file or directory the weights came from
    weights_id: str  # short hash of the weight file (manifests of trained heads refer to it)


def init_model(config: ModelConfig, seed: int = 0) -> Transformer:
    """A randomly initialised model of `config.family` (tests, tiny configs)."""
    return families.build(config, nnx.Rngs(seed))


def model_from_weights(config: ModelConfig, weights: dict[str, np.ndarray]) -> Transformer:
    """Builds the model of `config.family` whose parameters are `weights` ({"layers.0.attn.wq": array, ...}).

    Projection weights come as `[K, N]` (`x @ w`) and are stored in `config.weight_layout`
    (`specjax.models.linear`); shapes are checked in the `[K, N]` form. Every parameter must be
    given and every weight must be a parameter: a checkpoint is never half-loaded. A projection may
    come as a `quant.PackedWeight` (`[N, K]` blocks): its parameter then holds the blocks, marked
    `packed=(qtype, N, K)` (`specjax.models.layers.params.weight` dequantizes it in the graph)."""
    abstract = nnx.eval_shape(lambda: families.build(config, nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    flat = dict(nnx.to_flat_state(state))
    expected = {".".join(str(p) for p in path): path for path in flat}
    missing = sorted(set(expected) - set(weights))
    if missing:
        raise ValueError(f"checkpoint lacks parameters {missing[:6]}{'...' if len(missing) > 6 else ''}")
    extra = sorted(set(weights) - set(expected))
    if extra:
        raise ValueError(f"checkpoint has parameters the {config.family} model with this config does not "
                         f"({extra[:6]}{'...' if len(extra) > 6 else ''}): a bias or norm the config does not "
                         "declare; this checkpoint variant is not supported")
    leaves = []
    for key, path in expected.items():
        want = flat[path]
        w = weights[key]
        layout = want.get_metadata().get("dense_layout")
        expect = tuple(want.shape) if layout in (None, "kn") else tuple(want.shape)[::-1]
        if isinstance(w, quant.PackedWeight):
            if key == "embed" and w.shape == expect:  # token rows [V, D], as the embedding is stored
                leaves.append((path, want.replace(jnp.asarray(w.blocks), packed=(w.qtype, *w.shape))))
                continue
            if layout is None or w.shape[::-1] != expect:
                raise ValueError(f"parameter {key}: a packed {w.qtype} weight {w.shape[::-1]} where the model "
                                 f"expects a projection {expect}")
            leaves.append((path, want.replace(jnp.asarray(w.blocks), packed=(w.qtype, *w.shape))))
            continue
        if tuple(w.shape) != expect:
            raise ValueError(f"parameter {key}: checkpoint shape {w.shape}, model expects {expect}")
        if layout is not None:
            w = linear.to_layout(w, layout)  # HF/GGUF's [N, K] comes back as it was stored: no copy
        leaves.append((path, want.replace(jnp.asarray(w, dtype=config.weight_dtype))))
    return nnx.merge(graphdef, nnx.from_flat_state(leaves))


def weights_id(path: pathlib.Path) -> str:
    """Hash of the file size and its first and last MiB: cheap, and stable for a given file."""
    h = hashlib.sha256()
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    for f in files:
        size = f.stat().st_size
        h.update(str(size).encode())
        with open(f, "rb") as fh:
            h.update(fh.read(1 << 20))
            fh.seek(max(0, size - (1 << 20)))
            h.update(fh.read(1 << 20))
    return h.hexdigest()[:16]


WEIGHTS = ("packed", "dequantized")


def default_weights(dtype: str = "float32", backend: str | None = None) -> str:
    """How `load` keeps a GGUF file's quantized tensors unless told: "packed" for fp32 on CPU where the
    packed kernel is available (`linear.packed_kernel_available`), else "dequantized" (elsewhere the
    packed weight would be dequantized inside every step's graph, which costs more than fp32 weights)."""
    backend = backend or jax.default_backend()
    if backend == "cpu" and str(dtype) == "float32" and linear.packed_kernel_available():
        return "packed"
    return "dequantized"


def load(name_or_path: str, *, dtype: str = "float32", param_dtype: str | None = None,
         progress: bool = False, weight_layout: str | None = None, weights: str | None = None,
         weights_arith: str = "exact") -> LoadedModel:
    """Loads weights and tokenizer.

    Args:
      name_or_path: a registry name (`specjax.models.catalog.known_models()`), a .gguf file or
        an HF directory (config.json + *.safetensors + tokenizer.json).
      dtype: compute dtype; float32 (default, fast on CPU) or bfloat16 (GPU/TPU).
      param_dtype: storage dtype of the weights; defaults to `dtype`.
      progress: show a progress bar while dequantizing.
      weight_layout: how projection weights are stored ("kn" or "nk"); by default the faster one
        for this backend and dtype (`specjax.models.linear.preferred_layout`). Outputs do not change.
      weights: for a GGUF file, "packed": the quantized projections stay the file's blocks on the
        device (`specjax.models.quant`), multiplied by the packed CPU kernel or dequantized in the graph
        to the same fp32 values (greedy output does not change), and `weight_bytes` counts the blocks;
        or "dequantized": fp32 at load. Asked for "packed", a block type that cannot stay packed is
        refused by name. Default (`default_weights`): "packed" for fp32 on CPU where the packed kernel
        is built (faster: docs/BENCHMARKS.md, "Packed GGUF weights"), with any tensor of another block
        type dequantized; else "dequantized". Ignored for an HF directory.
      weights_arith: how packed weights are multiplied (`ModelConfig.weights_arith`): "exact" (HF's
        numbers) or "q8", llama.cpp's arithmetic (int8 activations per 32, integer dots; opt-in, not
        HF-identical; plain decoding and speculation share it). "q8" needs a GGUF file loaded packed.
    """
    strict = weights is not None  # asked for packed: a type that cannot stay packed is refused
    weights = default_weights(dtype) if weights is None else weights
    if weights not in WEIGHTS:
        raise ValueError(f"weights={weights!r}: use 'packed' (GGUF blocks kept as stored) or 'dequantized' (fp32)")
    from specjax.models import catalog
    from specjax.models.tokenizer import Tokenizer

    packed = weights == "packed"
    path = catalog.resolve(name_or_path)
    name = name_or_path if name_or_path in PRESETS else path.stem
    if quant.check_arith(weights_arith) == "q8" and (path.is_dir() or not packed or str(dtype) != "float32"):
        raise ValueError(f"weights_arith='q8' multiplies GGUF weights kept packed in fp32 compute; {path.name} is "
                         f"{'an HF directory' if path.is_dir() else f'loaded {weights} in {dtype}'} (load a .gguf "
                         "with weights='packed', dtype='float32', or use weights_arith='exact')")
    over = dict(dtype=dtype, param_dtype=param_dtype or dtype, weights_arith=weights_arith,
                weight_layout=linear.check_layout(weight_layout or linear.preferred_layout(dtype=dtype)))
    if path.is_dir():
        config = hf_loader.config_from_hf(path, name=name, **over)
        weights = hf_loader.weights_from_hf(path, config)
        tokenizer = Tokenizer.from_hf_dir(path)
    else:
        reader = gguf_loader.open_reader(path)
        config = gguf_loader.config_from_gguf(reader, name=name, **over)
        bar = None
        if progress:
            from tqdm import tqdm

            bar = lambda it: tqdm(it, desc=f"loading {path.name}", unit="tensor", leave=False)
        weights = gguf_loader.weights_from_gguf(reader, config, progress=bar, packed=packed, strict=strict)
        tokenizer = Tokenizer.from_gguf(reader)
    model = model_from_weights(config, weights)
    return LoadedModel(model, tokenizer, config, str(path), weights_id(path))


def weight_bytes(model: nnx.Module) -> int:
    """Bytes of all parameters (what a decode step streams from memory)."""
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(model, nnx.Param)))

