"""Slot operations (specjax.core.slots): insert, release, move, take / put and the host view, on one device.

The scheduler's end-to-end checks (every request gets its batch-of-one tokens, on one device and on an
8-device mesh) are in test_scheduler.py and test_sharding.py; these pin each operation alone."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax.core import slots as slot_ops
from specjax.core.decoder import Decoder, Inputs, State, Stats, decode_program
from specjax.methods.ngram.proposer import NgramProposer
from specjax.core.slots import Slots

S = 64


@pytest.fixture(scope="module")
def ops():
    base = Decoder(cache_length=S)
    return Slots(base=base, decoders=(Decoder(cache_length=S, proposer=NgramProposer(k=3)),))


@pytest.fixture(scope="module")
def model(tiny_model):
    return nnx.split(tiny_model)


def _rows(prompts, **kw):
    return Inputs.create(prompts, bucket=8, max_new_tokens=12, **kw)


def _host(state, pick=lambda x: x):
    """Numpy copies of a decode state's per-row arrays (keys as their data; `k0`: layer 0's K cache),
    `pick` applied to each, as a namespace (a host copy, not a DecodeState)."""
    def one(x):
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        return pick(np.asarray(x))
    names = ("tokens", "lengths", "prompt_lengths", "max_new", "done", "row_forwards", "keys", "forwards")
    out = {n: one(getattr(state, n)) for n in names}
    return types.SimpleNamespace(**out, k0=one(state.cache.k[0]))


def _leaves_equal(a, b):
    return all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_insert_writes_one_row_and_keeps_the_others(ops, model):
    graphdef, params = model
    batch = _rows([[1, 2, 3], [4, 5, 6, 7], [9], [3, 3]])
    state, pstates = slot_ops.prefill_program(graphdef, params, (None,), batch, slots=ops)
    before = _host(state)
    req = _rows([[11, 12, 13, 14, 15]], row_ids=[7])
    alone, _ = slot_ops.prefill_program(graphdef, params, (None,), req, slots=ops)
    alone = _host(alone)
    state, pstates = slot_ops.insert_program(graphdef, params, (None,), state, pstates, np.int32(2), req,
                                             slots=ops)
    after = _host(state)
    for name in ("tokens", "lengths", "prompt_lengths", "max_new", "done", "row_forwards", "keys"):
        new, old, one = getattr(after, name), getattr(before, name), getattr(alone, name)
        assert np.array_equal(new[2], one[0]), name  # the row is the batch-of-one prefill
        assert np.array_equal(np.delete(new, 2, axis=0), np.delete(old, 2, axis=0)), name  # others kept
    assert np.array_equal(after.k0[2], alone.k0[0])
    assert int(after.forwards) == int(before.forwards)  # the batch's step counter is not the row's


def test_release_move_take_put(ops, model):
    graphdef, params = model
    state, pstates = slot_ops.prefill_program(graphdef, params, (None,), _rows([[1, 2], [3, 4], [5, 6], [7, 8]]),
                                              slots=ops)
    state = slot_ops.release_program(state, np.int32(1), slots=ops)
    assert np.asarray(state.done).tolist() == [False, True, False, False]

    row3 = _host(state, lambda x: x[3] if x.ndim else x)
    state, pstates = slot_ops.move_program(state, pstates, np.int32(3), np.int32(1), slots=ops)
    moved = _host(state, lambda x: x[1] if x.ndim else x)
    assert np.array_equal(moved.tokens, row3.tokens) and np.array_equal(moved.k0, row3.k0)
    assert np.asarray(state.done).tolist() == [False, False, False, True]  # the source is free

    sub, sub_p = slot_ops.take_program(state, pstates[0], size=2, slots=ops)
    assert sub.tokens.shape[0] == 2 and _leaves_equal(sub.tokens, state.tokens[:2])
    full = _host(state)
    loop = State(decode=sub, proposer=sub_p, stats=Stats.zeros(2, 0))
    ran = decode_program(graphdef, params, None, loop, np.int32(3), static=ops.base)
    state, _ = slot_ops.put_program(state, pstates[0], ran.decode, ran.proposer, slots=ops)
    out = _host(state)
    assert int(out.forwards) == 3  # the steps the sub-batch ran
    assert np.array_equal(out.tokens[:2], np.asarray(ran.decode.tokens))
    assert np.array_equal(out.tokens[2:], full.tokens[2:]) and np.array_equal(out.lengths[2:], full.lengths[2:])


def test_view_is_what_the_host_reads(ops, model):
    graphdef, params = model
    state, _ = slot_ops.prefill_program(graphdef, params, (None,), _rows([[1, 2], [3]]), slots=ops)
    stats = Stats.zeros(2, 3)
    view = jax.device_get(slot_ops.view_program(state, stats, slots=ops))
    assert isinstance(view.tokens, np.ndarray)
    assert np.array_equal(view.tokens, np.asarray(state.tokens))
    assert np.array_equal(view.lengths, np.asarray(state.lengths)) and view.forwards == 0
    assert view.stats.accepted_per_position.shape == (2, 3)


def test_every_option_shares_the_cache_length(ops):
    with pytest.raises(ValueError, match="cache_length"):
        Slots(base=ops.base, decoders=(Decoder(cache_length=S + 8, proposer=NgramProposer(k=3)),))


def test_the_functional_insert_equals_the_slot_operation(ops, model):
    """`Decoder.insert` (the functional API, taught in notebooks/functional_api.ipynb) writes the same
    row as `Slots.insert`, proposer state and counters included, and keeps the batch's shared part."""
    graphdef, params = model
    dec = ops.decoders[0]
    run = jax.jit(lambda inputs: dec.prefill(nnx.merge(graphdef, params), None, inputs))
    batch, req = _rows([[1, 2, 3], [4, 5, 6, 7]]), _rows([[11, 12, 13]], row_ids=[7])
    full = jax.jit(dec.insert)(run(batch), run(req), jnp.int32(1))
    state, pstates = slot_ops.prefill_program(graphdef, params, (None,), batch, slots=ops)
    state, pstates = slot_ops.insert_program(graphdef, params, (None,), state, pstates, np.int32(1), req,
                                             slots=ops)
    got, want = (jax.tree_util.tree_leaves_with_path(t) for t in (full.decode, state))
    for (path, x), (_, y) in zip(got, want, strict=True):
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        assert np.array_equal(np.asarray(x), np.asarray(y)), jax.tree_util.keystr(path)
    assert _leaves_equal(full.proposer, pstates[0])
    assert np.asarray(full.stats.accepted_per_position).shape[0] == 2


def test_running_batch_rows_equal_each_request_alone_and_nothing_compiles_after_construction(ops, tiny_model):
    """`RunningBatch`, the batch a host serves from: requests inserted at different times, chunks of
    either option on the full batch or its first two rows, a move and a release; every request's
    tokens are its batch-of-one generation, and no operation compiles after the constructor and
    `compile_insert`."""
    import specjax
    from specjax.serving.engine import Engine
    from specjax.core.slots import RunningBatch

    eng = Engine(tiny_model)
    rb = RunningBatch(ops, params=eng.params, pparams=(None,), compile=eng.program,
                      empty=Inputs.create([[0]] * 4, bucket=1, max_new_tokens=1), loops=(None, 0), sizes=(2,))
    rb.compile_insert(_rows([[0]]))
    rb.warm_inserts()
    compiled = eng.compile_count
    prompts = {7: [1, 2, 3, 1, 2, 3], 8: [4, 5, 6, 7], 9: [9, 9, 9, 9, 9], 10: [3, 1]}
    alone = {r: specjax.new_tokens(specjax.generate(tiny_model, _rows([p], row_ids=[r]), decoder=ops.base))[0]
             for r, p in prompts.items()}
    got, slot_of = {}, {}

    def insert(slot, r):
        view = rb.insert(slot, _rows([prompts[r]], row_ids=[r]))
        got[r], slot_of[r] = [int(view.tokens[slot, len(prompts[r])])], slot

    def run(option, size=None):
        chunk = rb.run(option, 2, size=size)
        assert 0 <= chunk.steps <= 2
        for r, slot in slot_of.items():
            got[r] += chunk.new_tokens(slot)
        return chunk

    insert(0, 7)
    insert(1, 8)
    run(0, size=2)          # prompt lookup on the first two rows
    assert not rb.read().done[1]
    rb.release(1)           # request 8 cancelled: it stops here
    del slot_of[8]
    insert(2, 9)
    run(None)               # plain on all four
    rb.move(2, 3)           # row 9 to slot 3 and back: moved rows continue as they were
    rb.move(3, 2)
    insert(1, 10)
    run(0)
    while not all(rb.read().done[s] for s in slot_of.values()):
        run(0)
    assert eng.compile_count == compiled, "an operation compiled after construction"
    for r in (7, 9, 10):
        assert got[r] == alone[r], r
    assert got[8] == alone[8][: len(got[8])] and len(got[8]) < len(alone[8])


def test_bare_insert_and_loop_leave_method_state_alone_and_decode_as_the_plain_loop(tiny_model):
    """`insert(bare=True)` and the `BARE` loop (auto's plain while speculation does not pay): the
    row's decode state is the full insert's, the proposer states and the batch-shared n-gram table
    are untouched by the prompt and by the chunk, and the tokens are the plain loop's; the plain loop
    with upkeep (None) feeds the table from the same state."""
    from specjax.core.ngram_table import TableConfig
    from specjax.core.slots import BARE, RunningBatch
    from specjax.serving.engine import Engine

    table = TableConfig(size=256)
    ops = Slots(base=Decoder(cache_length=S, shared=(table,)),
                decoders=(Decoder(cache_length=S, proposer=NgramProposer(k=3), shared=(table,)),))
    assert ops.bare.shared == () and ops.bare.cache_length == S
    eng = Engine(tiny_model)
    rb = RunningBatch(ops, params=eng.params, pparams=(None,), compile=eng.program,
                      empty=Inputs.create([[0]] * 2, bucket=1, max_new_tokens=1), loops=(None, BARE, 0))
    req = _rows([[5, 6, 7, 5, 6, 7]], row_ids=[3])
    full = rb.fork(Inputs.create([[0]] * 2, bucket=1, max_new_tokens=1))
    full.insert(1, req)
    rb.insert(0, _rows([[9, 8, 9, 8]], row_ids=[1]))  # a full insert: the table sees its prompt
    parts, pstates = jax.tree.map(jnp.array, (rb.state.shared.parts, rb.pstates))  # copies: the batch is donated
    rb.insert(1, req, bare=True)
    assert _leaves_equal(rb.state.shared.parts, parts) and _leaves_equal(rb.pstates, pstates)
    a, b = _host(rb.state, lambda x: x[1] if x.ndim else x), _host(full.state, lambda x: x[1] if x.ndim else x)
    for name in ("tokens", "lengths", "keys", "k0"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    rb.release(0)
    chunk = rb.run(BARE, 4)
    assert _leaves_equal(rb.state.shared.parts, parts) and _leaves_equal(rb.pstates, pstates)
    full.run(None, 4)
    assert not _leaves_equal(full.state.shared.parts, parts)  # the plain loop with upkeep feeds it
    assert chunk.new_tokens(1) == np.asarray(full.state.tokens)[1, 7:11].tolist()  # after the prompt (6) and the first token
    with pytest.raises(ValueError, match="bare loop"):
        full_free = RunningBatch(ops, params=eng.params, pparams=(None,), compile=eng.program,
                                 empty=Inputs.create([[0]] * 2, bucket=1, max_new_tokens=1), loops=(None,))
        full_free.insert(0, req, bare=True)
