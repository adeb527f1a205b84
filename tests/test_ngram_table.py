"""The cross-request n-gram table: deterministic, fixed shape, bounded; earlier requests' n-grams
are proposed to later ones; collisions, eviction, opt-outs and cancellation never change output."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.core import ngram_table
from specjax.methods.config import SpecConfig
from specjax.serving.engine import Engine, GenerateOptions
from specjax.core.ngram_table import NgramTable, TableConfig
from specjax.serving.scheduler import Scheduler

add = jax.jit(ngram_table.add, static_argnames="width_new")
lookup = jax.jit(ngram_table.lookup, static_argnames="k")
PROMPTS = [list(range(10, 20)), [5, 9, 12, 5, 9, 12, 5, 9], list(range(30, 42)), [40, 41, 42, 43, 40, 41]]
M = 24


def _commit_all(table, rows, contribute=None):
    """Adds every row's whole text as if committed in one step each (positions 0 .. len - 1)."""
    s = max(len(r) for r in rows)
    tokens = np.zeros((len(rows), s), np.int32)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = r
    take = jnp.asarray([len(r) for r in rows], jnp.int32)
    c = jnp.ones((len(rows),), bool) if contribute is None else jnp.asarray(contribute)
    return add(table, jnp.asarray(tokens), jnp.zeros((len(rows),), jnp.int32), take, s, c)


def _entries(table):
    keys, follow = np.asarray(table.keys), np.asarray(table.follow)
    return [(tuple(int(t) for t in k if t >= 0), tuple(f.tolist())) for k, f in zip(keys, follow) if (k >= 0).any()]


def _occurs(needle, hay):
    n = len(needle)
    return any(tuple(hay[i:i + n]) == needle for i in range(len(hay) - n + 1))


def test_tenants_never_read_each_others_entries():
    """Tenant 1's text is in the table under tenant 1 only: tenant 2 (and the default tenant 0)
    find nothing for the same context, tenant 1 finds its followers."""
    cfg = TableConfig(size=256, width=3, min_n=2, max_n=3)
    text = [1, 2, 3, 4, 5, 6, 7, 8]
    tokens = jnp.asarray([text])
    t = add(NgramTable.empty(cfg), tokens, jnp.zeros((1,), jnp.int32), jnp.asarray([8], jnp.int32), 8,
            jnp.ones((1,), bool), jnp.asarray([1], jnp.int32))
    written = np.asarray(t.keys >= 0).any(axis=1)
    assert written.sum() > 0 and set(np.asarray(t.owner)[written].tolist()) == {1}
    ctx, length = jnp.asarray([[0, 0, 1, 2, 3]]), jnp.asarray([5])
    draft, found = lookup(t, ctx, length, 3, jnp.asarray([1], jnp.int32))
    assert bool(found[0]) and draft[0].tolist() == [4, 5, 6]
    for other in (jnp.asarray([2], jnp.int32), None):
        _, found = lookup(t, ctx, length, 3, other)
        assert not bool(found[0])


def test_table_is_deterministic_bounded_and_exact():
    cfg = TableConfig(size=64, width=3, min_n=2, max_n=3)
    rows = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 1, 2, 3, 10, 11, 12, 13]]
    a = _commit_all(NgramTable.empty(cfg), rows)
    b = _commit_all(NgramTable.empty(cfg), rows)
    assert a.keys.shape == (64, 3) and a.follow.shape == (64, 3)
    assert sum(x.size * x.dtype.itemsize for x in (a.keys, a.follow, a.owner)) == cfg.nbytes
    np.testing.assert_array_equal(a.keys, b.keys)
    np.testing.assert_array_equal(a.follow, b.follow)
    for gram, follow in _entries(a):  # every entry is an n-gram and its true followers
        assert any(_occurs(gram + follow, r) for r in rows), (gram, follow)
    # [1, 2, 3] occurs in both rows, written in the same step: the later position (row 1's) wins
    draft, found = lookup(a, jnp.asarray([[0, 0, 1, 2, 3]]), jnp.asarray([5]), 3)
    assert bool(found[0]) and draft[0].tolist() == [10, 11, 12]
    draft, found = lookup(a, jnp.asarray([[7, 7, 7, 4, 5]]), jnp.asarray([5]), 2)  # the 2-gram [4, 5]
    assert bool(found[0]) and draft[0].tolist() == [6, 7]
    _, found = lookup(a, jnp.asarray([[7, 7, 7, 6, 5]]), jnp.asarray([5]), 2)
    assert not bool(found[0])
    with pytest.raises(ValueError, match="width"):
        lookup(a, jnp.asarray([[1, 2]]), jnp.asarray([2]), 4)


def test_a_tiny_table_collides_and_evicts_but_stays_exact():
    cfg = TableConfig(size=3, width=2, min_n=2, max_n=3)
    rows = [list(range(1, 30)), list(range(40, 70))]
    t = _commit_all(NgramTable.empty(cfg), rows)
    assert len(_entries(t)) <= 3
    for gram, follow in _entries(t):
        assert any(_occurs(gram + follow, r) for r in rows)


def test_rows_that_opt_out_never_write():
    cfg = TableConfig(size=256, width=2)
    t = _commit_all(NgramTable.empty(cfg), [list(range(1, 12)), list(range(50, 62))], contribute=[False, True])
    assert _entries(t) and all(all(x >= 50 for x in g + f) for g, f in _entries(t))


# ---- in the loop ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def eng(tiny_model):
    return Engine(tiny_model)


@pytest.fixture(scope="module")
def alone(eng):
    return [r.tokens for r in eng.generate(PROMPTS, max_new_tokens=M, batch_size=1)]


@pytest.mark.parametrize("size", [1, 5, 1 << 12])
def test_engine_with_a_table_equals_plain(eng, alone, size):
    res = eng.generate(PROMPTS, max_new_tokens=M, spec=SpecConfig.make("ngram", k=4, ngram_table=size))
    assert [r.tokens for r in res] == alone  # collisions and eviction (size 1, 5) change nothing


def _serve(eng, *, table, order=(0, 0, 1, 2, 3), contribute=None, slots=1, spec=None):
    s = Scheduler(eng, slots=slots, spec=spec or SpecConfig(method="ngram", k=4), chunk=4,
                  opts=GenerateOptions(max_new_tokens=M), max_prompt_tokens=16, ngram_table=table)
    for i, p in enumerate(order):
        s.submit(PROMPTS[p], contribute=True if contribute is None else contribute[i])
    return s


def test_an_earlier_requests_ngrams_are_proposed_to_a_later_one(eng, alone):
    """The same prompt twice, one after the other: with the table the second request is drafted
    from the first one's answer before its own text repeats."""
    kept = {}
    for table in (0, 1 << 12):
        s = _serve(eng, table=table, order=(0, 0))
        out = s.run()
        assert [r.tokens for r in out] == [alone[0]] * 2
        kept[table] = [r.counters.num_accepted_tokens for r in out]
    assert kept[0][0] == kept[0][1] == kept[1 << 12][0]  # nothing to learn from before request 0
    assert kept[1 << 12][1] > kept[0][1], kept
    assert s.memory().parts["ngram_table"] == s.table.nbytes > 0


def test_opted_out_request_never_enters_the_table(eng, alone):
    s = _serve(eng, table=1 << 12, order=(2,), contribute=[False])
    out = s.run()
    assert out[0].tokens == alone[2] and _entries(s.state.table) == []
    s = _serve(eng, table=1 << 12, order=(2, 1), contribute=[False, True])
    out = s.run()
    assert [r.tokens for r in out] == [alone[2], alone[1]]
    entries = _entries(s.state.table)
    assert entries and all(_occurs(g + f, PROMPTS[1] + out[1].tokens) for g, f in entries)


def test_cancellation_leaves_the_table_and_other_rows_consistent(eng, alone):
    s = _serve(eng, table=1 << 10, order=(0, 1, 2, 3), slots=2, spec=SpecConfig(method="ngram", k=2))
    s.step()  # one chunk of 4 steps: at most 12 of request 0's 24 tokens
    assert s.requests[0].status == "running"
    s.cancel(0)
    out = s.run()
    assert [r.status for r in out] == ["cancelled", "finished", "finished", "finished"]
    assert [r.tokens for r in out[1:]] == alone[1:] and out[0].tokens == alone[0][: len(out[0].tokens)]
    texts = [PROMPTS[p] + r.tokens for p, r in zip((0, 1, 2, 3), out)]
    for g, f in _entries(s.state.table):  # every entry is text some request committed
        assert any(_occurs(g + f, t) for t in texts), (g, f)
