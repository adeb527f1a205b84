"""The two layouts of a sliding-window layer's cache, side by side on a real model (issue 29):

  ring: `init_cache(..., window=w)`, W - 1 + w entries per local layer (what the decoder builds);
  full: `init_cache(...)`, every layer `length` slots, the window applied by the mask.

Prints the cache bytes per context token (the marginal cost of one more position) and the fixed
bytes, and the median time of a jitted forward of T new tokens (a plain step, a 5-token verify) at
the end of a cache of each length, both layouts interleaved in one run.

    flock /work/tools/heavy.lock nice -n 5 python scripts/sliding_cache.py --model gemma3-270m
"""

from __future__ import annotations

import argparse
import json
import statistics

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.bench import verify_profile
from specjax.models import loader


def cache_bytes(model, length: int, window: int | None) -> int:
    return jax.eval_shape(lambda: model.init_cache(1, length, window=window)).nbytes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--lengths", default="1024,4096,16384", help="cache lengths S")
    p.add_argument("--windows", default="1,5", help="new tokens T per forward")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--json", default=None, help="also write the rows here")
    args = p.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    windows = [int(x) for x in args.windows.split(",")]
    lm = loader.load(args.model)
    model, c = lm.model, lm.config
    graphdef, params = nnx.split(model)
    widest = max(windows)
    print(f"{args.model}: {len(c.local_layers)} of {c.num_layers} layers slide (W={c.sliding_window}); "
          f"the ring is built for forwards of up to {widest} tokens")

    rows = []
    for layout, window in (("ring", widest), ("full", None)):
        a, b = cache_bytes(model, lengths[0], window), cache_bytes(model, lengths[-1], window)
        per_token = (b - a) / (lengths[-1] - lengths[0])
        rows.append(dict(kind="memory", layout=layout, bytes_per_token=per_token, fixed_bytes=a - per_token * lengths[0],
                         **{f"bytes_at_{s}": cache_bytes(model, s, window) for s in lengths}))

    @jax.jit
    def forward(params, tokens, positions, cache):
        out = nnx.merge(graphdef, params)(tokens, positions, cache)
        return out.logits, out.cache

    calls = {}
    for s in lengths:
        for layout, window in (("ring", widest), ("full", None)):
            cache = model.init_cache(1, s, window=window)
            for t in windows:
                toks = jnp.ones((1, t), jnp.int32)
                pos = (s - widest - 1) + jnp.arange(t, dtype=jnp.int32)[None]
                jax.block_until_ready(forward(params, toks, pos, cache))  # compile
                calls[(s, layout, t)] = (forward, (params, toks, pos, cache))
    samples = verify_profile.interleaved(calls, args.repeats)  # every configuration once per round
    for (s, layout, t), ts in samples.items():
        rows.append(dict(kind="forward", length=s, layout=layout, T=t, ms=1e3 * statistics.median(ts),
                         ms_min=1e3 * min(ts)))

    for r in rows:
        if r["kind"] == "memory":
            print(f"memory {r['layout']:4s}: {r['bytes_per_token']:9.0f} B per context token, fixed "
                  f"{r['fixed_bytes'] / 2**20:7.1f} MiB; " + ", ".join(
                      f"S={s}: {r[f'bytes_at_{s}'] / 2**20:.1f} MiB" for s in lengths))
    print(f"{'S':>6} {'T':>3} {'ring ms':>9} {'full ms':>9} {'full/ring':>9}")
    for s in lengths:
        for t in windows:
            ring = next(r for r in rows if r["kind"] == "forward" and (r["length"], r["layout"], r["T"]) == (s, "ring", t))
            full = next(r for r in rows if r["kind"] == "forward" and (r["length"], r["layout"], r["T"]) == (s, "full", t))
            print(f"{s:6d} {t:3d} {ring['ms']:9.2f} {full['ms']:9.2f} {full['ms'] / ring['ms']:9.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
