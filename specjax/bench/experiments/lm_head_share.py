"""The LM head's share of a decode step and of a verify window: the whole jitted forward (hidden states
and logits over every row, as verify computes them) against the same forward stopping at the final
norm, interleaved, at a fixed cache position; beside the head's share of the weight bytes a step reads.

    .venv/bin/python -m specjax.bench.experiments.lm_head_share   # gemma3-270m and smollm2-135m
    .venv/bin/python -m specjax.bench.experiments.lm_head_share --models gemma3-270m --windows 1,5,9 --repeats 31

Weights are constant, of each preset's shapes (nothing is downloaded; timing does not depend on values).
Where the logits are computed: prefill computes them at each row's last prompt position only (every
position only for a method whose shared state reads the target's top-k there: token recycling), and a
decode or verify step at every window row, which the acceptance rule reads.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.bench import verify_profile
from specjax.models import config as model_config


def measure(preset: str, windows: tuple[int, ...], repeats: int, cache_len: int = 512, at: int = 300) -> list[dict]:
    # as the loader builds it for fp32 on CPU: projections stored [N, K] for the few-row kernel
    config = dataclasses.replace(model_config.preset(preset, dtype="float32", param_dtype="float32"),
                                 weight_layout="nk")
    model = verify_profile.constant_model(config)
    graphdef, params = nnx.split(model)

    def full(params, tokens, positions, cache):
        out = nnx.merge(graphdef, params)(tokens, positions, cache)
        return out.logits, out.cache

    def body(params, tokens, positions, cache):
        return nnx.merge(graphdef, params).hidden_states(tokens, positions, cache)

    fns = {}
    cache = model.init_cache(1, cache_len)
    for name, f in (("forward", jax.jit(full)), ("without the head", jax.jit(body))):
        for t in windows:
            args = (params, jnp.ones((1, t), jnp.int32), at + jnp.arange(t, dtype=jnp.int32)[None], cache)
            jax.block_until_ready(f(*args))
            fns[(name, t)] = (f, args)
    samples = verify_profile.interleaved(fns, repeats)
    head_bytes = config.vocab_size * config.dim * 4
    total_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    rows = []
    for t in windows:
        whole = statistics.median(samples[("forward", t)])
        rest = statistics.median(samples[("without the head", t)])
        rows.append(dict(model=preset, T=t, forward_ms=whole * 1e3, without_head_ms=rest * 1e3,
                         head_share=(whole - rest) / whole, head_bytes_share=head_bytes / total_bytes))
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="gemma3-270m,smollm2-135m")
    p.add_argument("--windows", default="1,5")
    p.add_argument("--repeats", type=int, default=21, help="interleaved repetitions (medians reported)")
    a = p.parse_args()
    windows = tuple(int(w) for w in a.windows.split(","))
    print("| model | tokens | forward | without the LM head | the head's share of the time | of the weight bytes |")
    print("|---|---|---|---|---|---|")
    for preset in a.models.split(","):
        for r in measure(preset.strip(), windows, a.repeats):
            print(f"| {r['model']} | {r['T']} | {r['forward_ms']:.1f} ms | {r['without_head_ms']:.1f} ms | "
                  f"{r['head_share']:.0%} | {r['head_bytes_share']:.0%} |")


if __name__ == "__main__":
    main()
