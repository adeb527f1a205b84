"""Every row of every batch and every request draws its own random stream.

Row r of a call draws `fold_in(key(seed), r)` (a request: its id), so no two rows share a stream and
a row's sample does not depend on the batch size or on which batch (or slot) it lands in.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.methods.config import SpecConfig
from specjax.core.decoder import row_keys
from specjax.serving.engine import Engine, GenerateOptions
from specjax.serving.scheduler import Scheduler

PROMPT = [5, 9, 12, 5, 9, 12, 5, 9]
ROWS = 16
NEW = 6
KW = dict(max_new_tokens=NEW, temperature=1.0, seed=3, stop_ids=())


@pytest.fixture(scope="module")
def eng(tiny_model):
    return Engine(tiny_model)


def _pairs_equal(samples):
    return sum(a == b for a, b in itertools.combinations(samples, 2))


@pytest.fixture(scope="module")
def per_row_first_token(tiny_model):
    """P(first token | PROMPT) at temperature 1 (the same for every row)."""
    toks = jnp.asarray([PROMPT])
    logits = tiny_model(toks, jnp.arange(len(PROMPT))[None], tiny_model.init_cache(1, 16)).logits
    return np.asarray(jax.nn.softmax(logits[0, -1]))


@pytest.mark.parametrize("method", ["none", "ngram"])
def test_repeated_prompt_rows_are_independent_across_batches(eng, per_row_first_token, method):
    """One prompt, 16 rows in two batches of 8: rows agree no more often than independent samples.

    Whole 6-token continuations of a 64-token vocabulary at temperature 1 collide with
    probability far below 1/100 between independent rows; the first tokens collide at the rate
    sum p^2, which bounds the expected number of agreeing pairs.
    """
    spec = SpecConfig(method=method, k=3) if method != "none" else SpecConfig()
    res = eng.generate([PROMPT] * ROWS, batch_size=8, spec=spec, **KW)
    seqs = [tuple(r.tokens) for r in res]
    assert _pairs_equal(seqs) == 0, "rows of different batches drew the same stream"
    firsts = [s[0] for s in seqs]
    pairs = ROWS * (ROWS - 1) // 2
    expected = pairs * float((per_row_first_token ** 2).sum())
    assert _pairs_equal(firsts) <= expected + 4 * np.sqrt(expected) + 3, (firsts, expected)


def test_a_global_row_draws_the_same_sample_at_any_batch_size(eng):
    one = eng.generate([PROMPT] * 8, batch_size=1, **KW)
    eight = eng.generate([PROMPT] * 8, batch_size=8, **KW)
    three = eng.generate([PROMPT] * 8, batch_size=3, **KW)  # padded last batch
    assert [r.tokens for r in one] == [r.tokens for r in eight] == [r.tokens for r in three]
    assert len({tuple(r.tokens) for r in one}) > 1


def test_scheduler_requests_draw_their_own_streams(eng):
    """Through the scheduler, request i draws the stream of global row i, whatever its slot."""
    opts = GenerateOptions(**KW)
    s = Scheduler(eng, slots=3, opts=opts, chunk=2)
    for _ in range(8):
        s.submit(PROMPT)
    got = [r.tokens for r in s.run()]
    assert _pairs_equal([tuple(t) for t in got]) == 0
    assert got == [r.tokens for r in eng.generate([PROMPT] * 8, batch_size=8, **KW)]


def test_row_keys_are_distinct_and_do_not_depend_on_the_batch():
    a = jax.random.key_data(row_keys(0, range(8)))
    b = jax.random.key_data(row_keys(0, range(4, 12)))
    assert len({tuple(np.asarray(k).tolist()) for k in a}) == 8
    np.testing.assert_array_equal(a[4:], b[:4])
    c = jax.random.key_data(row_keys(1, range(8)))
    assert not np.array_equal(a, c)  # another seed, other streams
