"""What a K-token verify forward costs next to a 1-token decode step, per matmul and whole, beside
the memory and compute floors of this machine (`specjax bench --verify-profile`,
`python -m specjax.bench.experiments.verify_profile`).

A verify window of M rows reads the same weights as a decode step of one row; its extra FLOPs are M
times a step's, small next to the time the weights take to stream while M is small. So on hardware
where the products run at the memory floor, an M-row forward costs about one step; what this
measures is how close each formulation of the model's products gets:

  kn      `x @ w`, w stored [K, N] (XLA's dot; what GPU/TPU use)
  nk-xla  `einsum("mk,nk->mn")`, w stored [N, K] (XLA's dot on the transposed layout)
  nk      `specjax.models.linear.dense` on [N, K]: the few-row CPU kernel where it is built
  nk-kernel  the kernel itself at every M (one row included, where `dense` takes XLA's GEMV)
  nk@REV  `dense` on [N, K] with the kernel source of git revision REV (`baseline=`), built and
          registered beside the current one, so old and new kernels are timed interleaved

Per matmul, each product is timed in a chain over distinct copies of its weight (~64 MB of them,
twice a large L3), so the weights stream from memory as in a real forward rather than sitting in
cache. Timings are interleaved: every repetition runs every
(formulation, M) once in turn, so drift on a shared machine spreads over all of them; medians and
minima are reported, and the ratio to M = 1 of the same formulation.

Floors: memory = weight bytes / bandwidth measured here (a jitted sum or matrix-vector product
over a 512 MiB array, the better);
compute = 2 * M * weights / peak FLOP/s measured here (a 2048^3 fp32 matmul).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.models import config as model_config, families, linear

FORMS = ("kn", "nk-xla", "nk")
WINDOWS = (1, 4, 5, 9, 16)


# ---- floors -----------------------------------------------------------------------------------------


def _time(f, *args, repeats: int) -> list[float]:
    jax.block_until_ready(f(*args))
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        out.append(time.perf_counter() - t0)
    return out


def interleaved(calls: dict, repeats: int) -> dict[object, list[float]]:
    """Seconds of each `calls[key] = (f, args)` per round, `repeats` rounds, every call once a round,
    so that drift spreads over all of them (each call already compiled and warm)."""
    samples = {key: [] for key in calls}
    for _ in range(repeats):
        for key, (f, args) in calls.items():
            t0 = time.perf_counter()
            jax.block_until_ready(f(*args))
            samples[key].append(time.perf_counter() - t0)
    return samples


def alternating(arms, repeats: int, run) -> dict[object, list]:
    """`run(arm)` for every arm, `repeats` rounds, the order reversed every other round (whole runs
    of a host path, where `interleaved` times one jitted call)."""
    out = {a: [] for a in arms}
    for i in range(repeats):
        for a in (list(arms) if i % 2 == 0 else list(arms)[::-1]):
            out[a].append(run(a))
    return out


def measure_bandwidth(mib: int = 512, repeats: int = 9) -> float:
    """Read bandwidth, bytes/s: the better of a jitted fp32 sum over a `mib`-MiB array and a
    matrix-vector product over it (what a decode step is), best of `repeats` each."""
    a = jnp.full((mib * (1 << 20) // 4 // 4096, 4096), 1e-3, jnp.float32)
    v = jnp.ones((4096,), jnp.float32)
    t_sum = min(_time(jax.jit(jnp.sum), a, repeats=repeats))
    t_gemv = min(_time(jax.jit(jnp.matmul), a, v, repeats=repeats))
    return a.nbytes / min(t_sum, t_gemv)


def measure_peak(n: int = 2048, repeats: int = 5) -> float:
    """fp32 FLOP/s of XLA's GEMM on an n^3 product (best of `repeats`)."""
    a = jnp.full((n, n), 1e-3, jnp.float32)
    ts = _time(jax.jit(jnp.matmul), a, a, repeats=repeats)
    return 2 * n**3 / min(ts)


# ---- per matmul ---------------------------------------------------------------------------------------


def projections(config: model_config.ModelConfig) -> dict[str, tuple[int, int]]:
    """name -> (K, N) of every product of one forward (per layer, and the LM head)."""
    c = config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    return {"q": (c.dim, q), "k": (c.dim, kv), "v": (c.dim, kv), "o": (q, c.dim),
            "gate": (c.dim, c.ffn_dim), "up": (c.dim, c.ffn_dim), "down": (c.ffn_dim, c.dim),
            "lm_head": (c.dim, c.vocab_size)}


@contextlib.contextmanager
def _kernel(enabled):
    """Trace with the CPU kernel on or off (the XLA formulation of the same layout); a string: on,
    through that FFI target (a baseline's kernel, `baseline_target`)."""
    old = linear.KERNEL_MAX_ROWS
    linear.KERNEL_MAX_ROWS = _MAX_ROWS.get(enabled, old) if enabled else 0
    try:
        if isinstance(enabled, str):
            with linear.kernel_target(enabled, multi=_MULTI.get(enabled, False)):
                yield
        else:
            yield
    finally:
        linear.KERNEL_MAX_ROWS = old


_BASELINES: dict[str, str] = {}  # git revision -> the FFI target its kernel is registered as
_MULTI: dict[str, bool] = {}  # FFI target -> whether it takes several weights per call
_MAX_ROWS: dict[str, int] = {}  # FFI target -> the most rows its revision sent to it


def baseline_target(rev: str) -> str:
    """Builds models/dense_nk.cc as of git revision `rev` and registers it as its own FFI target,
    used as that revision used it (one call per weight if it took one; up to its row limit)."""
    import subprocess

    if rev in _BASELINES:
        return _BASELINES[rev]
    root = linear._SOURCE.resolve().parent
    src = subprocess.run(["git", "-C", str(root), "show", f"{rev}:models/dense_nk.cc"], capture_output=True,
                         check=True).stdout
    name = "specjax_dense_nk_" + "".join(c for c in rev if c.isalnum())
    _BASELINES[rev] = target = linear.register_variant(src, name)
    _MULTI[target] = b"RemainingArgs" in src
    import re

    lin = subprocess.run(["git", "-C", str(root), "show", f"{rev}:models/linear.py"], capture_output=True).stdout
    rows = re.search(rb"^KERNEL_MAX_ROWS = (\d+)", lin, re.M)
    if rows:  # that revision's routing: more rows went to XLA's dot
        _MAX_ROWS[target] = int(rows.group(1))
    return target


def _chain(form: str):
    """A jitted chain of one product per weight copy, each depending on the last (as layers do)."""
    def routed(target):
        def product(x, w):
            with _kernel(target):
                return linear.dense(x, w, "nk")
        return product

    if form.startswith("nk@"):
        product = routed(_BASELINES[form.split("@", 1)[1]])
    else:
        product = {"kn": lambda x, w: x @ w, "nk-xla": lambda x, w: jnp.einsum("mk,nk->mn", x, w),
                   "nk": lambda x, w: linear.dense(x, w, "nk"),
                   "nk-kernel": lambda x, w: linear.dense_nk_kernel(x, w)}[form]

    def f(x, ws):
        acc = jnp.zeros((), x.dtype)
        for w in ws:
            y = product(x + acc, w)
            acc = acc + y[0, 0] * 1e-30
        return acc

    return jax.jit(f)


def _copies(k: int, n: int, min_bytes: float = 64e6, cap: int = 64) -> int:
    """Weight copies in a timing chain: at least `min_bytes` of them, so they stream from memory."""
    return int(min(cap, max(1, math.ceil(min_bytes / (4 * k * n)))))


def matmul_profile(config, *, windows=WINDOWS, forms=FORMS, repeats: int = 15, names=None,
                   log=print) -> list[dict]:
    """Per product of `config`: ms per product at each M for each formulation (median and min)."""
    forms = [f for f in forms if not f.startswith("nk") or f == "nk-xla" or linear.kernel_available()]
    rows = []
    for name, (k, n) in projections(config).items():
        if names and name not in names:
            continue
        copies = _copies(k, n)
        rng = np.random.default_rng(0)
        base = rng.standard_normal((k, n), np.float32) * k**-0.5
        ws = {"kn": [jnp.asarray(base) for _ in range(copies)]}
        ws["nk"] = [jnp.asarray(base.T) for _ in range(copies)]
        fns = {}
        for form in forms:
            f = _chain(form)
            arrs = ws["kn" if form == "kn" else "nk"]
            for m in windows:
                x = jnp.asarray(rng.standard_normal((m, k), np.float32))
                fns[(form, m)] = (f, (x, arrs))
        for f, a in fns.values():  # compile
            jax.block_until_ready(f(*a))
        samples = {key: [] for key in fns}
        for _ in range(repeats):
            for key, (f, a) in fns.items():
                t0 = time.perf_counter()
                jax.block_until_ready(f(*a))
                samples[key].append((time.perf_counter() - t0) / copies)
        for form in forms:
            base1 = statistics.median(samples[(form, windows[0])])
            for m in windows:
                s = samples[(form, m)]
                rows.append(dict(matmul=name, K=k, N=n, form=form, M=m, ms=statistics.median(s) * 1e3,
                                 ms_min=min(s) * 1e3, ratio=statistics.median(s) / base1, bytes=4 * k * n))
        log(f"  {name} [{k} x {n}] x{copies}: " + "  ".join(
            f"{r['form']}@{r['M']} {r['ms']:.3f}" for r in rows if r["matmul"] == name))
        del ws, fns
        gc.collect()
    return rows


# ---- whole forward -----------------------------------------------------------------------------------


def constant_model(config):
    """A model of `config`'s shapes with constant weights (timing does not depend on values;
    cheap to make at 1.5B)."""
    abstract = nnx.eval_shape(lambda: families.build(config, nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    state = jax.tree.map(lambda v: jnp.full(v.shape, 0.02, v.dtype), state)
    return nnx.merge(graphdef, state)


def forward_profile(models: dict, *, windows=WINDOWS, repeats: int = 15, cache_len: int = 384,
                    at: int = 200) -> list[dict]:
    """Whole jitted forwards (logits for all T rows, as verify computes them) at a fixed cache length:
    ms per T for each named model variant, interleaved over variants and T."""

    fns = {}
    for label, (model, kernel) in models.items():
        graphdef, params = nnx.split(model)

        def fwd(params, tokens, positions, cache, graphdef=graphdef):
            out = nnx.merge(graphdef, params)(tokens, positions, cache)
            return out.logits, out.cache

        with _kernel(kernel):
            f = jax.jit(fwd)
            cache = model.init_cache(1, cache_len)
            for t in windows:
                toks = jnp.ones((1, t), jnp.int32)
                pos = at + jnp.arange(t, dtype=jnp.int32)[None]
                jax.block_until_ready(f(params, toks, pos, cache))  # compiles under the switch
                fns[(label, t)] = (f, (params, toks, pos, cache))
    samples = interleaved(fns, repeats)
    rows = []
    for label in models:
        one = statistics.median(samples[(label, windows[0])])
        for t in windows:
            s = samples[(label, t)]
            rows.append(dict(variant=label, T=t, ms=statistics.median(s) * 1e3, ms_min=min(s) * 1e3,
                             ratio=statistics.median(s) / one))
    return rows


# ---- the report ---------------------------------------------------------------------------------------


def profile(preset: str, *, windows=WINDOWS, repeats: int = 15, forward: bool = True, matmuls: bool = True,
            names=None, bw: float | None = None, peak: float | None = None, forms=FORMS,
            baseline: str | None = None, log=print) -> dict:
    """Per-matmul and whole-forward costs of `preset`'s shapes (constant fp32 weights).

    `forms`: the per-matmul formulations (`FORMS`, "nk-kernel"); the forward always runs "kn", "nk"
    and, when "nk-xla" is among `forms`, that. `baseline`: a git revision whose kernel is timed as
    "nk@REV" beside them (per matmul and forward)."""
    windows = tuple(sorted(set(windows) | {1}))
    forms = list(forms)
    if baseline and linear.kernel_available():
        baseline_target(baseline)
        forms.append(f"nk@{baseline}")
    cfg = model_config.preset(preset, dtype="float32", param_dtype="float32")
    bw = bw or measure_bandwidth()
    peak = peak or measure_peak()
    log(f"{preset}: bandwidth {bw / 1e9:.1f} GB/s, peak {peak / 1e9:.0f} GFLOP/s, "
        f"kernel: {linear.kernel_status()}")
    rec = dict(model=preset, windows=list(windows), bandwidth_gbs=bw / 1e9, peak_gflops=peak / 1e9,
               kernel=linear.kernel_status(), matmuls=[], forward=[])
    if matmuls:
        rec["matmuls"] = matmul_profile(cfg, windows=windows, forms=forms, repeats=repeats, names=names, log=log)
        for r in rec["matmuls"]:
            r["mem_floor_ms"] = r["bytes"] / bw * 1e3
            r["flop_floor_ms"] = 2 * r["M"] * r["K"] * r["N"] / peak * 1e3
    if forward:
        # "kn" without the kernel is the formulation before it (x @ w, the tied head an einsum)
        big = families.num_params(cfg) * 4 > 2e9  # one layout at a time: two 1.5B fp32 copies may not fit
        variants = {"kn": ("kn", False), "nk-xla": ("nk", False), "nk": ("nk", True)}
        if big or "nk-xla" not in forms:
            del variants["nk-xla"]
        for f in forms:
            if f.startswith("nk@"):
                variants[f] = ("nk", _BASELINES[f[3:]])
        if not linear.kernel_available():
            variants = {"kn": ("kn", False)}
        groups = [[v] for v in variants] if big else [list(variants)]
        import psutil

        need = families.num_params(cfg) * 4 * (1.3 if big else 1.1 * len(variants))
        if psutil.virtual_memory().available < need:
            log(f"  forward skipped: {need / 2**30:.1f} GiB needed, "
                f"{psutil.virtual_memory().available / 2**30:.1f} GiB available")
            groups = []
        for group in groups:
            models = {v: (constant_model(dataclasses.replace(cfg, weight_layout=variants[v][0])), variants[v][1])
                      for v in group}
            rows = forward_profile(models, windows=windows, repeats=repeats)
            wbytes = families.num_params(cfg) * 4
            for r in rows:
                r["mem_floor_ms"] = wbytes / bw * 1e3
                r["flop_floor_ms"] = 2 * r["T"] * families.num_params(cfg) / peak * 1e3
            log("  forward " + "  ".join(f"{r['variant']}@{r['T']} {r['ms']:.1f}ms ({r['ratio']:.2f}x)" for r in rows))
            rec["forward"] += rows
            del models
            gc.collect()
    return rec


def markdown(rec: dict) -> str:
    w = rec["windows"]
    out = [f"**{rec['model']}** (fp32; bandwidth {rec['bandwidth_gbs']:.1f} GB/s, peak "
           f"{rec['peak_gflops']:.0f} GFLOP/s measured; kernel: {rec['kernel']})", ""]
    if rec["matmuls"]:
        out += ["Per matmul, ms per product (median), and the cost relative to M = 1 of the same form:", "",
                "| matmul [K x N] | form | " + " | ".join(f"M={m}" for m in w) + " | mem floor | flop floor M="
                + str(w[-1]) + " |", "|" + "---|" * (len(w) + 4)]
        by = {}
        for r in rec["matmuls"]:
            by.setdefault((r["matmul"], r["form"]), {})[r["M"]] = r
        for (name, form), rs in by.items():
            r0 = next(iter(rs.values()))
            cells = [f"{rs[m]['ms']:.3f} ({rs[m]['ratio']:.2f}x)" for m in w]
            out.append(f"| {name} [{r0['K']} x {r0['N']}] | {form} | " + " | ".join(cells)
                       + f" | {r0['mem_floor_ms']:.3f} | {rs[w[-1]]['flop_floor_ms']:.3f} |")
        out.append("")
    if rec["forward"]:
        out += ["Whole forward (logits for every row), ms (median) and x the 1-token forward:", "",
                "| layout | " + " | ".join(f"T={t}" for t in w) + " | mem floor | flop floor T=" + str(w[-1]) + " |",
                "|" + "---|" * (len(w) + 3)]
        by = {}
        for r in rec["forward"]:
            by.setdefault(r["variant"], {})[r["T"]] = r
        for v, rs in by.items():
            out.append(f"| {v} | " + " | ".join(f"{rs[t]['ms']:.1f} ({rs[t]['ratio']:.2f}x)" for t in w)
                       + f" | {rs[w[0]]['mem_floor_ms']:.1f} | {rs[w[-1]]['flop_floor_ms']:.1f} |")
        out.append("")
    return "\n".join(out)


def main(models, *, windows=WINDOWS, repeats: int = 15, forward: bool = True, matmuls: bool = True,
         names=None, json_path: str | None = None, forms=FORMS, baseline: str | None = None) -> list[dict]:
    import json

    bw, peak = measure_bandwidth(), measure_peak()
    recs = []
    for m in models:
        recs.append(profile(m, windows=windows, repeats=repeats, forward=forward, matmuls=matmuls,
                            names=names, bw=bw, peak=peak, forms=forms, baseline=baseline))
        print(markdown(recs[-1]), flush=True)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(recs, f, indent=1)
    return recs
