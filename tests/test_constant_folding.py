"""No program reduces a block that is known at compile time: XLA would evaluate it while compiling
(constant folding, seconds per program at a real model's sizes, with E-level slow-operation lines in
the log) instead of at run time. Checked on the traced programs of a serving batch, where every
value that depends on the arguments (weights, state, the request) is followed through the jaxpr."""

import numpy as np
import pytest
from flax import nnx
from jax.extend import core

from specjax.core import slots
from specjax.methods.config import SpecConfig
from specjax.models.eagle import EagleConfig, EagleHead
from specjax.serving.engine import Engine, GenerateOptions
from specjax.serving.scheduler import Scheduler
from specjax.methods.eagle.record import LoadedEagle

REDUCTIONS = {"reduce_max", "reduce_min", "reduce_sum", "argmax", "argmin", "reduce_and", "reduce_or"}
CALLS = ("pjit", "jit", "closed_call", "remat", "checkpoint", "custom_jvp_call")


def folded_reductions(jaxpr, live: list[bool], known: list | None = None,
                      out_values: list | None = None) -> tuple[list[bool], list[str]]:
    """Which outputs of `jaxpr` depend on an input marked live, and the reductions (over at least 64
    elements) whose operand depends on none: constants XLA folds. Values that depend on no live input
    are computed (through nested calls too: `out_values` receives a call's known outputs), and three of
    XLA's simplifications followed: a product with an all-zero operand (an empty cache's keys) is zero,
    an `and` with an all-false operand is false, and a select whose constant predicate picks only
    constant cases (a mask that hides every entry) is constant."""
    dep = {v for v, d in zip(jaxpr.invars, live) if d}
    values = {v: x for v, x in zip(jaxpr.invars, known or [None] * len(live)) if x is not None}
    value = lambda v: v.val if isinstance(v, core.Literal) else values.get(v)
    found, parts = [], {}
    for eqn in jaxpr.eqns:
        ins = [isinstance(v, core.Var) and v in dep for v in eqn.invars]
        inner = [p for p in eqn.params.values() if isinstance(p, (core.Jaxpr, core.ClosedJaxpr))]
        if eqn.primitive.name in CALLS and inner:
            sub = inner[0].jaxpr if isinstance(inner[0], core.ClosedJaxpr) else inner[0]
            known_outs = []
            outs, more = folded_reductions(sub, ins, [value(v) for v in eqn.invars], known_outs)
            found += more
            values.update({o: x for o, x in zip(eqn.outvars, known_outs) if x is not None})
        elif eqn.primitive.name == "optimization_barrier":
            outs = [True] * len(eqn.outvars)  # XLA folds nothing through a barrier
        elif eqn.primitive.name == "and" and any(
                value(v) is not None and not np.any(np.asarray(value(v))) for v in eqn.invars):
            outs = [False]  # a mask and'ed with an all-false one (an empty ring's entries): all false
            values[eqn.outvars[0]] = np.zeros(eqn.outvars[0].aval.shape, eqn.outvars[0].aval.dtype)
        elif eqn.primitive.name in ("dot_general", "mul") and any(
                value(v) is not None and not np.any(np.asarray(value(v))) for v in eqn.invars):
            outs = [False]  # a product with an all-zero operand: zeros, whatever the other holds
            values[eqn.outvars[0]] = np.zeros(eqn.outvars[0].aval.shape, eqn.outvars[0].aval.dtype)
        elif eqn.primitive.name == "select_n" and not ins[0] and value(eqn.invars[0]) is not None:
            picked = {int(i) for i in np.unique(np.asarray(value(eqn.invars[0])))}
            outs = [any(ins[1 + i] for i in picked)]
        else:
            for sub in inner:  # loops and branches: everything inside counted as live (no false alarm)
                sub = sub.jaxpr if isinstance(sub, core.ClosedJaxpr) else sub
                found += folded_reductions(sub, [True] * len(sub.invars))[1]
            outs = [any(ins)] * len(eqn.outvars)
        if eqn.primitive.name == "concatenate":
            parts[eqn.outvars[0]] = (eqn.params["dimension"], eqn.invars)
        if eqn.primitive.name in REDUCTIONS:
            # XLA splits a reduction over a concatenation along the reduced axis into one per part
            dim, pieces = parts.get(eqn.invars[0], (None, eqn.invars[:1]))
            if dim is not None and dim not in eqn.params.get("axes", ()):
                pieces = eqn.invars[:1]
            for v in pieces:
                if not (isinstance(v, core.Var) and v in dep) and int(np.prod(v.aval.shape)) >= 64:
                    found.append(f"{eqn.primitive.name} over {v.aval.str_short()}")
        dep |= {v for v, d in zip(eqn.outvars, outs) if d}
        args = [value(v) for v in eqn.invars]
        if not inner and not any(outs) and all(x is not None for x in args) and eqn.outvars[0] not in values:
            out = eqn.primitive.bind(*args, **eqn.params)
            values.update(zip(eqn.outvars, out if eqn.primitive.multiple_results else [out]))
    if out_values is not None:
        out_values.extend(value(v) for v in jaxpr.outvars)
    return [isinstance(v, core.Var) and v in dep for v in jaxpr.outvars], found


@pytest.fixture(scope="module")
def traced(tiny_model):
    """The insert programs of a serving batch with an EAGLE head (whose prompt pass attends an empty
    cache: the case that folded), as traced jaxprs."""
    eng = Engine(tiny_model)
    cfg = tiny_model.config
    head = EagleHead(EagleConfig.for_model(cfg, draft_vocab=cfg.vocab_size), rngs=nnx.Rngs(0))
    eng.set_asset("eagle", LoadedEagle(head, np.arange(cfg.vocab_size)))
    return insert_jaxprs(eng, lambda: Scheduler(eng, slots=2, spec=SpecConfig(method="eagle", k=3),
                                                opts=GenerateOptions(max_new_tokens=16), max_prompt_tokens=32))


def insert_jaxprs(eng, scheduler) -> list:
    """The traced jaxprs of the insert programs that `scheduler()` (built on `eng`) compiles for its
    prompt buckets."""
    jaxprs = []
    program = eng.program

    def tracing(fn, decoder, *args, weights=True, **statics):
        if fn is slots.insert_program:
            kw = dict(statics) if decoder is None else dict(statics, static=decoder)
            jaxprs.append(fn.trace(eng.graphdef, eng.params, *args, **kw).jaxpr)
        return program(fn, decoder, *args, weights=weights, **statics)

    eng.program = tracing
    scheduler().compile_buckets()
    assert jaxprs
    return jaxprs


def test_insert_programs_reduce_nothing_known_at_compile_time(traced):
    for closed in traced:
        found = folded_reductions(closed.jaxpr, [True] * len(closed.jaxpr.invars))[1]
        assert not found, f"the insert program reduces blocks known at compile time: {found}"


def test_the_check_sees_a_reduction_of_a_constant():
    """Negative control: a reduction of a masked-out block built from constants only is reported."""
    import jax
    import jax.numpy as jnp

    def f(x):
        scores = jnp.where(jnp.arange(128)[:, None] < 0, 1.0, -jnp.inf) * jnp.ones((128, 16))
        return x + jnp.max(scores, axis=-1)

    closed = jax.make_jaxpr(f)(jnp.zeros(128))
    assert folded_reductions(closed.jaxpr, [True])[1] == ["reduce_max over float32[128,16]"]


def test_a_ring_layers_prefill_reduces_nothing_known_at_compile_time():
    """A sliding-window model's insert program at a bucket past its window: the empty ring's bookkeeping
    (every entry unwritten) made the ring's whole block of scores masked out, a constant that XLA
    folded while compiling (Gemma 3 270M at bucket 1024: 45 s to compile its insert program, 8 s with
    the empty cache behind a barrier)."""
    from test_kv_cache import CONFIG, random_model

    eng = Engine(random_model(CONFIG))
    for closed in insert_jaxprs(eng, lambda: Scheduler(eng, slots=1, opts=GenerateOptions(max_new_tokens=8),
                                                       max_prompt_tokens=32)):
        found = folded_reductions(closed.jaxpr, [True] * len(closed.jaxpr.invars))[1]
        assert not found, f"the insert program reduces blocks known at compile time: {found}"
