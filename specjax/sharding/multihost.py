"""Reads across processes: a replicated host view of a global array, and a value broadcast from
process 0."""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P


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


