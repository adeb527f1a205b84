"""`specjax bench`: our loop against HF transformers and the memory roofline, in one run.

(With prompts, methods or concurrency levels, `specjax bench` runs the load test of
`specjax.loadbench` instead.)

Runs are interleaved (ours, HF, ours, HF, ...) and medians reported, because timings on small
shared machines drift 20-40% between runs. The roofline is weight bytes over a bandwidth
measured here, with the same kind of program a decode step is (a jitted matrix-vector product
over a DRAM-resident matrix).
"""

from __future__ import annotations

import json
import resource
import statistics
import sys
import time

import jax
import jax.numpy as jnp
from flax import nnx

SYNTHETIC_PROMPT = (
    "The history of computing is a story of abstractions. Early machines were programmed by "
    "rewiring panels; then came stored programs, assemblers and compilers. Each layer hid the "
    "details of the one below, so that people could think about problems instead of hardware. "
    "Write a short essay on why abstraction matters in software engineering, with examples."
)


def measure_bandwidth(mib: int = 512, repeats: int = 7) -> float:
    """Bytes/s of a jitted fp32 matrix-vector product over a `mib`-MiB matrix (median)."""
    cols = 4096
    rows = mib * (1 << 20) // 4 // cols
    w = jnp.ones((rows, cols), jnp.float32) * 1e-3
    x = jnp.ones((cols,), jnp.float32)
    f = jax.jit(lambda w, x: w @ x)
    jax.block_until_ready(f(w, x))
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(f(w, x))
        ts.append(time.perf_counter() - t0)
    return w.nbytes / statistics.median(ts)


def window_costs(model, cache_len: int = 384, at: int = 200, windows=(1, 5, 9), repeats: int = 20):
    """Median ms of one jitted forward over T new tokens at a fixed cache length, per T."""
    from specjax.models.kv_cache import KVCache

    graphdef, params = nnx.split(model)

    @jax.jit
    def fwd(params, tokens, positions, cache):
        out = nnx.merge(graphdef, params)(tokens, positions, cache)
        return out.logits, out.cache

    cache = KVCache.zeros(model.config, 1, cache_len)
    res = {}
    for t in windows:
        toks = jnp.ones((1, t), jnp.int32)
        pos = at + jnp.arange(t, dtype=jnp.int32)[None]
        jax.block_until_ready(fwd(params, toks, pos, cache))
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(fwd(params, toks, pos, cache))
            ts.append(time.perf_counter() - t0)
        res[t] = statistics.median(ts) * 1e3
    return res


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _hf_model(source: str):
    import pathlib

    import torch
    import transformers

    path = pathlib.Path(source)
    kw = dict(dtype=torch.float32)
    if path.is_file():
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, **kw)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path), **kw)
    return model.eval()


def _hf_generate(model, ids: list[int], max_new: int) -> tuple[list[int], float]:
    import torch

    x = torch.tensor([ids])
    # no EOS stopping (ours runs with stop_ids=()): min_new_tokens would instead mask EOS out
    model.generation_config.eos_token_id = None
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new,
                             do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist(), time.perf_counter() - t0


def is_load_test(args) -> bool:
    """Whether the arguments ask for the load test (`specjax.loadbench`) rather than the roofline."""
    return bool(args.prompts_file or args.concurrency or args.rate is not None
                or args.methods.strip() != "none")


def main(args) -> int:
    """`specjax bench`: the load test when prompts, methods or concurrency are given, else plain
    decoding against HF transformers and the roofline on a synthetic prompt."""
    if is_load_test(args):
        from specjax import loadbench

        return loadbench.main(args)
    from specjax.engine import Engine, GenerateOptions
    from specjax.models import loader

    opts = GenerateOptions(max_new_tokens=args.max_new_tokens, stop_ids=None if args.chat else ())
    opts.validate()
    args.repeats = 3 if args.repeats is None else args.repeats
    if args.repeats < 1:
        raise ValueError(f"--repeats={args.repeats}: must be >= 1")
    engine = Engine.load(args.model, dtype=args.dtype)
    lm_model, name = engine.model, engine.config.name
    ids = engine.encode([SYNTHETIC_PROMPT], chat=args.chat)
    print(f"model {name}, {args.max_new_tokens} new tokens, greedy, batch 1", file=sys.stderr)

    from specjax.models import registry

    bw = measure_bandwidth()
    wbytes = loader.weight_bytes(lm_model)
    roofline = bw / wbytes
    windows = window_costs(lm_model)
    ours: list[dict] = []
    hf: list[dict] = []
    hf_model = None
    peak_ours = None
    for rep in range(args.repeats):
        for i, x in enumerate(ids):
            r = engine.start([x], opts).run()[0]
            ours.append(dict(rep=rep, prompt=i, tok_s=r.tok_per_s, ttft_s=r.ttft_s,
                             compile_s=r.compile_s, tokens=r.tokens, wall_s=r.wall_s))
        if peak_ours is None:
            peak_ours = _peak_rss_bytes()
        if args.no_hf:
            continue
        if hf_model is None:
            try:
                hf_model = _hf_model(str(registry.resolve(args.model)))
            except ImportError:
                print("HF transformers not installed (pip install -e '.[oracle]'); skipping it",
                      file=sys.stderr)
                args.no_hf = True
                continue
        for i, x in enumerate(ids):
            toks, wall = _hf_generate(hf_model, x, args.max_new_tokens)
            hf.append(dict(rep=rep, prompt=i, tok_s=len(toks) / wall, tokens=toks))

    med = lambda rows, k: statistics.median(r[k] for r in rows) if rows else float("nan")
    record = {
        "model": name, "prompts": len(ids), "prompt_tokens": [len(x) for x in ids],
        "max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
        "ours_tok_s": med(ours, "tok_s"), "ours_ttft_s": med(ours, "ttft_s"),
        "ours_compile_s": max(r["compile_s"] for r in ours),
        "hf_tok_s": med(hf, "tok_s"),
        "bandwidth_gb_s": bw / 1e9, "weight_bytes": wbytes, "roofline_tok_s": roofline,
        "window_ms": windows, "peak_rss_bytes_ours": peak_ours,
    }
    record["ratio_vs_hf"] = record["ours_tok_s"] / record["hf_tok_s"] if hf else None
    record["fraction_of_roofline"] = record["ours_tok_s"] / roofline
    if hf:
        same = [o["tokens"] == h["tokens"] for o, h in zip(ours, hf)]
        record["greedy_identical_to_hf"] = f"{sum(same)}/{len(same)}"
    print(_markdown(record))
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(record, f, indent=1)
    return 0


def _markdown(r: dict) -> str:
    w = r["window_ms"]
    rows = [
        ("ours tok/s (median)", f"{r['ours_tok_s']:.1f}"),
        ("HF transformers tok/s (median)", f"{r['hf_tok_s']:.1f}"),
        ("ratio ours / HF", f"{r['ratio_vs_hf']:.2f}x" if r["ratio_vs_hf"] else "n/a"),
        ("measured bandwidth", f"{r['bandwidth_gb_s']:.1f} GB/s"),
        ("roofline (bandwidth / weight bytes)", f"{r['roofline_tok_s']:.1f} tok/s "
                                                f"({r['weight_bytes'] / 1e6:.0f} MB of weights)"),
        ("fraction of roofline", f"{100 * r['fraction_of_roofline']:.0f}%"),
        ("time to first token", f"{r['ours_ttft_s'] * 1e3:.0f} ms"),
        ("compile time", f"{r['ours_compile_s']:.1f} s"),
        ("forward ms, 1 / 5 / 9 new tokens", " / ".join(f"{w[t]:.1f}" for t in sorted(w))),
        ("5-token / 1-token forward", f"{w[5] / w[1]:.2f}x"),
        ("9-token / 1-token forward", f"{w[9] / w[1]:.2f}x"),
        ("peak RSS (ours, before HF loads)", f"{r['peak_rss_bytes_ours'] / 2**30:.2f} GiB"),
    ]
    if "greedy_identical_to_hf" in r:
        rows.append(("greedy tokens identical to HF", r["greedy_identical_to_hf"]))
    return "| metric | value |\n|---|---|\n" + "\n".join(f"| {a} | {b} |" for a, b in rows)
