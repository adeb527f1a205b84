"""Placement: parameters, a proposer's parameters, the loop carry and the inputs put on a mesh in
the layout `rules` decides."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from specjax.sharding.rules import resolve


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


