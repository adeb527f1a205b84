"""Structured answers in the scheduler: a constraint pool of one automaton per slot (toy automata from
tests/test_constrain_device.py on the tiny model).

Constrained requests beside free ones, more of them than slots (pool slots reused), plain and prompt
lookup, packed with moves: each request's tokens are its own batch-of-one constrained generation, its
row carries its pool slot wherever it moves, and nothing compiles after the warm-up.
"""

import numpy as np
import pytest
from test_constrain_device import DIGITS, FORCED, STOP

from specjax.methods.config import SpecConfig
from specjax.serving.constraints import ConstraintLimits, PoolSlots
from specjax.serving.engine import Engine, GenerateOptions
from specjax.serving.scheduler import Scheduler

PROMPTS = [[5, 9, 12, 5, 9, 12, 5, 9], [11, 12, 13, 11, 12], [40, 41, 42, 43, 40, 41], [7, 7, 30],
           [1, 2, 3, 4, 5, 6], [20, 21, 20, 21, 20]]
BUDGETS = [12, 9, 16, 7, 11, 10]
TOYS = [DIGITS, None, FORCED, DIGITS, None, FORCED]  # four constrained, two free
M = 16
LIMITS = ConstraintLimits(states=8, classes=8)


@pytest.fixture(scope="module")
def eng(tiny_model):
    return Engine(tiny_model)


def _opts(m=M):
    return GenerateOptions(max_new_tokens=m, stop_ids=(STOP,))


@pytest.fixture(scope="module")
def alone(eng):
    """Each request decoded by itself (a batch of one, the plain loop) with its constraint: the oracle."""
    return [eng.start([p], _opts(m), constraint=toy).run()[0].tokens for p, m, toy in zip(PROMPTS, BUDGETS, TOYS)]


def serve(eng, spec, *, slots=2, pool=LIMITS, **kw) -> Scheduler:
    s = Scheduler(eng, slots=slots, spec=spec, opts=_opts(), chunk=3, max_prompt_tokens=16, constraint_pool=pool,
                  **kw)
    for p, m, toy in zip(PROMPTS, BUDGETS, TOYS):
        s.submit(p, max_new_tokens=m, constraint=toy)
    return s


def _rows_keep_their_pool_slots(s: Scheduler) -> None:
    """After a chunk: each running row's device pool slot is its request's (0 for a free one)."""
    held = np.asarray(s.state.constraint)
    for i, r in enumerate(s.slots):
        if r is not None:
            assert held[i] == r.pool_slot == (0 if TOYS[r.id] is None else held[i]) and (held[i] > 0) == (
                TOYS[r.id] is not None), (i, r.id, held)


@pytest.mark.parametrize("spec", [SpecConfig(), SpecConfig(method="ngram", k=4)], ids=["plain", "ngram"])
def test_constrained_requests_beside_free_ones_equal_each_alone(eng, alone, spec):
    """Six requests through two slots: four constrained (pool slots 1 and 2 reused as requests finish),
    two free; every answer is its own alone, walks its automaton, and nothing compiles after warm."""
    s = serve(eng, spec)
    s.prepare()
    s.warm()
    compiled = eng.compile_count
    out = s.run(on_chunk=_rows_keep_their_pool_slots)
    assert eng.compile_count == compiled
    assert [r.status for r in out] == ["finished"] * len(PROMPTS)
    for r, want, toy in zip(out, alone, TOYS):
        assert r.tokens == want, (r.id, r.tokens, want)
        if toy is not None:
            assert toy.valid(r.tokens) and r.pool_slot in (1, 2), (r.id, r.tokens, r.pool_slot)
            assert r.constraint is None  # freed: history keeps no tables
        else:
            assert r.pool_slot == 0
    assert s._pool_slots.held == {}  # every slot freed
    assert {r.pool_slot for r in out if r.pool_slot} == {1, 2}  # four constrained requests, two slots: reused


def test_packing_moves_rows_with_their_constraints(eng, alone):
    """Four slots run at batch sizes 1, 2 and 4: rows packed forward by moves keep their pool slot."""
    s = serve(eng, SpecConfig(method="ngram", k=4), slots=4, batch_sizes=(1, 2))
    moves = []
    s.prepare()
    s.warm()
    compiled, move = eng.compile_count, s.batch.move
    s.batch.move = lambda src, dst: (moves.append((src, dst)), move(src, dst))
    out = s.run(on_chunk=_rows_keep_their_pool_slots)
    assert [r.tokens for r in out] == alone
    assert moves, "no row moved"
    assert eng.compile_count == compiled


def test_constrained_submits_are_refused_with_the_fix(eng, tiny_model):
    """No pool, a constraint larger than the pool, two constraints, no stop token: one ValueError
    each, at submit, before anything compiles."""
    compiled = eng.compile_count
    free = Scheduler(eng, slots=1, opts=_opts(), max_prompt_tokens=16)
    with pytest.raises(ValueError, match=r"no constraint pool.*constraint_pool=ConstraintLimits.*--constraint-states"):
        free.submit([1, 2], constraint=DIGITS)
    free.submit([1, 2], response_format={"type": "text"})  # text: no constraint
    small = Scheduler(eng, slots=1, opts=_opts(), max_prompt_tokens=16, constraint_pool=ConstraintLimits(states=2))
    with pytest.raises(ValueError, match=r"3 automaton states.*at most 2.*states=.*--constraint-states"):
        small.submit([1, 2], constraint=DIGITS)
    narrow = Scheduler(eng, slots=1, opts=_opts(), max_prompt_tokens=16, constraint_pool=ConstraintLimits(classes=4))
    with pytest.raises(ValueError, match=r"6 token classes.*at most 4.*classes=.*--constraint-classes"):
        narrow.submit([1, 2], constraint=FORCED)
    s = Scheduler(eng, slots=1, opts=_opts(), max_prompt_tokens=16, constraint_pool=LIMITS)
    with pytest.raises(ValueError, match="regex and constraint given together"):
        s.submit([1, 2], regex="a+", constraint=DIGITS)
    with pytest.raises(ValueError, match="tokenizer"):  # compiled through the engine: it has no tokenizer
        s.submit([1, 2], choice=["a", "b"])
    stopless = Scheduler(eng, slots=1, opts=GenerateOptions(max_new_tokens=M), max_prompt_tokens=16,
                         constraint_pool=LIMITS)
    with pytest.raises(ValueError, match="stop token"):
        stopless.submit([1, 2], constraint=DIGITS)
    with pytest.raises(TypeError, match="ConstraintLimits"):
        Scheduler(eng, slots=1, opts=_opts(), constraint_pool=8)
    with pytest.raises(ValueError, match="states=0"):
        ConstraintLimits(states=0)
    assert eng.compile_count == compiled
    assert not s.queue and not small.queue and len(free.queue) == 1


def test_pool_slots_lowest_free_first():
    slots = PoolSlots(2)
    assert (slots.take(7), slots.take(3)) == (1, 2)
    with pytest.raises(RuntimeError, match="held"):
        slots.take(9)
    slots.free(7)
    assert slots.take(9) == 1 and slots.held == {9: 1, 3: 2}
    slots.clear()
    assert slots.held == {}


def test_cancel_and_reset_free_pool_slots(eng, alone):
    """A cancelled constrained request frees its pool slot for the next one; a reset batch frees all."""
    s = serve(eng, SpecConfig(), slots=2)
    s.step()  # requests 0 (DIGITS, pool slot 1) and 1 (free) run
    assert s._pool_slots.held == {0: 1}
    s.cancel(0)
    assert s._pool_slots.held == {} and s.requests[0].constraint is None
    s.step()  # request 2 (FORCED) takes row 0 and the freed pool slot 1
    assert s._pool_slots.held == {2: 1} and s.requests[2].pool_slot == 1
    failed = s.reset_batch("device error")
    assert {r.id for r in failed} == {1, 2} and s._pool_slots.held == {}
    out = s.run()
    assert [r.status for r in out] == ["cancelled", "failed", "failed", "finished", "finished", "finished"]
    assert [r.tokens for r in out[3:]] == alone[3:]


def test_auto_runs_forced_beside_prompt_lookup_under_constraints(eng, alone):
    """Auto choosing among plain, prompt lookup and `forced` (each at its K's) over constrained and free
    requests: every answer equals its own alone, forced chunks ran and drafted the forced text (the
    FORCED rows accept 3 7 3 7 in one step), and nothing compiles after the warm-up."""
    from specjax.serving.controller import ControllerConfig

    ccfg = ControllerConfig(methods=("ngram", "forced"), ks=(0, 4), explore_every=1)
    s = serve(eng, "auto", controller=ccfg)
    assert {o.method for o in s.options} == {"none", "ngram", "forced"}
    s.prepare()
    s.warm()
    compiled = eng.compile_count
    out = s.run(on_chunk=_rows_keep_their_pool_slots)
    assert eng.compile_count == compiled
    assert [r.tokens for r in out] == alone
    ran = {k for r in out for k in r.chunks}
    assert any(k.startswith("forced") for k in ran), ran
    assert {"ngram", "forced"} <= set(s.replays.specs)  # both replayed while other options run


def test_replays_give_forced_evidence_from_text_other_options_commit(alone):
    """The host replays auto learns from (`specjax.serving.replays`): over a FORCED answer that the plain
    loop committed, forced text would have kept 7 3 7 after the first token (the automaton walked on
    the host), prompt lookup less; after a chunk of forced itself its replay only catches up; a request
    that ends leaves nothing behind."""
    from specjax.serving.replays import Replays
    from specjax.serving.requests import Request

    seen = []
    replays = Replays([SpecConfig(method="ngram", k=2), SpecConfig(method="ngram", k=4), SpecConfig(method="forced", k=4),
                       SpecConfig()], lambda: lambda row, kind, kept, steps: seen.append((row, kind, list(kept), steps)))
    assert {k: s.k for k, s in replays.specs.items()} == {"ngram": 4, "forced": 4}  # each kind at its longest k
    r = next(i for i, t in enumerate(TOYS) if t is FORCED)
    req = Request(id=r, ids=PROMPTS[r], max_new_tokens=BUDGETS[r], constraint=FORCED, tokens=alone[r][:1])
    replays.start(req)
    req.tokens = alone[r]
    replays.chunk(req, ran="none")
    by_kind = {kind: (kept, steps) for _, kind, kept, steps in seen}
    assert by_kind["forced"][0][:3] == [1, 1, 1] and sum(by_kind["forced"][0]) > sum(by_kind["ngram"][0]), seen
    seen.clear()
    req.tokens = alone[r] + [STOP]  # more text, committed by forced itself: no replayed evidence for it
    replays.chunk(req, ran="forced")
    assert all(kind == "ngram" for _, kind, _, _ in seen), seen
    replays.end(req)
    assert not replays._rows
