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

The package, by layer: `rules` (the mesh, `RULES`, `resolve`, the constraints), `place` (parameters,
the loop carry and inputs on a mesh), `multihost` (reads across processes) and `plan` (bytes per
device from shapes). Everything is re-exported here: `from specjax import sharding` reads them all.
"""

from specjax.sharding.rules import (
    AXES, RULES, parse_mesh, make_mesh, describe, check_mesh, use, current, resolve, active,
    constrain, gather_vocab, top_k,
)
from specjax.sharding.place import (
    axes_of, param_specs, place_state, place_module, Logical, place_pparams, carry_specs,
    carry_shardings, constrain_carry, constrain_replicated, abstract_carry, put, place_inputs,
    check_batch,
)
from specjax.sharding.multihost import (
    host_view, broadcast_from_0,
)
from specjax.sharding.plan import (
    shard_bytes, param_bytes_per_device, cache_bytes_per_device, memory_report,
)

__all__ = [
    "AXES", "RULES", "parse_mesh", "make_mesh", "describe", "check_mesh", "use", "current",
    "resolve", "active", "constrain", "gather_vocab", "top_k", "axes_of", "param_specs",
    "place_state", "place_module", "Logical", "place_pparams", "carry_specs", "carry_shardings",
    "constrain_carry", "constrain_replicated", "abstract_carry", "put", "place_inputs",
    "check_batch", "host_view", "broadcast_from_0", "shard_bytes", "param_bytes_per_device",
    "cache_bytes_per_device", "memory_report",
]
