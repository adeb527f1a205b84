"""Memory per device from shapes alone: parameters and caches in the layout `rules` and `place`
decide, and the planned `specjax.memory.Report` of an engine's batch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, PartitionSpec as P

from specjax import memory
from specjax.sharding.place import _is_var, carry_specs, param_specs
from specjax.sharding.rules import describe, make_mesh


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


def cache_bytes_per_device(model, batch: int, length: int, mesh: Mesh | None, *, window: int | None = None) -> int:
    """Bytes one device holds of `model.init_cache(batch, length, window=window)` (`window`: the
    decoder's, `Decoder.window`) in the loop carry's layout on `mesh`, from the cache's shapes alone
    (`jax.eval_shape`: nothing is allocated): each layer's buffers as the model builds them, so a
    sliding-window layer's ring counts its own length (Gemma 3), and the ring's bookkeeping counts
    too. For a full-length cache it is `2 L (B/dp) S (K/tp or K) H itemsize`, K split only where it
    divides tp."""
    abstract = jax.eval_shape(lambda: model.init_cache(batch, length, window=window))
    sizes = {} if mesh is None else dict(mesh.shape)
    leaves = jax.tree.leaves(abstract)
    specs = jax.tree.leaves(carry_specs(abstract, mesh), is_leaf=lambda x: isinstance(x, P))
    return sum(_per_device(x.shape, spec, sizes) * np.dtype(x.dtype).itemsize
               for x, spec in zip(leaves, specs, strict=True))


def memory_report(engine, *, batch: int, cache_length: int, window: int | None = None):
    """The `specjax.memory.Report` of an engine's batch planned on its mesh: bytes per device of the
    target's weights, the methods' assets (`Engine.asset_modules`: a draft model, heads) and the KV
    caches (the target's, and a draft model's), from the layout alone; identical to what the placed
    arrays hold (tested). `window`: the decoder's (`Decoder.window`), which sizes a sliding-window
    layer's ring; a draft model's cache is counted with it too (its own window, K + 1, is never wider)."""
    mesh = engine.mesh
    one = mesh if mesh is not None else make_mesh(data=1, model=1, devices=jax.devices()[:1])
    parts = dict(weights=param_bytes_per_device(engine.params, one, kv_heads=engine.config.num_kv_heads),
                 draft_weights=0, caches=cache_bytes_per_device(engine.model, batch, cache_length, mesh,
                                                                window=window))
    for module, cached in engine.asset_modules():  # a draft model (with its KV cache), Medusa heads, an EAGLE head
        _, state = nnx.split(module)
        kv_heads = module.config.num_kv_heads if cached else None
        parts["draft_weights"] += param_bytes_per_device(state, one, kv_heads=kv_heads)
        if cached:
            parts["caches"] += cache_bytes_per_device(module, batch, cache_length, mesh, window=window)
    return memory.planned(parts, devices=one.size, mesh=describe(one))
