"""Step cost and tok/s of plain and speculative decoding on an accelerator (optionally a mesh), with
the device's memory roofline. Random weights of the real SmolLM2-135M shapes in bf16 (no download:
step time does not depend on the weights' values; acceptance does, so tau here is not a quality
figure).

For each method (plain, prompt lookup, draft model, Medusa chain, Medusa tree) and batch (1, 16, 64):
ms per target forward inside the jitted loop, tok/s over the batch, tau; and per batch the roofline of
a plain step: bytes one device must read per step (its weight shard + its KV-cache shard) over the
bandwidth measured on that device, as tok/s. Memory per device from the layout.

Usage:
  python -m specjax.bench.experiments.mesh_device [--mesh data=1,model=8] [--batches 1,16,64] [--json out.jsonl]
  python -m specjax.bench.experiments.mesh_device --tiny  # CPU smoke test: tiny config, a few tokens
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import numpy as np
from flax import nnx

from specjax import sharding
from specjax.bench.offline import measure_bandwidth
from specjax.methods.config import SpecConfig
from specjax.serving.engine import Engine
from specjax.models import config, loader
from specjax.models.heads import HeadsConfig, MedusaHeads
from specjax.methods.draft.record import DraftModel
from specjax.methods.medusa.record import LoadedHeads

METHODS = {
    "none": SpecConfig(),
    "ngram": SpecConfig(method="ngram", k=4),
    "draft": SpecConfig(method="draft", k=4),
    "medusa": SpecConfig(method="medusa", k=3),
    "tree": SpecConfig.make("medusa", tree="small"),
}


def models(tiny: bool, dtype: str):
    """Target with SmolLM2-135M's shapes (or `tiny`), a 4-layer draft of the same width and vocab,
    and 4 random Medusa heads."""
    name = "tiny" if tiny else "smollm2-135m"
    cfg = config.preset(name, dtype=dtype, param_dtype=dtype)
    target = loader.init_model(cfg, seed=0)
    draft = loader.init_model(config.preset(name, dtype=dtype, param_dtype=dtype,
                                            num_layers=2 if tiny else 4), seed=1)
    heads = MedusaHeads(HeadsConfig.for_model(cfg, num_heads=4), rngs=nnx.Rngs(0))
    k1, k2 = jax.random.split(jax.random.key(3))
    heads.w[...] = jax.random.normal(k1, heads.w.shape) * 0.5 * cfg.dim**-0.5
    heads.b[...] = jax.random.normal(k2, heads.b.shape) * 0.5
    return target, draft, heads


def measure(eng: Engine, method: str, batch: int, prompt: list[int], max_new: int) -> dict:
    spec = METHODS[method]
    for _ in range(2):  # the first run compiles
        r = eng.generate([prompt] * batch, max_new_tokens=max_new, stop_ids=(), spec=spec)
    x = r[0]
    decode_s = x.wall_s - x.ttft_s
    fwd = max(1, x.target_forwards)
    return dict(method=method, batch=batch, new_tokens=x.new_tokens, target_forwards=x.target_forwards,
                tau=round(x.tau, 3), ms_per_forward=round(decode_s / fwd * 1e3, 3),
                tok_s=round(batch * x.new_tokens / x.wall_s, 1), ttft_ms=round(x.ttft_s * 1e3, 2),
                compile_s=round(x.compile_s, 2))


def roofline(eng: Engine, batch: int, prompt_len: int, max_new: int, bandwidth: float) -> dict:
    """Plain step: every device reads its weight shard and its whole KV-cache shard (attention reads
    all S slots of the position-indexed cache, masked)."""
    rows = eng.rows_for(batch)
    dec, _ = eng.build_decoder(SpecConfig(), prompt_bucket=eng.bucket_for(prompt_len), max_new_tokens=max_new)
    weights = sharding.memory_report(eng, batch=rows, cache_length=dec.cache_length, window=dec.window).parts["weights"]
    # the target's alone
    cache = sharding.cache_bytes_per_device(eng.model, rows, dec.cache_length, eng.mesh, window=dec.window)
    step_bytes = weights + cache
    return dict(batch=batch, rows=rows, weights_bytes_per_device=weights,
                cache_bytes_per_device=cache, bytes_per_step=step_bytes,
                roofline_ms_per_step=round(step_bytes / bandwidth * 1e3, 4),
                roofline_tok_s=round(batch * bandwidth / step_bytes, 1))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="tiny config, float32, 8 new tokens (CPU smoke test)")
    p.add_argument("--mesh", default=None, help="e.g. data=1,model=8 (default: one device)")
    p.add_argument("--dtype", default=None, help="default bfloat16 (float32 with --tiny)")
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--max-new-tokens", type=int, default=None, help="default 128 (8 with --tiny)")
    p.add_argument("--prompt-len", type=int, default=100)
    p.add_argument("--json", default=None, help="write the records (JSON lines) here")
    a = p.parse_args(argv)
    dtype = a.dtype or ("float32" if a.tiny else "bfloat16")
    max_new = a.max_new_tokens or (8 if a.tiny else 128)
    batches = [int(b) for b in a.batches.split(",")]
    methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    bad = [m for m in methods if m not in METHODS]
    if bad:
        raise SystemExit(f"unknown method {bad[0]!r}: use {', '.join(METHODS)}")
    mesh = None if a.mesh is None else sharding.make_mesh(a.mesh)
    dev = jax.devices()[0]
    print(f"devices: {jax.device_count()} x {dev.device_kind} ({dev.platform}); mesh "
          f"{'none' if mesh is None else sharding.describe(mesh)}; {dtype}", file=sys.stderr)
    target, draft, heads = models(a.tiny, dtype)
    eng = Engine(target, mesh=mesh,
                 assets={"draft": DraftModel(draft), "medusa": LoadedHeads(heads)})
    vocab = target.config.vocab_size
    prompt = [int(t) for t in np.random.default_rng(0).integers(1, vocab, a.prompt_len)]
    t0 = time.perf_counter()
    bandwidth = measure_bandwidth(mib=64 if a.tiny else 1024)
    records = [dict(kind="device", device=dev.device_kind, platform=dev.platform, devices=jax.device_count(),
                    mesh=None if mesh is None else sharding.describe(mesh), dtype=dtype,
                    measured_bandwidth_gb_s=round(bandwidth / 1e9, 1),
                    model="tiny" if a.tiny else "smollm2-135m (random weights)")]
    for b in batches:
        records.append(dict(kind="roofline", **roofline(eng, b, a.prompt_len, max_new, bandwidth)))
        for m in methods:
            rec = dict(kind="run", **measure(eng, m, b, prompt, max_new))
            records.append(rec)
            print(json.dumps(rec), file=sys.stderr, flush=True)
    print("| method | batch | ms / target forward | tok/s | tau | roofline tok/s (plain) |")
    print("|---|---|---|---|---|---|")
    roof = {r["batch"]: r for r in records if r["kind"] == "roofline"}
    for r in (x for x in records if x["kind"] == "run"):
        print(f"| {r['method']} | {r['batch']} | {r['ms_per_forward']:.2f} | {r['tok_s']:.0f} | {r['tau']:.2f} | "
              f"{roof[r['batch']]['roofline_tok_s']:.0f} |")
    print(f"\nmeasured bandwidth {bandwidth / 1e9:.1f} GB/s on {dev.device_kind}; "
          f"{time.perf_counter() - t0:.0f} s in all", file=sys.stderr)
    if a.json:
        with open(a.json, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
