"""One attention layer's window (decode, verify, or a prefill bucket) on the CPU, through a small C++
kernel (attend_nk.cc).

XLA:CPU lowers the attention einsums over a `[B, S, Kv, H]` cache to dots that want the kv-head
axis in front, so every layer of every step wrote a transposed copy of K and of V and copied the
buffer again before updating it: at one token and a 640-slot cache, about 0.7 ms a layer around
~20 us of arithmetic (docs/BENCHMARKS.md, "The step, op by op"). `specjax_attend` reads the buffers in place,
after the forward's keys and values are written into them (so XLA needs no copy to keep a read
ahead of its in-place write), and only the slots each query sees: the committed context, cut to a
sliding window, and the window's own slots it sees. Its cost follows the context's length, not the
buffer's.

Used by `specjax.models.layers.attention.Attention` where it applies (`applies`): CPU, fp32, no mesh
in context, no scratch-context mask, up to `MAX_WINDOW` queries a row (every default prefill bucket),
full buffers and a sliding-window layer's ring alike (`ring=True`: slot s at entry s % Sr). A forward
that fits the ring beside the window (T <= Sr - W + 1: decode and verify windows) is read from the
ring after its writes, as from a full buffer; a longer one (a prefill) reads the ring's committed
slots before its writes and its own keys from `new` (`fits`), so a prefill computes the same bits
whatever ring length a method's program allocates. Elsewhere, and when it cannot be built or `SPECJAX_DENSE_KERNEL=0`, attention is
XLA's (`attention.attend`); both give the same softmax attention to fp32 rounding
(tests/test_attention_kernel.py). A query's keys are taken in ascending slot order, and its weight
on a key it does not see is exactly 0, so a row computes the same bits alone as inside a verify
window. Its bits do not depend on the buffer's length either (XLA's reductions over the whole buffer
do): a prefill computes the same whatever cache length a method's program allocates, so plain and
speculative decoding start from the same cache bit for bit, which "q8" arithmetic, whose rounding of
activations to int8 turns an ulp into a step, needs. Gradients go through the XLA formulation. Built with the machine's compiler on first use and cached beside the dense kernels.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from specjax.models import linear

MAX_WINDOW = 4096  # query tokens per row: the largest default prefill bucket (`serving.engine.DEFAULT_BUCKETS`)
_ENABLED = True  # `use_kernel(False)`: trace with XLA's attention (A/B benchmarks)
_SOURCE = pathlib.Path(__file__).with_name("attend_nk.cc")
_SYMBOL = "specjax_attend"


def build(force: bool = False) -> pathlib.Path:
    """Compiles attend_nk.cc for this machine (cached); returns the shared library's path."""
    source = _SOURCE.read_bytes()
    tag = hashlib.sha256(source + linear._machine_tag().encode()).hexdigest()[:16]
    return linear._compile(source, linear._cache_dir() / f"attend_nk-{tag}.so", force=force, target=_SYMBOL)


@functools.cache
def _register() -> bool:
    return linear._load_kernel(_SYMBOL, build, "attend", "using XLA's attention")


def available() -> bool:
    """Whether `specjax_attend` is built and registered (builds it on the first call)."""
    return not linear._disabled() and _register()


def status() -> str:
    """Why the attention kernel is or is not in use, in words."""
    available()
    return "disabled by SPECJAX_DENSE_KERNEL=0" if linear._disabled() else linear._STATUS.get("attend", "not built")


@contextlib.contextmanager
def use_kernel(enabled: bool = True):
    """Traces the enclosed code with the kernel where it applies (True) or XLA's attention everywhere
    (False): A/B timings of one model (`specjax.bench.experiments.step_cost`)."""
    global _ENABLED
    old, _ENABLED = _ENABLED, bool(enabled)
    try:
        yield
    finally:
        _ENABLED = old


def applies(q: Float[Array, "B T Kv G H"], k_buf: Float[Array, "B S Kv H"], *, context) -> bool:
    """Whether a layer's attention goes to the kernel (see the module docstring)."""
    if not _ENABLED or context is not None or not 1 <= q.shape[1] <= MAX_WINDOW:
        return False
    if q.dtype != jnp.float32 or k_buf.dtype != jnp.float32:
        return False
    from specjax import sharding  # a mesh partitions XLA's attention; a custom call it could only gather

    return jax.default_backend() == "cpu" and not sharding.active() and available()


def fits(q: Float[Array, "B T Kv G H"], ring: Float[Array, "B Sr Kv H"], sliding_window: int) -> bool:
    """Whether a forward of q's T tokens fits a local layer's ring beside its window (T <= Sr - W + 1),
    so that the ring can be read after the forward's writes."""
    return q.shape[1] <= ring.shape[1] - sliding_window + 1


def _ring_slots(end: Int[Array, "B 1 1"], entries: int) -> Int[Array, "B 1 S"]:
    """The slot each of a ring's `entries` holds when it holds the slots just before `end`: entry e
    holds the s with `s = e (mod entries)` and `end - entries <= s < end`."""
    e = jnp.arange(entries, dtype=jnp.int32)[None, None, :]
    return end - 1 - (end - 1 - e) % entries


def seen(k_buf: Float[Array, "B S Kv H"], new_mask: Bool[Array, "B T T"], lo: Int[Array, "B T"],
         hi: Int[Array, "B"], ring: bool = False) -> Bool[Array, "B T S"]:
    """The entries each query sees, as a mask: those of slots `lo[b, t] <= slot < hi[b]`, and of window
    slot `hi[b] + j` where `new_mask[b, t, j]`. A ring's entry e holds the slot `s = e (mod S)` among the
    S slots that end with the window (`hi[b] + T - S <= s < hi[b] + T`)."""
    t, s = new_mask.shape[1], k_buf.shape[1]
    if ring:
        w0 = jnp.maximum(hi, 0)[:, None, None]
        slots = _ring_slots(w0 + t, s)  # the S slots that end with the window
    else:
        w0 = jnp.clip(hi, 0, s - t)[:, None, None]
        slots = jnp.arange(s, dtype=jnp.int32)[None, None, :]
    j = slots - w0
    in_window = (j >= 0) & (j < t)
    window = jnp.take_along_axis(new_mask, jnp.broadcast_to(jnp.clip(j, 0, t - 1), (*new_mask.shape[:2], s)), axis=2)
    return ((slots >= lo[:, :, None]) & (slots < w0)) | (in_window & window)


def reference(q, k_buf, v_buf, new_mask, lo, hi, scale: float, ring: bool = False, new=None):
    """What the kernel computes, in XLA (its gradient, and its test oracle)."""
    if new is not None:  # a ring before the forward's writes (its slots end at hi), then the window's own keys
        end = jnp.maximum(hi, 0)[:, None, None]
        slots = _ring_slots(end, k_buf.shape[1])
        committed = (slots >= lo[:, :, None]) & (slots < end)
        k_all, v_all = jnp.concatenate([k_buf, new[0]], axis=1), jnp.concatenate([v_buf, new[1]], axis=1)
        mask = jnp.concatenate([committed, new_mask], axis=2)
    else:
        k_all, v_all, mask = k_buf, v_buf, seen(k_buf, new_mask, lo, hi, ring)
    s = jnp.einsum("BTCGH,BSCH->BTCGS", q, k_all) * scale
    s = jnp.where(mask[:, :, None, None, :], s, -jnp.inf)
    return jnp.einsum("BTCGS,BSCH->BTCGH", jax.nn.softmax(s, axis=-1), v_all)


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9))
def _attend(q, k_buf, v_buf, k_new, v_new, new_mask, lo, hi, scale, mode):
    out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    return jax.ffi.ffi_call(_SYMBOL, out, vmap_method="sequential")(
        q, k_buf, v_buf, k_new, v_new, new_mask.astype(jnp.uint8), lo.astype(jnp.int32), hi.astype(jnp.int32),
        scale=np.float32(scale), ring=np.int32(mode))


def _fwd(q, k_buf, v_buf, k_new, v_new, new_mask, lo, hi, scale, mode):
    out = _attend(q, k_buf, v_buf, k_new, v_new, new_mask, lo, hi, scale, mode)
    return out, (q, k_buf, v_buf, k_new, v_new, new_mask, lo, hi)


def _bwd(scale, mode, res, dout):
    q, k_buf, v_buf, k_new, v_new, new_mask, lo, hi = res
    if mode == 2:
        f = lambda q, k, v, kn, vn: reference(q, k, v, new_mask, lo, hi, scale, True, (kn, vn))
        _, vjp = jax.vjp(f, q, k_buf, v_buf, k_new, v_new)
        grads = vjp(dout)
    else:
        _, vjp = jax.vjp(lambda *a: reference(*a, new_mask, lo, hi, scale, mode == 1), q, k_buf, v_buf)
        grads = (*vjp(dout), jnp.zeros_like(k_new), jnp.zeros_like(v_new))
    zero = lambda x: np.zeros(x.shape, jax.dtypes.float0)
    return (*grads, zero(new_mask), zero(lo), zero(hi))


_attend.defvjp(_fwd, _bwd)


def attend(q: Float[Array, "B T Kv G H"], k_buf: Float[Array, "B S Kv H"], v_buf: Float[Array, "B S Kv H"],
           new_mask: Bool[Array, "B T T"], lo: Int[Array, "B T"], hi: Int[Array, "B"],
           scale: float, ring: bool = False, new: tuple | None = None) -> Float[Array, "B T Kv G H"]:
    """Softmax attention of each query over the slots it sees (`seen`) of buffers that already hold
    this forward's keys and values at slots `hi[b] .. hi[b] + T - 1` (`ring`: at entries modulo the
    buffer's length), through the kernel. `new`: this forward's own keys and values `[B, T, Kv, H]`,
    read for the window instead of a ring that does not hold them all (`fits`), which is then read
    before the forward's writes. Raises if the kernel is not available."""
    if not available():
        raise RuntimeError(f"specjax_attend is not available: {status()}")
    if new is not None and not ring:
        raise ValueError("attend(new=...) reads a ring before its writes: pass ring=True")
    empty = jnp.zeros((0,), jnp.float32)
    kn, vn = (empty, empty) if new is None else (new[0].astype(jnp.float32), new[1].astype(jnp.float32))
    return _attend(q, k_buf, v_buf, kn, vn, new_mask, lo, hi, float(scale), 2 if new is not None else int(bool(ring)))


_RESIDUAL = "specjax_residual"


@functools.cache
def _register_residual() -> bool:
    return linear._load_kernel(_RESIDUAL, build, "residual", "adding residuals in XLA")


@jax.custom_vjp
def _residual(x, y):
    return jax.ffi.ffi_call(_RESIDUAL, jax.ShapeDtypeStruct(x.shape, jnp.float32), vmap_method="broadcast_all")(x, y)


_residual.defvjp(lambda x, y: (_residual(x, y), None), lambda _, g: (g, g))


def residual(x: Float[Array, "... D"], y: Float[Array, "... D"]) -> Float[Array, "... D"]:
    """`x + y` as its own call where the kernel library applies (CPU, fp32, no mesh in context), else
    XLA's add. Its operands and result are materialized buffers, so XLA:CPU can neither contract a
    product ending a branch into the add (one fused multiply-add) nor recompute the residual stream
    inside a later fusion: it did either for some window widths and not others, so a row's bits
    depended on the rows beside it. The same values as `x + y`, to the bit."""
    if (x.dtype != jnp.float32 or y.dtype != jnp.float32 or x.shape != y.shape or not _ENABLED
            or jax.default_backend() != "cpu" or linear._disabled() or not _register_residual()):
        return x + y
    from specjax import sharding

    return x + y if sharding.active() else _residual(x, y)


if __name__ == "__main__":  # python -m specjax.models.cpu_attention: build ahead (e.g. right after install)
    import sys

    try:
        print(build(force="--force" in sys.argv))
    except RuntimeError as e:
        print(f"not built ({e}); specjax will use XLA's attention", file=sys.stderr)
        sys.exit(1)
