"""The type checker jaxtyping's pytest hook applies to specjax (pyproject.toml's addopts):
`beartype.beartype`, except for one thing JAX does that no annotation can express.

JAX rebuilds a pytree with stand-in leaves: ahead-of-time lowering rebuilds the arguments with an
`ArgInfo` per array (`jit(f).lower(...)`), sharding rebuilds a state with a `PartitionSpec` per
array, transformations with `ShapeDtypeStruct`s or sentinel objects. A `flax.struct.dataclass`
is rebuilt through its `__init__`, which the hook checks against the field annotations. Those
constructions are skipped, all others are checked: every field of a dataclass built from arrays
(traced or not), and every function's parameters and return value.
"""

import functools

import beartype
import jax

_STAND_INS = (jax.stages.ArgInfo, jax.ShapeDtypeStruct, jax.sharding.PartitionSpec, jax.sharding.Sharding)


def _stand_in(x) -> bool:
    return isinstance(x, _STAND_INS) or type(x) is object  # object(): a sentinel leaf


_CHECK = beartype.beartype(conf=beartype.BeartypeConf(is_pep484_tower=True))  # an int is a float


def typechecked(fn):
    checked = _CHECK(fn)
    if getattr(fn, "__name__", None) != "__init__":
        return checked

    @functools.wraps(fn)
    def init(*args, **kwargs):
        if any(_stand_in(x) for x in jax.tree.leaves((args[1:], kwargs))):
            return fn(*args, **kwargs)  # JAX rebuilding a pytree from stand-ins
        return checked(*args, **kwargs)

    return init
