"""Layout on a device mesh: one rules table from logical axis names to the mesh axes `data` and `model`.

Every parameter of the target, the draft model and the Medusa heads carries logical axis names in its
`axes` metadata (`nnx.Param(w, axes=("embed", "ffn"))`); activations and the loop carry are named
here or at a handful of `constrain` calls. `RULES` maps a logical name to a mesh axis, and `resolve`
turns names into a `PartitionSpec` for one array on one mesh, replicating a dimension that does not
divide (GSPMD rejects uneven shardings at jit boundaries) and attention when the model's kv heads do
not divide the tensor-parallel degree (a contiguous split of the flattened `N*H` columns holds whole
kv groups only then).

The mesh is Auto-mode GSPMD (`jax.sharding.AxisType.Auto`): shardings are given at the jit boundary
(params, inputs, the loop carry) and at a few constraints; XLA partitions everything in between.

The mesh is an explicit argument, never read from JAX's ambient context: a `Decoder` (and `Slots`)
holds it as a static field (`Decoder(mesh=...)`, part of its hash, so each mesh compiles its own
programs). The carry constraints take that mesh as an argument; the model's constraints and `top_k`,
called deep inside the step, read it from `use(decoder.mesh)`, which the Decoder's methods enter.
A `jax.set_mesh` around a call changes nothing in specjax's programs. Without a mesh every helper here
is a no-op, so single-device programs do not change.

Dimension letters as in `specjax.models.config`; `dp`, `tp` are the sizes of `data` and `model`.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
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


# ---- parameters ----------------------------------------------------------------------------------


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def axes_of(var: nnx.Variable) -> tuple | None:
    return var.get_metadata().get("axes")


def param_specs(state, mesh: Mesh, *, kv_heads: int | None = None):
    """A PartitionSpec per Variable of an `nnx.State`, from its `axes` metadata.

    Raises ValueError on a parameter without `axes`: nothing is replicated by omission.
    """
    def spec(path, v):
        ax = axes_of(v)
        if ax is None:
            name = ".".join(str(getattr(k, "key", k)) for k in path)
            raise ValueError(f"parameter {name} {v.shape} has no logical axes (axes=...)")
        return resolve(ax, v.shape, mesh, kv_heads=v.get_metadata().get("kv_heads", kv_heads))

    return jax.tree_util.tree_map_with_path(spec, state, is_leaf=_is_var)


def place_state(state, mesh: Mesh | None, *, kv_heads: int | None = None):
    """The `nnx.State` with every Variable's value placed on `mesh` by its logical axes."""
    if mesh is None:
        return state
    specs = param_specs(state, mesh, kv_heads=kv_heads)
    return jax.tree.map(lambda v, s: v.replace(put(v[...], NamedSharding(mesh, s))), state, specs,
                        is_leaf=_is_var)


def place_module(module: nnx.Module, mesh: Mesh | None) -> nnx.Module:
    """A copy of `module` (a model or heads) with its params placed on `mesh`."""
    if mesh is None:
        return module
    graphdef, state = nnx.split(module)
    return nnx.merge(graphdef, place_state(state, mesh))


class Logical:
    """Mixin for a pytree that names the logical axes of its own arrays, as model params do in their
    `axes` metadata: a proposer's params, the KV cache, the shared n-gram table. `logical_axes()`
    maps each field to its axes (one name per dimension), or to None for a field placed by its own
    metadata (an `nnx.State`), or for every array of a field that is itself a pytree (the KV
    cache's per-layer buffers). An empty tuple replicates."""

    def logical_axes(self) -> dict[str, tuple[str | None, ...] | None]:
        raise NotImplementedError


def _spec_of(x, axes, mesh) -> P:
    return resolve(axes, x.shape, mesh) if axes else P()


def place_pparams(pparams, mesh: Mesh | None):
    """A proposer's params on `mesh`: an nnx state by its axes, a `Logical` by the axes it names,
    anything else replicated."""
    if mesh is None or pparams is None:
        return pparams
    if isinstance(pparams, nnx.State):
        return place_state(pparams, mesh)
    if isinstance(pparams, Logical):
        def field(name, axes):
            x = getattr(pparams, name)
            if x is None or isinstance(x, nnx.State):
                return place_state(x, mesh) if x is not None else None
            return jax.tree.map(lambda a: put(a, NamedSharding(mesh, _spec_of(a, axes, mesh))), x)
        return pparams.replace(**{n: field(n, a) for n, a in pparams.logical_axes().items()})
    return jax.tree.map(lambda x: put(x, NamedSharding(mesh, P())), pparams)


# ---- the loop carry ------------------------------------------------------------------------------


def carry_specs(tree, mesh=None):
    """PartitionSpecs of a decode state (or inputs): a `Logical` node (the KV buffers `[B, S, Kv, H]`
    over `data` and, where K divides tp, `model`; the shared n-gram table replicated) by the axes it
    names, scalars replicated; every other leaf has a leading batch dim split over `data`."""
    def leaf(x):  # empty arrays (a plain loop's per-depth counters) come out replicated anyway
        if len(x.shape) == 0 or math.prod(x.shape) == 0:
            return P()
        return resolve(("batch",) + (None,) * (len(x.shape) - 1), x.shape, mesh)

    def node(x):
        if isinstance(x, Logical):
            axes = x.logical_axes()
            return x.replace(**{n: jax.tree.map(lambda a, ax=ax: _spec_of(a, ax, mesh), getattr(x, n))
                                for n, ax in axes.items()})
        return leaf(x)

    return jax.tree.map(node, tree, is_leaf=lambda x: isinstance(x, Logical))


def carry_shardings(tree, mesh: Mesh):
    """`carry_specs` as NamedShardings on `mesh`."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), carry_specs(tree, mesh),
                        is_leaf=lambda x: isinstance(x, P))


def constrain_carry(tree, mesh: Mesh | None):
    """Pins a decode state to `carry_shardings` on `mesh` (the prefill's output, the loop body's new
    carry); unchanged for None."""
    if mesh is None:
        return tree
    return jax.tree.map(jax.lax.with_sharding_constraint, tree, carry_shardings(tree, mesh))


def constrain_replicated(tree, mesh: Mesh | None):
    """Every array of `tree` replicated on `mesh` (what every process reads whole); unchanged for
    None."""
    if mesh is None:
        return tree
    return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P())), tree)


def abstract_carry(tree, mesh: Mesh | None):
    """`jax.eval_shape` output with the carry's shardings attached (eval_shape drops them)."""
    if mesh is None:
        return tree
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree,
                        carry_shardings(tree, mesh))


# ---- host <-> global arrays ----------------------------------------------------------------------


def put(x, sharding: NamedSharding):
    """`x` on a (possibly multi-process) sharding. Host numpy goes straight there; a single-device
    array or a typed PRNG key goes through numpy (device_put rejects committed arrays and typed keys
    onto shardings that span other processes)."""
    if isinstance(x, jax.Array) and x.sharding == sharding:
        return x
    if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        impl = jax.random.key_impl(x)
        data = put(jax.random.key_data(x), sharding)
        return jax.random.wrap_key_data(data, impl=impl)
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return jax.device_put(x, sharding)
    if isinstance(x, jax.Array) and jax.process_count() == 1:
        return jax.device_put(x, sharding)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def place_inputs(inputs, mesh: Mesh | None):
    """Per-row inputs (`specjax.Inputs`) on the global batch sharding.

    Raises ValueError when the batch does not divide the data axis (before anything compiles).
    """
    if mesh is None:
        return inputs
    check_batch(inputs.prompts.shape[0], mesh)
    return jax.tree.map(put, inputs, carry_shardings(inputs, mesh))


def check_batch(batch: int, mesh: Mesh | None) -> None:
    dp = 1 if mesh is None else mesh.shape["data"]
    if batch % dp:
        raise ValueError(f"batch of {batch} rows does not divide the mesh's data axis ({dp}): give a "
                         f"batch_size that is a multiple of {dp}")


def host_view(tree, mesh: Mesh | None):
    """Numpy copies of a (sharded) pytree, read back through one replicated view: a jitted identity
    to `P()`, so every process can read every row (np.asarray on a batch-sharded global array fails
    across processes)."""
    if mesh is None:
        return jax.tree.map(np.asarray, tree)
    out = _replicator(NamedSharding(mesh, P()))(tree)
    return jax.tree.map(np.asarray, out)


@functools.lru_cache(maxsize=16)
def _replicator(rep: NamedSharding):
    return jax.jit(lambda t: t, out_shardings=rep)  # one per mesh: compiled once per tree shape


def broadcast_from_0(value: Any) -> Any:
    """A host-side value decided on process 0 (a controller's choice, a calibrated cost table),
    returned identical on every process; any picklable value. One process: `value` itself."""
    if jax.process_count() == 1:
        return value
    import pickle

    from jax.experimental import multihost_utils

    data = np.frombuffer(pickle.dumps(value), np.uint8) if jax.process_index() == 0 else np.zeros(0, np.uint8)
    n = int(multihost_utils.broadcast_one_to_all(np.int64(data.size)))
    buf = np.zeros(n, np.uint8)
    if jax.process_index() == 0:
        buf[:] = data
    return pickle.loads(np.asarray(multihost_utils.broadcast_one_to_all(buf)).tobytes())


# ---- memory per device ---------------------------------------------------------------------------


def shard_bytes(tree, device=None) -> int:
    """Bytes of `tree`'s arrays that live on `device` (default: the first device of each array)."""
    total = 0
    for x in jax.tree.leaves(tree):
        if not isinstance(x, jax.Array):
            continue
        shards = x.addressable_shards
        s = shards[0] if device is None else next((s for s in shards if s.device == device), None)
        if s is not None:
            if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
                total += s.data.size * jax.random.key_data(s.data).dtype.itemsize * 2
            else:
                total += s.data.nbytes
    return total


def _per_device(shape, spec: P, sizes: dict[str, int]) -> int:
    n = 1
    for d, dim in enumerate(shape):
        ax = spec[d] if d < len(spec) else None
        n *= dim // (sizes[ax] if ax is not None else 1)
    return n


def param_bytes_per_device(state, mesh: Mesh, *, kv_heads: int | None = None) -> int:
    """Bytes one device holds of an `nnx.State` under `mesh`, from the layout alone (its shapes,
    dtypes and `axes`): each dim divided by its mesh axis size where `resolve` shards it."""
    sizes = dict(mesh.shape)
    specs = param_specs(state, mesh, kv_heads=kv_heads)
    leaves = jax.tree.leaves(state, is_leaf=_is_var)
    return sum(_per_device(v.shape, s, sizes) * np.dtype(v.dtype).itemsize
               for v, s in zip(leaves, jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))))


def cache_bytes_per_device(config, batch: int, length: int, mesh: Mesh | None) -> int:
    """Bytes of one KV cache (all layers, k and v) on one device:
    `2 L (B/dp) S (K/tp or K) H itemsize`, K split only where it divides tp."""
    dp = 1 if mesh is None else mesh.shape["data"]
    tp = 1 if mesh is None else mesh.shape["model"]
    k = config.num_kv_heads // tp if config.num_kv_heads % tp == 0 else config.num_kv_heads
    item = np.dtype(config.compute_dtype).itemsize
    return 2 * config.num_layers * (batch // dp) * length * k * config.head_dim * item


def memory_report(engine, *, batch: int, cache_length: int):
    """The `specjax.memory.Report` of an engine's batch planned on its mesh: bytes per device of the
    target's weights, the draft's (a draft model, Medusa heads) and the KV caches (the target's,
    and a draft model's), from the layout alone; identical to what the placed arrays hold (tested)."""
    from specjax import memory

    mesh = engine.mesh
    one = mesh if mesh is not None else make_mesh(data=1, model=1, devices=jax.devices()[:1])
    parts = dict(weights=param_bytes_per_device(engine.params, one, kv_heads=engine.config.num_kv_heads),
                 draft_weights=0, caches=cache_bytes_per_device(engine.config, batch, cache_length, mesh))
    if engine.draft is not None:
        _, dstate = nnx.split(engine.draft)
        parts["draft_weights"] += param_bytes_per_device(dstate, one, kv_heads=engine.draft.config.num_kv_heads)
        parts["caches"] += cache_bytes_per_device(engine.draft.config, batch, cache_length, mesh)
    if engine.heads is not None:
        _, hstate = nnx.split(engine.heads.module)
        parts["draft_weights"] += param_bytes_per_device(hstate, one)
    return memory.planned(parts, devices=one.size, mesh=describe(one))


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
