"""`specjax.core.state`: the decode state's commits (stop tokens, budget, cache room), per-row keys, and the
row moves continuous batching makes (`rows_map`, `insert_row`)."""

import jax
import jax.numpy as jnp
import numpy as np

from specjax.models.kv_cache import KVCache
from specjax.core.ngram_table import NgramTable, TableConfig
from specjax.core.sampling import SamplingParams
from specjax.core.shared import Observed
from specjax.core.state import DecodeState, Shared, insert_row, rows_map, step_keys
from specjax.core.state import commit as _commit

commit = jax.jit(_commit, static_argnames="window")


def _state(lengths, *, capacity=8, prompt=2, max_new=100, stop=(-1,), blank=False, seed=0):
    """Rows of `capacity` tokens: position j holds 100 + j (`blank`: 0), so what a commit writes shows."""
    b = len(lengths)
    if blank:
        tokens = jnp.zeros((b, capacity), jnp.int32)
    else:
        tokens = jnp.tile(jnp.arange(capacity, dtype=jnp.int32) + 100, (b, 1))
    stop_ids = jnp.full((b, 8), -1, jnp.int32).at[:, : len(stop)].set(jnp.asarray(stop, jnp.int32))
    return DecodeState(
        tokens=tokens, lengths=jnp.asarray(lengths, jnp.int32),
        prompt_lengths=jnp.full((b,), prompt, jnp.int32),
        max_new=jnp.broadcast_to(jnp.asarray(max_new, jnp.int32), (b,)), done=jnp.zeros((b,), bool),
        cache=KVCache(k=(), v=(), length=0), sampling=SamplingParams.create(b), stop_ids=stop_ids,
        keys=jax.random.split(jax.random.key(seed), b), row_forwards=jnp.zeros((b,), jnp.int32),
        shared=Shared(forwards=jnp.zeros((), jnp.int32)),
    )


# ---- commit: stop tokens, the budget, the room left in the cache -------------------------------------


def test_commit_cache_full_with_one_token_window():
    s = _state([6, 3])
    new = jnp.asarray([[1], [2]], jnp.int32)
    one = jnp.ones((2,), jnp.int32)
    s, take = commit(s, new, one, window=1)
    assert take.tolist() == [1, 1] and s.lengths.tolist() == [7, 4] and s.done.tolist() == [False, False]
    s, take = commit(s, new, one, window=1)
    assert s.lengths.tolist() == [8, 5] and s.done.tolist() == [True, False]  # 8 + 1 > capacity 8
    s, take = commit(s, new, one, window=1)
    assert take.tolist() == [0, 1] and s.lengths.tolist() == [8, 6]  # a done row takes nothing
    assert s.tokens[0].tolist() == [100, 101, 102, 103, 104, 105, 1, 1]
    assert s.tokens[1].tolist() == [100, 101, 102, 2, 2, 2, 106, 107]


def test_commit_cache_full_with_wide_window():
    """A row is done once the next `window`-token step would not fit."""
    s, _ = commit(_state([4, 3]), jnp.asarray([[1], [2]], jnp.int32), jnp.ones((2,), jnp.int32), window=4)
    assert s.lengths.tolist() == [5, 4] and s.done.tolist() == [True, False]  # 5 + 4 > 8 >= 4 + 4


def test_commit_stop_budget_and_count():
    s = _state([3, 3, 3, 3], max_new=[100, 100, 2, 100], stop=(7,))
    new = jnp.asarray([[1, 7, 2], [1, 2, 3], [1, 2, 3], [7, 2, 3]], jnp.int32)
    s, take = commit(s, new, jnp.asarray([3, 2, 3, 0], jnp.int32), window=3)
    # row 0 cut after its stop token (kept); row 1 takes what was accepted; row 2 its budget of
    # 2 - 1 already generated; row 3 accepted nothing, so its stop token does not count
    assert take.tolist() == [2, 2, 1, 0]
    assert s.done.tolist() == [True, False, True, False]
    assert s.tokens[0, 3:6].tolist() == [1, 7, 105]


def test_commit_window_cache_full_and_stop():
    """A row is done once another K+1 window would not fit; a stop inside the kept prefix cuts it."""
    k = 3
    new = jnp.asarray([[1, 2, 3, 4], [1, 2, 3, 4], [1, 9, 3, 4]], jnp.int32)
    s, take = commit(_state([4, 2, 2], capacity=12, stop=(9,), blank=True), new, jnp.asarray([4, 4, 4]),
                     window=k + 1)
    assert take.tolist() == [4, 4, 2]
    assert s.lengths.tolist() == [8, 6, 4]
    assert s.done.tolist() == [False, False, True]  # 8 + 4 = 12 still fits
    s, take = commit(s, new, jnp.asarray([1, 4, 4]), window=k + 1)
    assert take.tolist() == [1, 4, 0]
    assert s.lengths.tolist() == [9, 10, 4] and s.done.tolist() == [True, True, True]
    assert s.tokens[1].tolist() == [0, 0, 1, 2, 3, 4, 1, 2, 3, 4, 0, 0]
    assert s.tokens[2].tolist()[:6] == [0, 0, 1, 9, 0, 0]


def test_commit_cuts_at_the_first_of_several_stops_and_at_the_budget_together():
    """Two stop ids, each twice in the window: the row ends after the first one; a budget shorter
    than the stop's place cuts first, and the row is done without having stopped on a stop token."""
    s = _state([3, 3], capacity=16, max_new=[100, 3], stop=(9, 7))
    new = jnp.asarray([[1, 7, 9, 7, 2], [1, 2, 3, 7, 9]], jnp.int32)
    s, take = commit(s, new, jnp.asarray([5, 5], jnp.int32), window=5)
    assert take.tolist() == [2, 2]  # row 1: budget 3 - 1 generated = 2, before its stop at 4
    assert s.tokens[0, 3:7].tolist() == [1, 7, 105, 106] and s.tokens[1, 3:7].tolist() == [1, 2, 105, 106]
    assert s.done.tolist() == [True, True] and s.num_new.tolist() == [3, 3]


# ---- per-row keys ------------------------------------------------------------------------------------


def _key_data(keys):
    return np.asarray(jax.random.key_data(keys))


def test_step_keys_follow_the_row_and_its_position_not_the_batch():
    s = _state([3, 5, 5])
    keys = _key_data(step_keys(s))
    alone = _key_data(step_keys(rows_map(lambda x: x[1:2], s)))  # row 1 in a batch of its own
    np.testing.assert_array_equal(keys[1], alone[0])
    assert not np.array_equal(keys[1], keys[2])  # same position, other row key
    moved = _key_data(step_keys(s.replace(lengths=s.lengths + 1)))
    assert not np.array_equal(moved[1], keys[1])  # the next position: a fresh key
    salted = _key_data(step_keys(s, salt=1))
    assert not np.array_equal(salted[0], keys[0])  # another use at the same step: another key


# ---- moving rows: rows_map and insert_row -------------------------------------------------------------


def _with_table(state, fill, forwards=7):
    """The batch's shared part: step counter `forwards` and a table whose keys are all `fill`."""
    table = NgramTable.empty(TableConfig(size=4, width=2))
    table = table.replace(keys=jnp.full_like(table.keys, fill))
    return state.replace(shared=Shared(forwards=jnp.asarray(forwards, jnp.int32), parts={TableConfig.name: table}))


def test_rows_map_slices_rows_but_not_scalars_or_the_table():
    s = _with_table(_state([3, 4, 5]), fill=3)
    out = rows_map(lambda x: x[::2], s)
    assert out.lengths.tolist() == [3, 5] and out.tokens.shape == (2, 8) and out.keys.shape == (2,)
    assert int(out.forwards) == 7  # the batch's step counter, not a row's
    assert out.table.keys.shape == (4, 3) and (np.asarray(out.table.keys) == 3).all()  # whole, unsliced


def test_insert_row_replaces_one_row_and_leaves_the_others():
    batch = _with_table(_state([3, 4, 5]), fill=3)
    row = _with_table(_state([6], max_new=9, stop=(11,), seed=1), fill=-1)
    row = row.replace(tokens=row.tokens + 100, done=jnp.ones((1,), bool))
    out = insert_row(batch, row, jnp.asarray(1))
    assert out.lengths.tolist() == [3, 6, 5] and out.max_new.tolist() == [100, 9, 100]
    assert out.done.tolist() == [False, True, False]
    np.testing.assert_array_equal(out.tokens[1], row.tokens[0])
    np.testing.assert_array_equal(np.asarray(out.tokens)[[0, 2]], np.asarray(batch.tokens)[[0, 2]])
    np.testing.assert_array_equal(out.stop_ids[1], row.stop_ids[0])
    np.testing.assert_array_equal(_key_data(out.keys)[1], _key_data(row.keys)[0])
    np.testing.assert_array_equal(_key_data(out.keys)[[0, 2]], _key_data(batch.keys)[[0, 2]])
    assert int(out.forwards) == 7  # the running batch's counter
    assert (np.asarray(out.table.keys) == 3).all()  # the batch's table, not the row's


# ---- the shared n-gram table learns after the commit, not in it -------------------------------------


def test_commit_leaves_the_table_and_its_update_writes_what_contributing_rows_committed():
    cfg = TableConfig(size=64, width=2, min_n=2, max_n=2)
    s = _state([4, 4], capacity=12, blank=True).replace(
        shared=Shared(forwards=jnp.zeros((), jnp.int32), parts={cfg.name: cfg.init()}),
        contribute=jnp.asarray([True, False]))
    s = s.replace(tokens=s.tokens.at[:, :4].set(jnp.asarray([[1, 2, 3, 4], [5, 6, 7, 8]])))
    new = jnp.asarray([[9, 10, 11], [9, 10, 11]], jnp.int32)
    after, take = commit(s, new, jnp.asarray([3, 3]), window=3)
    np.testing.assert_array_equal(after.table.keys, s.table.keys)  # commit writes no n-gram
    zeros = jnp.zeros((2, 1), jnp.int32)
    seen = Observed(before=s, after=after, scored=zeros, prev=zeros - 1, mask=jnp.ones((2, 1), bool), order=zeros,
                    width=3)
    learned = cfg.update(after.table, seen)
    keys = {tuple(k) for k in np.asarray(learned.keys).tolist() if any(x != np.asarray(s.table.keys)[0][0]
                                                                       for x in k)}
    assert keys, "nothing learned"
    row1 = {1, 2, 3, 4, 9, 10, 11}
    assert all(set(k) <= row1 | {-1, 0} for k in keys), keys  # row 1 does not contribute
    assert not any({5, 6, 7, 8} & set(k) for k in keys), keys
