"""Where a target step goes on this machine: the whole jitted forward of a real model (logits for every
row, as decode and verify compute them) at a fixed cache position, for each weight format and with the
CPU attention kernel on and off, interleaved; and, with `--ops`, its executed ops by kind (XLA's
profiler), so that a change of cost is measured op by op.

    python -m specjax.bench.experiments.step_cost                       # smollm2-135m, T = 1 and 5
    python -m specjax.bench.experiments.step_cost --windows 1,5,9 --at 500 --cache 1024 --ops

Weight formats: "packed" (the GGUF blocks multiplied by the packed kernel, exact), "packed-q8" (the same
in llama.cpp's arithmetic, `weights_arith="q8"`) and "dequantized" (fp32).
Attention: "kernel" (`specjax.models.cpu_attention`) or "xla" (`attention.attend`).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import glob
import gzip
import json
import re
import statistics
import tempfile

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.bench import verify_profile
from specjax.models import cpu_attention, linear, loader


def _forward(model):
    graphdef, params = nnx.split(model)

    def fwd(params, tokens, positions, cache):
        out = nnx.merge(graphdef, params)(tokens, positions, cache)
        return out.logits, out.cache

    return jax.jit(fwd, donate_argnums=(3,)), params


class _Step:
    """One (format, attention, T) forward, called with its own cache (donated back each call)."""

    def __init__(self, model, t: int, at: int, cache_len: int, kernel: bool):
        with cpu_attention.use_kernel(kernel):
            self.f, self.params = _forward(model)
            self.cache = model.init_cache(1, cache_len)
            self.tokens = jnp.ones((1, t), jnp.int32)
            self.positions = at + jnp.arange(t, dtype=jnp.int32)[None]
            self()  # compiles under the switch

    def __call__(self):
        logits, self.cache = self.f(self.params, self.tokens, self.positions, self.cache)
        return logits


def op_profile(step: _Step, repeats: int = 10) -> list[tuple[str, int, float]]:
    """(op kind, ops a step, ms a step) of the executed XLA ops, from a profiler trace: fusions and
    custom calls by kind (`ffi_call` is a kernel: the products, the attention)."""
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d, create_perfetto_trace=True)
        for _ in range(repeats):
            jax.block_until_ready(step())
        jax.profiler.stop_trace()
        with gzip.open(glob.glob(d + "/**/perfetto_trace.json.gz", recursive=True)[-1]) as f:
            trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    count, total = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("ph") != "X" or "XLA" not in names.get((e["pid"], e["tid"]), ""):
            continue
        if e["name"].startswith(("ThunkExecutor", "end: ")):
            continue
        kind = re.sub(r"\.\d+$", "", e["name"])
        count[kind] += 1
        total[kind] += e.get("dur", 0)
    return [(k, count[k] // repeats, total[k] / repeats / 1e3) for k, _ in total.most_common()]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--windows", default="1,5", help="tokens per forward (1: a decode step; K + 1: a verify window)")
    p.add_argument("--at", type=int, default=200, help="the cache position the window starts at")
    p.add_argument("--cache", type=int, default=640, help="the cache's length (positions)")
    p.add_argument("--formats", default="packed,packed-q8,dequantized")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--ops", action="store_true", help="also list each step's ops by kind (kernel attention)")
    p.add_argument("--ab-flags", default="", help="also time each packed format with the packed kernel built with "
                   "these extra compiler flags, as format@ab (an A/B of two builds in one run; e.g. "
                   "-DSPECJAX_Q8_NO_X16: q8 without the 16-row tile)")
    a = p.parse_args(argv)
    windows = [int(w) for w in a.windows.split(",")]
    attention = ("kernel", "xla") if cpu_attention.available() else ("xla",)
    builds = {"": None}
    if a.ab_flags:
        builds["@ab"] = linear.register_packed_variant("specjax_qdense_nk_ab", tuple(a.ab_flags.split()))
    steps, formats = {}, []
    for fmt in a.formats.split(","):
        weights, _, arith = fmt.partition("-")
        model = loader.load(a.model, weights=weights, weights_arith=arith or "exact").model
        for suffix, target in builds.items() if weights == "packed" else [("", None)]:
            formats.append(fmt + suffix)
            for att in attention:
                for t in windows:
                    with linear.packed_target(target):
                        steps[(fmt + suffix, att, t)] = _Step(model, t, a.at, a.cache, att == "kernel")
    samples = verify_profile.interleaved({k: (s, ()) for k, s in steps.items()}, a.repeats)
    print(f"{a.model}, cache {a.cache}, window at position {a.at}; attention kernel: {cpu_attention.status()}; "
          f"median ms of {a.repeats}, interleaved\n")
    print("| weights | attention | " + " | ".join(f"T={t}" for t in windows) + " | window / step |")
    print("|---|---|" + "---|" * (len(windows) + 1))
    for fmt in formats:
        for att in attention:
            ms = [statistics.median(samples[(fmt, att, t)]) * 1e3 for t in windows]
            ratio = f"{ms[-1] / ms[0]:.2f}x" if len(ms) > 1 else "-"
            print(f"| {fmt} | {att} | " + " | ".join(f"{m:.1f}" for m in ms) + f" | {ratio} |")
    if a.ops:
        for key, step in steps.items():
            if key[1] != attention[0]:
                continue
            rows = op_profile(step)
            print(f"\n{key[0]}, T={key[2]}: {sum(n for _, n, _ in rows)} ops, {sum(m for *_, m in rows):.1f} ms of ops")
            for kind, n, ms in rows[:8]:
                print(f"  {kind:40s} {n:5d}  {ms:7.2f} ms")


if __name__ == "__main__":
    main()
