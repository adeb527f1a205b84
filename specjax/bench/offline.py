"""`specjax bench`: offline, side by side in one run: the plain loop and each speculative method.

Every prompt (batches of `--batch-size`) runs with every method back to back, so drift on a busy
machine spreads over all of them, and each method's tok/s is compared with the plain loop's on the
same prompts in the same run (`speedup_vs_none`), per task class and overall. Compile time is
excluded from tok/s and reported apart. Greedy outputs are checked against the plain loop's.

Beside it: the memory roofline (weight bytes over a bandwidth measured here with the same kind of
program a decode step is, a jitted matrix-vector product over a DRAM-resident matrix), the cost of
1/5/9-token forwards, and with `--hf` HF transformers' plain greedy loop on the same prompts.
The load test (a scheduler under concurrency) is the other subcommand, `specjax loadbench`.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.methods.registry import RECORDS

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
    graphdef, params = nnx.split(model)

    @jax.jit
    def fwd(params, tokens, positions, cache):
        out = nnx.merge(graphdef, params)(tokens, positions, cache)
        return out.logits, out.cache

    cache = model.init_cache(1, cache_len)
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


# and for a method with tuned settings, its tuned tree: eagle-tree is eagle with its dynamic tree
OFFLINE_METHODS = ("none", *RECORDS, *(f"{m}-tree" for m, r in RECORDS.items() if r.tuned is not None))


def run(engine, prompts, specs: dict, opts, *, chat: bool = False, batch_size: int = 1, repeats: int = 1,
        progress: bool = True) -> list[dict]:
    """One row per (repeat, method, prompt): tokens, tau, times, counters. Methods are interleaved."""
    from tqdm import tqdm

    rows = []
    kw = dataclasses.asdict(opts)
    with tqdm(total=repeats * len(specs) * len(prompts), desc="bench", unit="prompt", file=sys.stderr,
              disable=not progress) as bar:
        for rep in range(repeats):
            for i in range(0, len(prompts), batch_size):
                part = prompts[i:i + batch_size]
                for m, spec in specs.items():
                    bar.set_postfix_str(m)
                    predicted = [p.prediction for p in part]
                    res = engine.generate([p.text for p in part], chat=chat, batch_size=batch_size, spec=spec,
                                          prediction=predicted if any(x is not None for x in predicted) else None,
                                          **kw)
                    rows += [dict(method=m, rep=rep, id=p.id, task=p.task, tokens=r.tokens,
                                  new_tokens=r.new_tokens, forwards=r.target_forwards, wall_s=r.wall_s,
                                  ttft_s=r.ttft_s, compile_s=r.compile_s, counters=r.counters,
                                  prediction=r.prediction)
                             for p, r in zip(part, res)]
                    bar.update(len(part))
    return rows


def summarize(rows: list[dict], *, greedy: bool = True) -> list[dict]:
    """Per (method, task class and "all"): tau, tok/s, speedup over none on the same prompts,
    time to first token, compile time, acceptance per draft position, identity with none."""
    from specjax import telemetry

    tasks = sorted({str(r["task"]) for r in rows if r["task"] is not None})
    base = {(r["rep"], r["id"]): r for r in rows if r["method"] == "none"}
    out = []
    for m in dict.fromkeys(r["method"] for r in rows):
        for t in ["all"] + tasks:
            sel = [r for r in rows if r["method"] == m and (t == "all" or str(r["task"]) == t)]
            ref = [base[(r["rep"], r["id"])] for r in sel]
            tok_s = sum(r["new_tokens"] for r in sel) / sum(r["wall_s"] for r in sel)
            ref_tok_s = sum(r["new_tokens"] for r in ref) / sum(r["wall_s"] for r in ref)
            c = telemetry.aggregate(r["counters"] for r in sel)
            same = sum(r["tokens"] == x["tokens"] for r, x in zip(sel, ref))
            out.append(dict(
                method=m, task=t, prompts=len(sel),
                tau=sum(r["new_tokens"] - 1 for r in sel) / max(1, sum(r["forwards"] for r in sel)),
                tok_s=tok_s, speedup_vs_none=tok_s / ref_tok_s,
                ttft_p50_s=statistics.median(r["ttft_s"] for r in sel),
                compile_s=max(r["compile_s"] for r in sel), new_tokens=sum(r["new_tokens"] for r in sel),
                accepted_tokens_per_pos=c.accepted_tokens_per_pos,
                draft_acceptance_rate=c.draft_acceptance_rate,
                greedy_identical_n=same if greedy else None))
    return out


def roofline(model) -> dict:
    """Bandwidth measured here, the weights' bytes, the tok/s they allow, and 1/5/9-token forward costs."""
    from specjax.models import loader

    bw = measure_bandwidth()
    wbytes = loader.weight_bytes(model)
    return dict(bandwidth_gb_s=bw / 1e9, weight_bytes=wbytes, roofline_tok_s=bw / wbytes,
                window_ms=window_costs(model))


def memory(engine, prompts, specs: dict, opts, *, chat: bool, batch_size: int):
    """The `specjax.memory.Report` (bytes per device of the weights, the draft's and the KV caches)
    of the largest batch this bench runs, from the layout (`specjax.sharding.memory_report`; equal to
    what the placed arrays hold)."""
    from specjax import sharding

    longest = max(len(x) for x in engine.encode([p.text for p in prompts], chat=chat))
    bucket = engine.bucket_for(longest)
    decoders = [engine.build_decoder(s, prompt_bucket=bucket, max_new_tokens=opts.max_new_tokens)[0]
                for s in specs.values()]
    dec = max(decoders, key=lambda d: (d.cache_length, d.window))
    return sharding.memory_report(engine, batch=engine.rows_for(batch_size), cache_length=dec.cache_length,
                                  window=dec.window)


def hf_baseline(model: str, engine, prompts, opts, rows, *, chat: bool) -> dict:
    """HF transformers' greedy loop on the same prompts (batch 1), against our plain loop's tokens;
    `model` is a registry name or path."""
    from specjax.models import catalog

    try:
        hf_model = _hf_model(str(catalog.resolve(model)))
    except ImportError:
        raise ValueError("--hf needs HF transformers: pip install -e '.[oracle]'") from None
    ids = engine.encode([p.text for p in prompts], chat=chat)
    ours = {r["id"]: r["tokens"] for r in rows if r["method"] == "none" and r["rep"] == 0}
    toks, walls, same = 0, 0.0, 0
    for p, x in zip(prompts, ids):
        out, wall = _hf_generate(hf_model, x, opts.max_new_tokens)
        toks, walls = toks + len(out), walls + wall
        same += out == ours[p.id][: len(out)]
    return dict(hf_tok_s=toks / walls, greedy_identical_to_hf=f"{same}/{len(prompts)}")


def markdown(records: list[dict]) -> str:
    head = ("| method | task | prompts | tau | tok/s | speedup vs none | TTFT p50 | compile | accepted per "
            "position | identical |\n|---|---|---|---|---|---|---|---|---|---|\n")
    rows = [f"| {r['method']} | {r['task']} | {r['prompts']} | {r['tau']:.2f} | {r['tok_s']:.1f} | "
            f"{r['speedup_vs_none']:.2f}x | {r['ttft_p50_s'] * 1e3:.0f} ms | {r['compile_s']:.1f} s | "
            f"{r['accepted_tokens_per_pos'] or ''} | {r['greedy_identical_n']}/{r['prompts']} |"
            for r in records]
    return head + "\n".join(rows)


def roofline_markdown(r: dict) -> str:
    """`roofline`'s bandwidth and forward costs, with the fraction, memory and HF rows the CLI adds,
    as a table."""
    w = r["window_ms"]
    rows = [
        ("measured bandwidth", f"{r['bandwidth_gb_s']:.1f} GB/s"),
        ("roofline (bandwidth / weight bytes)", f"{r['roofline_tok_s']:.1f} tok/s "
                                                f"({r['weight_bytes'] / 1e6:.0f} MB of weights)"),
        ("plain loop, fraction of roofline", "n/a (batch > 1)" if r["fraction_of_roofline"] is None
         else f"{100 * r['fraction_of_roofline']:.0f}%"),
        ("forward ms, 1 / 5 / 9 new tokens", " / ".join(f"{w[t]:.1f}" for t in sorted(w))),
        ("5-token / 1-token forward", f"{w[5] / w[1]:.2f}x"),
        ("9-token / 1-token forward", f"{w[9] / w[1]:.2f}x"),
    ]
    mem = r.get("memory_per_device")
    if mem:
        rows.append((f"memory per device, mesh {mem.mesh}: {' / '.join(mem.parts)}",
                     " / ".join(f"{v / 2**20:.2f} MiB" for v in mem.parts.values())))
    if "hf_tok_s" in r:
        rows += [("HF transformers tok/s (plain, batch 1)", f"{r['hf_tok_s']:.1f}"),
                 ("greedy tokens identical to HF", r["greedy_identical_to_hf"])]
    return "| metric | value |\n|---|---|\n" + "\n".join(f"| {a} | {b} |" for a, b in rows)
