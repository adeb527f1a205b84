"""The model's dense products in one place: weight layout, and the few-row CPU kernel.

A projection `x[..., K] -> y[..., N]` stores its weight in one of two layouts, a load-time decision
recorded in `ModelConfig.weight_layout`:
  "kn": `w[K, N]`, `y = x @ w` (what the accelerators' GEMMs like; the default).
  "nk": `w[N, K]` (each output's weights contiguous; also how HF and GGUF store them), used on CPU
        where it feeds `specjax_dense_nk`, a small C++ kernel behind `jax.ffi` that streams each
        weight row once for all M rows of a verify window. XLA:CPU's own GEMM packs the weight on
        every call, so a 5-row product cost 2-4x a 1-row one although both read the same bytes
        (docs/BENCHMARKS.md, "The verify window on CPU").

`dense` is the one product every projection of the model goes through (`dense_many` for several
weights that read the same input: q/k/v and gate/up are one kernel call each, with the work of all
of them split over the threads). The kernel is built with the
machine's C++ compiler on first use (cached per machine under `~/.cache/specjax/kernels`; build it
ahead with `python -m specjax.models.linear`) and used only where it applies: a CPU backend, fp32,
no mesh in context, `KERNEL_MIN_ROWS` to `KERNEL_MAX_ROWS` rows. Everywhere else, and when it cannot
be built (no compiler: the reason is logged once) or `SPECJAX_DENSE_KERNEL=0`, the same product is
XLA's dot.
Both give the reference `x @ w` to fp32 rounding (tests/test_linear.py).

A GGUF weight loaded packed (`quant.PackedWeight`, `load(..., weights="packed")`) goes to a second
kernel, `specjax_qdense_nk` (qdense_nk.cc, built after dense_nk.cc in one library), for 1 to
`KERNEL_MAX_ROWS` rows: it rebuilds the weights exactly as gguf does (AVX-512: 16 at a time, in registers
for up to 3 rows, else once per block of weight rows into a small fp32 scratch; AVX2: 8 at a time for
Q4_0/Q4_1/Q8_0, the same way, else a block at a time, into the scratch) and multiplies them in
dense_nk's tiles, so its product is dense_nk's on the dequantized weight bit for bit, and a row is the
same alone as in a window (tests/test_quant.py). Elsewhere the packed weight is dequantized in the graph
and multiplied as above. A packed weight whose `arith` is "q8" (`ModelConfig.weights_arith`) is
multiplied in llama.cpp's arithmetic instead, at every row count: the same kernel's integer path, or
`quant.q8_product` in the graph (tests/test_quant_q8.py).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import pathlib
import platform
import shutil
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp

from specjax.models import quant

LAYOUTS = ("kn", "nk")
KERNEL_MIN_ROWS = 2  # one row is a matrix-vector product: XLA's own is at least as fast (measured)
# 17 and 33 rows (tree windows) measured faster in the kernel than XLA's GEMM on either layout (issue 21);
# prefill (a bucket of 64+ rows per prompt) stays with XLA
KERNEL_MAX_ROWS = 33
MAX_PARTS = 4  # weights one kernel call takes (`dense_many`)
_SOURCE = pathlib.Path(__file__).with_name("dense_nk.cc")
_SYMBOL = "specjax_dense_nk"  # the handler dense_nk.cc exports
_TARGET = _SYMBOL  # the FFI target `dense` calls (`kernel_target` swaps it in benchmarks)
_MULTI = True  # whether _TARGET takes several weights per call (an older kernel's did not)
_log = logging.getLogger(__name__)


def check_layout(layout: str) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"weight_layout={layout!r}: use 'kn' (w[K, N]) or 'nk' (w[N, K])")
    return layout


def shape(k: int, n: int, layout: str) -> tuple[int, int]:
    """The stored shape of a `K -> N` projection's weight."""
    return (k, n) if check_layout(layout) == "kn" else (n, k)


def axes(k_axis, n_axis, layout: str) -> tuple:
    """Its logical axes (`specjax.sharding.RULES`), in stored order."""
    return (k_axis, n_axis) if check_layout(layout) == "kn" else (n_axis, k_axis)


def to_layout(w, layout: str):
    """A `[K, N]` weight (the loaders' canonical form) as stored in `layout` (a view where it can be)."""
    return w if check_layout(layout) == "kn" else w.T


def as_rows(w, layout: str):
    """A stored weight as `[N, K]` rows (an LM head's token rows), whatever the layout."""
    return w.T if check_layout(layout) == "kn" else w


def preferred_layout(backend: str | None = None, dtype: str = "float32") -> str:
    """The layout a model loaded now should store: "nk" for fp32 on CPU when the kernel is
    available, "kn" elsewhere (GPU/TPU GEMMs; and XLA:CPU's own dot on `[N, K]`, measured faster
    for one row but slower for a window than on `[K, N]`)."""
    backend = backend or jax.default_backend()
    return "nk" if backend == "cpu" and str(dtype) == "float32" and kernel_available() else "kn"


# ---- the product ----------------------------------------------------------------------------------


def _check(x, w, layout: str):
    if w.ndim != 2 or w.shape[0 if check_layout(layout) == "kn" else 1] != x.shape[-1]:
        raise ValueError(f"dense: x {tuple(x.shape)} and a {layout!r} weight {tuple(w.shape)} do not "
                         f"contract (K={x.shape[-1]}; 'kn' stores [K, N], 'nk' stores [N, K])")


def _rows(x) -> int:
    m = 1
    for d in x.shape[:-1]:
        m *= d
    return m


def dense(x, w, layout: str):
    """`x[..., K]` times a stored weight (`w[K, N]` for "kn", `w[N, K]` for "nk") -> `[..., N]`.
    `w` may be a `quant.PackedWeight` (GGUF blocks, `[N, K]` whatever `layout`): multiplied by the
    packed kernel where it applies (`_use_packed_kernel`), else dequantized in the graph first."""
    if isinstance(w, quant.PackedWeight):
        return _dense_packed(x, w, layout)
    _check(x, w, layout)
    if layout == "kn":
        return x @ w
    lead, k, m = x.shape[:-1], x.shape[-1], _rows(x)
    if _use_kernel(m, x, w):
        return _kernel_products(x.reshape(m, k), (w,))[0].reshape(*lead, w.shape[0])
    return jnp.einsum("...k,nk->...n", x, w)


def dense_many(x, ws, layout: str) -> tuple:
    """`tuple(dense(x, w, layout) for w in ws)`: the products of one input with several weights (q/k/v,
    gate/up). Where the kernel applies they are one call (up to `MAX_PARTS` weights), whose work is
    split over the threads as one product's: the same results as separate calls, bit for bit, without
    storing the weights concatenated (the params, loaders and mesh layout do not notice). Packed
    weights of one block type and arithmetic are one call of the packed kernel alike."""
    ws = tuple(ws)
    if any(isinstance(w, quant.PackedWeight) for w in ws):
        return _dense_packed_many(x, ws, layout)
    for w in ws:
        _check(x, w, layout)
    lead, k, m = x.shape[:-1], x.shape[-1], _rows(x)
    if (layout == "nk" and _MULTI and 1 < len(ws) <= MAX_PARTS and all(_use_kernel(m, x, w) for w in ws)):
        ys = _kernel_products(x.reshape(m, k), ws)
        return tuple(y.reshape(*lead, w.shape[0]) for y, w in zip(ys, ws))
    return tuple(dense(x, w, layout) for w in ws)


def _dense_packed(x, w, layout: str):
    n, k = w.shape
    if x.shape[-1] != k:
        raise ValueError(f"dense: x {tuple(x.shape)} and a packed {w.qtype} weight [N={n}, K={k}] do not contract")
    lead, m = x.shape[:-1], _rows(x)
    # q8: the kernel for every product of the weight whatever its rows (decode, verify, prefill): one
    # arithmetic (the K-quant types, exact in q8, too: XLA's dot would round a row differently with
    # the rows beside it, and q8's 8-bit activations downstream turn that ulp into another token)
    q8 = w.arith == "q8" and w.qtype in quant.Q8_TYPES
    if _use_packed_kernel(m, x, any_rows=w.arith == "q8"):
        return qdense_nk_kernel(x.reshape(m, k), w.blocks, w.qtype, w.shape, arith="q8" if q8 else "exact"
                                ).reshape(*lead, n)
    if q8:
        return quant.q8_product(x.reshape(m, k).astype(jnp.float32), w).astype(x.dtype).reshape(*lead, n)
    dq = w.dequantize()
    return dense(x, dq if check_layout(layout) == "nk" else dq.T, layout)


def _dense_packed_many(x, ws, layout: str) -> tuple:
    """`dense_many` where some weights are packed: one kernel call where all are of one block type and
    arithmetic and the kernel takes them (as `_dense_packed` would each), else one product each."""
    first = ws[0]
    same = all(isinstance(w, quant.PackedWeight) and (w.qtype, w.arith, w.shape[1]) ==
               (first.qtype, first.arith, first.shape[1]) for w in ws)
    if not (same and 1 < len(ws) <= MAX_PARTS and x.shape[-1] == first.shape[1]):
        return tuple(dense(x, w, layout) for w in ws)
    lead, m = x.shape[:-1], _rows(x)
    q8 = first.arith == "q8" and first.qtype in quant.Q8_TYPES
    if not _use_packed_kernel(m, x, any_rows=first.arith == "q8"):
        return tuple(dense(x, w, layout) for w in ws)
    ys = qdense_nk_kernels(x.reshape(m, x.shape[-1]), [w.blocks for w in ws], first.qtype, [w.shape for w in ws],
                           arith="q8" if q8 else "exact")
    return tuple(y.reshape(*lead, w.shape[0]) for y, w in zip(ys, ws))


def _use_packed_kernel(m: int, x, any_rows: bool = False) -> bool:
    """One row too (the alternative writes the whole fp32 weight first); 1 to `KERNEL_MAX_ROWS` rows
    (`any_rows`: any count, for q8 arithmetic, which has no XLA equivalent on CPU), fp32, CPU, no mesh. A
    row's sums run in the same order for every row count."""
    if not (1 <= m <= KERNEL_MAX_ROWS or (any_rows and m >= 1)) or x.dtype != jnp.float32:
        return False
    from specjax import sharding

    return jax.default_backend() == "cpu" and not sharding.active() and packed_kernel_available()


def _use_kernel(m: int, x, w) -> bool:
    if not KERNEL_MIN_ROWS <= m <= KERNEL_MAX_ROWS or x.dtype != jnp.float32 or w.dtype != jnp.float32:
        return False
    from specjax import sharding  # a mesh partitions XLA's dot; a custom call it could only gather

    return jax.default_backend() == "cpu" and not sharding.active() and kernel_available()


@jax.custom_vjp
def _kernel_products(x, ws):
    return dense_nk_kernels(x, ws)


def _kernel_fwd(x, ws):
    return dense_nk_kernels(x, ws), (x, ws)


def _kernel_bwd(res, dys):
    x, ws = res
    dx = sum(dy @ w for dy, w in zip(dys, ws))
    return dx, tuple(dy.T @ x for dy in dys)


_kernel_products.defvjp(_kernel_fwd, _kernel_bwd)


def dense_nk_kernel(x, w):
    """`x[M, K] @ w[N, K].T` through the C++ kernel (fp32, CPU); raises if it is not available."""
    return dense_nk_kernels(x, (w,))[0]


def dense_nk_kernels(x, ws) -> tuple:
    """`x[M, K] @ w[N_i, K].T` for each of 1..`MAX_PARTS` weights, one kernel call."""
    ws = tuple(ws)
    if not 1 <= len(ws) <= MAX_PARTS:
        raise ValueError(f"specjax_dense_nk: takes 1 to {MAX_PARTS} weights; got {len(ws)}")
    for w in ws:
        if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1]:
            raise ValueError(f"specjax_dense_nk: needs x [M, K] and w [N, K] with the same K; got x "
                             f"{tuple(x.shape)} and w {tuple(w.shape)}")
        if x.dtype != jnp.float32 or w.dtype != jnp.float32:
            raise ValueError(f"specjax_dense_nk: fp32 only; got x {x.dtype} and w {w.dtype} "
                             "(cast them, or use dense(), which falls back to XLA's dot)")
    if not kernel_available():
        raise RuntimeError(f"specjax_dense_nk is not available: {kernel_status()}")
    outs = [jax.ShapeDtypeStruct((x.shape[0], w.shape[0]), jnp.float32) for w in ws]
    return tuple(jax.ffi.ffi_call(_TARGET, outs, vmap_method="sequential")(x, *ws))


# ---- building and registering the kernel -----------------------------------------------------------

_STATUS: dict[str, str] = {}


def _disabled() -> bool:
    return os.environ.get("SPECJAX_DENSE_KERNEL", "1").strip().lower() in ("0", "false", "no", "off")


def _cache_dir() -> pathlib.Path:
    root = os.environ.get("SPECJAX_KERNEL_CACHE")
    if root:
        return pathlib.Path(root)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "specjax" / "kernels"


def _machine_tag() -> str:
    """The source, the compiler, jax's FFI headers and this CPU's features: a build is -march=native."""
    h = hashlib.sha256(_SOURCE.read_bytes())
    h.update(f"{platform.machine()} {jax.__version__} {_compiler() or ''}".encode())
    try:
        flags = [ln for ln in pathlib.Path("/proc/cpuinfo").read_text().splitlines()
                 if ln.startswith(("flags", "Features", "model name"))][:3]
        h.update("\n".join(flags).encode())
    except OSError:
        pass
    return h.hexdigest()[:16]


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")


def build(force: bool = False) -> pathlib.Path:
    """Compiles the kernel for this machine (cached); returns the shared library's path.

    Raises:
      RuntimeError: no C++ compiler, or it failed (its message included).
    """
    return _compile(_SOURCE.read_bytes(), _cache_dir() / f"dense_nk-{_machine_tag()}.so", force=force)


def _compile(source: bytes, out: pathlib.Path, *, force: bool = False, target: str = _SYMBOL,
             flags: tuple[str, ...] = ()) -> pathlib.Path:
    """`source` (a version of dense_nk.cc) built into `out`, its handler exported as `target`;
    `flags`: more compiler flags."""
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (g++, c++ or clang++; or set CXX)")
    if out.exists() and not force:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    march = ["-march=native"] if platform.machine() in ("x86_64", "AMD64") else ["-mcpu=native"]
    rename = [] if target == _SYMBOL else [f"-D{_SYMBOL}={target}"]
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        src = pathlib.Path(tmp) / _SOURCE.name
        src.write_bytes(source)
        tmp_out = pathlib.Path(tmp) / out.name
        cmd = [cxx, "-O3", *march, "-std=c++17", "-shared", "-fPIC", "-w", f"-I{jax.ffi.include_dir()}", *rename, *flags,
               str(src), "-o", str(tmp_out)]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0 and march:  # a compiler without -march/-mcpu=native: the portable build
            cmd = [c for c in cmd if c not in march]
            res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"compiling {_SOURCE.name} failed:\n{res.stderr.strip()[-2000:]}")
        os.replace(tmp_out, out)  # atomic: concurrent builders each install a complete library
    return out


def register_variant(source: bytes, target: str) -> str:
    """Builds another version of dense_nk.cc (e.g. an older commit's, for an interleaved A/B timing)
    and registers it as FFI target `target`; `kernel_target(target)` then routes `dense` to it."""
    tag = hashlib.sha256(source + _machine_tag().encode() + target.encode()).hexdigest()[:16]
    import ctypes

    lib = ctypes.cdll.LoadLibrary(str(_compile(source, _cache_dir() / f"{target}-{tag}.so", target=target)))
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, target)), platform="cpu")
    return target


@contextlib.contextmanager
def kernel_target(target: str, multi: bool = False):
    """Traces `dense` with the kernel registered as `target` (benchmarks only); `multi`: it takes
    several weights per call (`dense_many`), else those become one call per weight."""
    global _TARGET, _MULTI
    old, _TARGET, _MULTI = (_TARGET, _MULTI), target, multi
    try:
        yield
    finally:
        _TARGET, _MULTI = old


def _load_kernel(symbol: str, library, key: str, fallback: str) -> bool:
    """Builds `library()` and registers its `symbol` as an XLA FFI target; the outcome in `_STATUS[key]`."""
    if _disabled():
        _STATUS[key] = "disabled by SPECJAX_DENSE_KERNEL=0"
        return False
    try:
        import ctypes

        lib = ctypes.cdll.LoadLibrary(str(library()))
        jax.ffi.register_ffi_target(symbol, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    except Exception as e:  # noqa: BLE001 - any failure means: the fallback
        _STATUS[key] = f"{type(e).__name__}: {e}"
        _log.warning("specjax: %s is unavailable, %s (%s)", symbol, fallback, _STATUS[key])
        return False
    _STATUS[key] = "built and registered"
    return True


@functools.cache
def _register() -> bool:
    return _load_kernel(_SYMBOL, build, "reason", "using XLA's dot")


def kernel_available() -> bool:
    """Whether `specjax_dense_nk` is built and registered (builds it on the first call)."""
    return not _disabled() and _register()


def kernel_status() -> str:
    """Why the kernel is or is not in use, in words."""
    kernel_available()
    return "disabled by SPECJAX_DENSE_KERNEL=0" if _disabled() else _STATUS.get("reason", "not built")


# ---- the packed-weight kernel (qdense_nk.cc) ------------------------------------------------------

_QSOURCE = pathlib.Path(__file__).with_name("qdense_nk.cc")
_QSYMBOL = "specjax_qdense_nk"
QTYPE_CODES = {"Q4_0": 0, "Q4_1": 1, "Q5_0": 2, "Q5_1": 3, "Q8_0": 4, "Q4_K": 5, "Q5_K": 6, "Q6_K": 7}


def build_packed(force: bool = False) -> pathlib.Path:
    """Compiles qdense_nk.cc (after dense_nk.cc, one translation unit) for this machine (cached)."""
    source = _SOURCE.read_bytes() + b"\n" + _QSOURCE.read_bytes()
    tag = hashlib.sha256(source + _machine_tag().encode()).hexdigest()[:16]
    return _compile(source, _cache_dir() / f"qdense_nk-{tag}.so", force=force)


def register_packed_variant(target: str, flags: tuple[str, ...] = ()) -> str:
    """Builds qdense_nk.cc with more compiler `flags` (e.g. `-mno-avx512f`: the 8-lane AVX2 tile and
    the scalar dequantization) and registers its handler as FFI target `target`, for
    `qdense_nk_kernel(..., target=target)` (tests and A/B timings); the same library's dense_nk
    handler as `target + "_dense"`, for `kernel_target`."""
    import ctypes

    source = _SOURCE.read_bytes() + b"\n" + _QSOURCE.read_bytes()
    tag = hashlib.sha256(source + _machine_tag().encode() + target.encode() + " ".join(flags).encode()).hexdigest()[:16]
    out = _compile(source, _cache_dir() / f"{target}-{tag}.so", flags=(*flags, f"-D{_QSYMBOL}={target}"))
    lib = ctypes.cdll.LoadLibrary(str(out))
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, target)), platform="cpu")
    jax.ffi.register_ffi_target(target + "_dense", jax.ffi.pycapsule(getattr(lib, _SYMBOL)), platform="cpu")
    return target


@functools.cache
def _register_packed() -> bool:
    return _load_kernel(_QSYMBOL, build_packed, "packed", "dequantizing in the graph")


def packed_kernel_available() -> bool:
    """Whether `specjax_qdense_nk` is built and registered (builds it on the first call)."""
    return not _disabled() and _register_packed()


def packed_kernel_status() -> str:
    """Why the packed-weight kernel is or is not in use, in words."""
    packed_kernel_available()
    return "disabled by SPECJAX_DENSE_KERNEL=0" if _disabled() else _STATUS.get("packed", "not built")


_PACKED_TARGET = [_QSYMBOL]  # the build the products trace to (`packed_target`)


@contextlib.contextmanager
def packed_target(target: str | None):
    """Products traced inside call `target` (a `register_packed_variant` build; None: the default):
    an A/B of two builds of the kernel in one process."""
    old, _PACKED_TARGET[0] = _PACKED_TARGET[0], target or _QSYMBOL
    try:
        yield
    finally:
        _PACKED_TARGET[0] = old


def qdense_nk_kernel(x, blocks, qtype: str, shape: tuple[int, int], target: str | None = None,
                     arith: str = "exact"):
    """`x[M, K] @ W.T` for a GGUF weight `W[N, K]` given as its blocks (uint8 `[N, K / block * bytes]`,
    `specjax.models.quant`), through the C++ kernel: equal bit for bit to `dense_nk_kernel(x, W)` on the
    dequantized weight. `arith="q8"`: llama.cpp's arithmetic (`quant.q8_product`'s values up to summation
    order) for the `quant.Q8_TYPES`, exact for the others. Raises if it is not available. `target`: a build
    from `register_packed_variant`."""
    return qdense_nk_kernels(x, (blocks,), qtype, (shape,), target, arith)[0]


def qdense_nk_kernels(x, blocks, qtype: str, shapes, target: str | None = None, arith: str = "exact") -> tuple:
    """`qdense_nk_kernel` for 1..`MAX_PARTS` weights of one block type (`blocks[i]` of shape
    `shapes[i]`), one kernel call: x quantized once (q8), the work split over the threads as one
    product's; each result equals its own call bit for bit."""
    blocks, shapes = tuple(blocks), tuple(shapes)
    mode = ("exact", "q8").index(quant.check_arith(arith))
    if qtype not in QTYPE_CODES:
        raise ValueError(f"specjax_qdense_nk: block type {qtype} is not one of {', '.join(QTYPE_CODES)}")
    if not 1 <= len(blocks) == len(shapes) <= MAX_PARTS:
        raise ValueError(f"specjax_qdense_nk: takes 1 to {MAX_PARTS} weights, a shape each; got {len(blocks)} "
                         f"and {len(shapes)}")
    for b, (_, k) in zip(blocks, shapes):
        if x.ndim != 2 or x.shape[1] != k or x.dtype != jnp.float32 or b.dtype != jnp.uint8:
            raise ValueError(f"specjax_qdense_nk: needs fp32 x [M, {k}] and uint8 blocks; got x {x.dtype} "
                             f"{tuple(x.shape)}, blocks {b.dtype}")
    if not packed_kernel_available():
        raise RuntimeError(f"specjax_qdense_nk is not available: {packed_kernel_status()}")
    import numpy as np

    outs = [jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32) for n, _ in shapes]
    return tuple(jax.ffi.ffi_call(target or _PACKED_TARGET[0], outs, vmap_method="sequential")(
        x, *blocks, qtype=np.int32(QTYPE_CODES[qtype]), mode=np.int32(mode)))


if __name__ == "__main__":  # python -m specjax.models.linear: build ahead (e.g. right after install)
    try:
        print(build(force="--force" in sys.argv))
    except RuntimeError as e:
        print(f"not built ({e}); specjax will use XLA's dot", file=sys.stderr)
        sys.exit(1)
