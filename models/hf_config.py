"""Reading the options of an HF `config.json` as transformers reads them: rope, which layers slide.

The family modules (`specjax.models.llama`, `gemma3`, `qwen3`) read their options with these.
"""

from __future__ import annotations

from typing import Callable

from specjax.models.config import ROPE_SCALING_KINDS, AttnKind, RopeKind, RopeScaling

_LAYER_TYPES = {"full_attention": AttnKind.GLOBAL, "sliding_attention": AttnKind.LOCAL}


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
    kind = RopeKind(kind)
    need = ("factor",) if kind == RopeKind.LINEAR else ("factor", "low_freq_factor", "high_freq_factor")
    missing = [k for k in need if params.get(k) is None]
    if missing:
        raise ValueError(f"{where}: rope scaling {kind.value!r} lacks {', '.join(missing)}")
    if kind == RopeKind.LINEAR:
        return theta, RopeScaling(kind=RopeKind.LINEAR, factor=float(params["factor"]))
    # as transformers' standardize_rope_params: a top-level original_max_position_embeddings wins
    original = (c.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
                or c.get("max_position_embeddings", 8192))
    return theta, RopeScaling(kind=RopeKind.LLAMA3, factor=float(params["factor"]),
                              low_freq_factor=float(params["low_freq_factor"]),
                              high_freq_factor=float(params["high_freq_factor"]), original_context=int(original))


def layer_kinds(c: dict, where: str, sliding_window, is_local: Callable[[int], bool]) -> dict:
    """`layer_kinds` and `sliding_window` of a config: its `layer_types` where it lists them (what
    transformers >= 5 writes), else `is_local(i)` for each layer; none slide without a window."""
    n = int(c["num_hidden_layers"])
    types = c.get("layer_types")
    if types is not None:
        unknown = sorted(set(types) - set(_LAYER_TYPES))
        if unknown:
            raise ValueError(f"{where}: layer type {unknown[0]!r} is not supported; supported: "
                             f"{', '.join(map(repr, _LAYER_TYPES))}")
        if len(types) != n:
            raise ValueError(f"{where}: layer_types has {len(types)} entries for {n} layers")
        kinds = tuple(_LAYER_TYPES[t] for t in types)
    else:
        kinds = tuple(AttnKind.LOCAL if sliding_window is not None and is_local(i) else AttnKind.GLOBAL
                      for i in range(n))
    if AttnKind.LOCAL not in kinds:
        return dict(layer_kinds=(), sliding_window=None)
    if sliding_window is None or int(sliding_window) < 1:
        raise ValueError(f"{where}: layer_types names sliding layers but sliding_window is {sliding_window!r}")
    return dict(layer_kinds=kinds, sliding_window=int(sliding_window))


def qwen_layer_kinds(c: dict, where: str) -> dict:
    """Qwen2's and Qwen3's: with `use_sliding_window`, layers from `max_window_layers` on slide."""
    window = c.get("sliding_window") if c.get("use_sliding_window") else None
    first = int(c.get("max_window_layers", 28))
    return layer_kinds(c, where, window, lambda i: i >= first)
