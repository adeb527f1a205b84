"""The mesh and the rules: `RULES` from logical axis names to the mesh axes, `resolve` to a
`PartitionSpec`, the mesh a `Decoder` traces for (`use`), and the constraints and `top_k` the model
calls (see the package's docstring)."""

from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

AXES = ("data", "model")

# logical name -> mesh axis (None: replicated). The one place that decides the layout.
RULES: dict[str, str | None] = {
    "batch": "data",
    "vocab": "model",  # vocabulary-parallel embedding and LM head
    "ffn": "model",  # column-parallel w_gate / w_up, row-parallel w_down
    "q_heads": "model",  # only when the kv heads divide tp (see resolve)
    "kv_heads": "model",
    "embed": None,  # D: never sharded for inference (no FSDP)
    "head_dim": None,
    "seq": None,
    "draft_heads": None,  # Medusa's stacked heads: a few MB, replicated
    "layers": None,
    "vocab_ids": None,
    "features": None,  # an EAGLE head's concatenated inputs: replicated (a few MB)
}
_HEADS = ("q_heads", "kv_heads")


# ---- the mesh -------------------------------------------------------------------------------------


def parse_mesh(spec: str | Mapping[str, int]) -> dict[str, int]:
    """`"data=4,model=2"` (or a dict) -> `{"data": 4, "model": 2}`; an omitted axis is 1, one -1 is
    inferred from the device count by `make_mesh`."""
    if isinstance(spec, str):
        items = {}
        for part in filter(None, (s.strip() for s in spec.split(","))):
            name, eq, size = part.partition("=")
            if not eq:
                raise ValueError(f"mesh {spec!r}: write axis=size pairs, e.g. data=4,model=2")
            try:
                items[name.strip()] = int(size)
            except ValueError:
                raise ValueError(f"mesh {spec!r}: size of {name.strip()!r} is not an integer") from None
    else:
        items = dict(spec)
    unknown = sorted(set(items) - set(AXES))
    if unknown:
        raise ValueError(f"mesh axis {unknown[0]!r} is unknown: the axes are {', '.join(AXES)}")
    sizes = {a: int(items.get(a, 1)) for a in AXES}
    if sum(s == -1 for s in sizes.values()) > 1 or any(s < 1 and s != -1 for s in sizes.values()):
        raise ValueError(f"mesh {spec!r}: sizes must be >= 1, at most one of them -1 (inferred)")
    return sizes


def make_mesh(spec: str | Mapping[str, int] | None = None, *, devices: Sequence | None = None,
              **sizes: int) -> Mesh:
    """An Auto-mode `("data", "model")` mesh over `devices` (default: all, every process's).

    Example: `make_mesh("data=4,model=2")`, `make_mesh(data=-1, model=2)`. Devices are laid out
    `(dp, tp)` in `jax.devices()` order, so a `model` group is one host's neighbouring devices
    and `data` spans hosts.

    Raises:
      ValueError: an unknown axis name, or axis sizes whose product is not the device count.
    """
    if spec is not None and sizes:
        raise ValueError("give the mesh as a string/dict or as keywords, not both")
    sz = parse_mesh(spec if spec is not None else sizes)
    devs = list(jax.devices() if devices is None else devices)
    if -1 in sz.values():
        known = math.prod(s for s in sz.values() if s != -1)
        if len(devs) % known:
            raise ValueError(f"mesh {describe(sz)}: {len(devs)} devices are not a multiple of {known}")
        sz = {a: (len(devs) // known if s == -1 else s) for a, s in sz.items()}
    if math.prod(sz.values()) != len(devs):
        raise ValueError(f"mesh {describe(sz)} needs {math.prod(sz.values())} devices, there are "
                         f"{len(devs)}: make data * model equal the device count")
    grid = np.array(devs, dtype=object).reshape(sz["data"], sz["model"])
    return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * 2)


def describe(mesh_or_sizes) -> str:
    sizes = dict(mesh_or_sizes.shape) if isinstance(mesh_or_sizes, Mesh) else dict(mesh_or_sizes)
    return ",".join(f"{a}={sizes.get(a, 1)}" for a in AXES)


def check_mesh(mesh: Mesh | None) -> Mesh | None:
    """`mesh` if specjax can run on it; a clear ValueError otherwise (before anything compiles)."""
    if mesh is None:
        return None
    if not isinstance(mesh, Mesh):
        raise ValueError(f"mesh must be a jax.sharding.Mesh (specjax.sharding.make_mesh), got {type(mesh).__name__}")
    if tuple(mesh.axis_names) != AXES:
        raise ValueError(f"mesh axes {tuple(mesh.axis_names)}: specjax needs exactly {AXES}; "
                         "build it with specjax.sharding.make_mesh")
    if any(t != AxisType.Auto for t in mesh.axis_types):
        raise ValueError("mesh has Explicit axes (jax.make_mesh's default since 0.8): build it with "
                         "specjax.sharding.make_mesh or axis_types=(AxisType.Auto,) * 2")
    return mesh


_TRACING: contextvars.ContextVar[Mesh | None] = contextvars.ContextVar("specjax_mesh", default=None)


@contextlib.contextmanager
def use(mesh: Mesh | None):
    """Traces the enclosed code for `mesh` (None: one device, no constraints): what a `Decoder`'s or
    `Slots`' methods enter with their own `mesh` field, so the constraints inside them (the model's,
    the carry's, `top_k`'s) resolve against it. Specjax's own scope: JAX's `jax.set_mesh` is neither
    read nor set."""
    token = _TRACING.set(check_mesh(mesh))
    try:
        yield
    finally:
        _TRACING.reset(token)


def current() -> Mesh | None:
    """The mesh the enclosing `use` traces for (None outside one, or inside `use(None)`)."""
    return _TRACING.get()


def _sizes(mesh=None) -> dict[str, int] | None:
    """Axis sizes of `mesh`, else of the mesh `use` traces for; None when there is none."""
    m = check_mesh(mesh) if mesh is not None else current()
    if m is None:
        return None
    return dict(m.shape)


# ---- resolution -----------------------------------------------------------------------------------


def resolve(axes: Sequence[str | None], shape: Sequence[int], mesh=None, *,
            kv_heads: int | None = None) -> P:
    """The PartitionSpec of one array: each logical name through `RULES`, replicated where the
    dimension does not divide its mesh axis, and q/kv-head dims replicated unless `kv_heads`
    (the model's K, when known) divides tp. A mesh axis is used at most once."""
    sizes = _sizes(mesh)
    if sizes is None:
        return P()
    if len(axes) != len(shape):
        raise ValueError(f"logical axes {tuple(axes)} do not match a shape of rank {len(shape)}")
    spec, used = [], set()
    for name, dim in zip(axes, shape):
        ax = RULES[name] if name is not None else None
        if ax is not None:
            n = sizes[ax]
            heads_split = name not in _HEADS or kv_heads is None or kv_heads % n == 0
            if n == 1 or dim % n or not heads_split or ax in used:
                ax = None
        spec.append(ax)
        used.add(ax)
    while spec and spec[-1] is None:
        spec.pop()
    return P(*spec)


def active() -> bool:
    """Whether the code being traced is for a mesh (inside `use(mesh)`)."""
    return current() is not None


def constrain(x, axes: Sequence[str | None], *, kv_heads: int | None = None):
    """`x` pinned to `resolve(axes)` on the mesh `use` traces for; `x` unchanged without one."""
    mesh = current()
    if mesh is None:
        return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, resolve(axes, x.shape, mesh, kv_heads=kv_heads)))


def gather_vocab(x):
    """Logits `[B, ..., V]` with the vocabulary gathered on every device and the batch kept split:
    what sorting (top-k / top-p) and sampling read."""
    return constrain(x, ("batch",) + (None,) * (x.ndim - 1))


def top_k(x, k: int):
    """(values, ids) of the k largest entries of the last axis, best first (ties: lowest index, as
    `lax.top_k`). On a mesh `lax.top_k` would gather the whole batch (and a vocab-parallel last axis)
    onto every device; there it is k rounds of max-then-mask, each exchanging only per-shard
    (max, index) pairs. Without a mesh it is `lax.top_k`."""
    if not active():
        return jax.lax.top_k(x, k)
    index = jnp.arange(x.shape[-1]).reshape((1,) * (x.ndim - 1) + (-1,))
    values, ids = [], []
    for _ in range(k):
        i = jnp.argmax(x, axis=-1)
        values.append(jnp.take_along_axis(x, i[..., None], axis=-1)[..., 0])
        ids.append(i)
        x = jnp.where(index == i[..., None], -jnp.inf, x)
    return jnp.stack(values, axis=-1), jnp.stack(ids, axis=-1).astype(jnp.int32)
