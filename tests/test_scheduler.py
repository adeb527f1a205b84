"""Continuous batching: every request completes once, with the tokens it gets alone."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax import telemetry
from specjax.core import slots as slot_ops
from specjax.methods.config import SpecConfig
from specjax.serving.controller import PLAIN, ControllerConfig, CostModel
from specjax.serving.engine import Engine, GenerateOptions
from specjax.models import config as model_config
from specjax.models import loader
from specjax.methods import registry
from specjax.core.proposer import Stateless
from specjax.serving.scheduler import Scheduler, poisson_arrivals
from specjax.models.eagle import EagleConfig, EagleHead
from specjax.models.heads import HeadsConfig, MedusaHeads
from specjax.methods.eagle.record import LoadedEagle
from specjax.methods.medusa.record import LoadedHeads
from specjax.methods.draft.record import DraftModel

PROMPTS = [
    [5, 9, 12, 5, 9, 12, 5, 9],
    list(range(1, 31)),
    [40, 41, 42, 43, 40, 41],
    [3, 4, 5, 3, 4, 5, 3],
    [7, 8, 7, 8, 7],
    list(range(10, 50)),  # a second prompt bucket (64)
]
BUDGETS = [20, 7, 16, 3, 12, 9]
M = 20
SPECS = {"none": SpecConfig(), "ngram": SpecConfig(method="ngram", k=4), "auto": "auto",
         "draft": SpecConfig(method="draft", k=3), "medusa": SpecConfig(method="medusa", k=3),
         "medusa-tree": SpecConfig.make("medusa", tree="small"), "auto-medusa": "auto",
         "eagle-tree": SpecConfig.make("eagle", k=3, nodes=6, topk=2), "auto-eagle": "auto"}
AUTO_EAGLE = ControllerConfig(ks=(0, 2), methods=("ngram",), extra=(
    SpecConfig(method="eagle", k=3), SpecConfig.make("eagle", k=3, nodes=6, topk=2)), prior_alpha=0.9)
AUTO_MEDUSA = ControllerConfig(ks=(0, 2, 4), methods=("ngram",), extra=(
    SpecConfig(method="medusa", k=2), SpecConfig.make("medusa", tree="small")), prior_alpha=0.9)


@pytest.fixture(scope="module")
def eng(tiny_model):
    """With an untrained draft model and random Medusa heads: their per-row states (a cache, a
    hidden state) are scattered into the batch too."""
    heads = MedusaHeads(HeadsConfig.for_model(tiny_model.config, num_heads=4), base=tiny_model,
                        rngs=nnx.Rngs(0))
    k1, k2 = jax.random.split(jax.random.key(0))
    heads.w[...] = jax.random.normal(k1, heads.w.shape) * 0.5 * tiny_model.config.dim ** -0.5
    heads.b[...] = jax.random.normal(k2, heads.b.shape) * 0.5
    eng = Engine(tiny_model, assets={"draft": DraftModel(loader.init_model(model_config.preset("tiny"), seed=1)),
                                     "medusa": LoadedHeads(heads)})
    head = EagleHead(EagleConfig.for_model(tiny_model.config, draft_vocab=64), rngs=nnx.Rngs(2))
    eng.set_asset("eagle", LoadedEagle(head, np.arange(64)))
    return eng


@pytest.fixture(scope="module")
def alone(eng):
    """Each prompt decoded by itself (batch of one, plain loop): the oracle."""
    return [eng.generate([p], max_new_tokens=m)[0].tokens for p, m in zip(PROMPTS, BUDGETS)]


def serve(eng, spec, *, slots=2, prompts=PROMPTS, budgets=BUDGETS, opts=None, **kw):
    s = Scheduler(eng, slots=slots, spec=spec, opts=opts or GenerateOptions(max_new_tokens=M), chunk=3,
                  max_prompt_tokens=40, **kw)  # one cache length for all tests: programs are shared
    for p, m in zip(prompts, budgets):
        s.submit(p, max_new_tokens=m, task="a" if len(p) < 10 else "b")
    return s


@pytest.mark.parametrize("method", list(SPECS))
def test_every_request_once_with_its_alone_tokens(eng, alone, method):
    kw = {}
    if method == "auto-medusa":  # chooses among prompt lookup, a Medusa chain and a Medusa tree
        kw = dict(controller=AUTO_MEDUSA)
    if method == "auto-eagle":  # an EAGLE chain and a dynamic tree beside prompt lookup
        kw = dict(controller=AUTO_EAGLE)
    s = serve(eng, SPECS[method], **kw)
    running = []
    out = s.run(on_chunk=lambda s: running.append(sum(r is not None for r in s.slots)))
    assert [r.id for r in out] == list(range(len(PROMPTS)))
    assert all(r.status == "finished" for r in out) and not s.queue
    assert max(running) <= 2 and s.slots == [None, None]
    for r, want, m in zip(out, alone, BUDGETS):
        assert r.tokens == want and r.stop_reason == "max_new_tokens" and len(r.tokens) == m
        assert r.ttft_s >= 0 and r.finished_s >= r.emissions[0][0]
        assert sum(n for _, n in r.emissions) == len(r.tokens)
        assert len(r.itl_s) == len(r.tokens) - 1
    assert {r.slot for r in out} == {0, 1}  # finished slots were refilled
    mem = s.memory().parts
    assert mem["caches"] > 0 and (mem["draft_weights"] > 0) == (method not in ("none", "ngram", "auto"))
    if method == "auto-medusa":
        assert set(s.cost.seconds) == set(AUTO_MEDUSA.options)
        small = SpecConfig.make("medusa", tree="small")
        assert {o.label for o in s.cost.seconds} == {"none", "ngram:2", "ngram:4", "medusa:2", f"medusa-tree:{small.k}"}
        used = {k for r in out for k in r.chunks}
        assert used - {"none"}, used  # with an optimistic prior it speculates at first
    if method == "ngram":
        assert sum(r.counters.num_accepted_tokens for r in out) > 0
        for r in out:
            c = r.counters
            assert c.num_draft_tokens == 4 * c.num_drafts == 4 * r.target_forwards
            assert c.num_accepted_tokens == sum(c.accepted_tokens_per_pos)
            assert len(r.tokens) - 1 <= c.num_accepted_tokens + r.target_forwards


def test_stop_tokens_and_sampling_match_alone(eng):
    stop = eng.generate([PROMPTS[0]], max_new_tokens=M)[0].tokens[5]
    kw = dict(max_new_tokens=M, stop_ids=(stop,), temperature=0.9, top_k=8, seed=3)
    want = eng.generate(PROMPTS[:3], batch_size=1, **kw)  # global rows 0..2: request ids 0..2
    s = serve(eng, SpecConfig(), slots=2, prompts=PROMPTS[:3], budgets=[M] * 3, opts=GenerateOptions(**kw))
    for r, w in zip(s.run(), want):
        assert r.tokens == w.tokens and r.stop_reason == w.stop_reason


def test_cancel_frees_the_slot_and_leaves_the_others(eng, alone):
    s = serve(eng, SpecConfig(method="ngram", k=2), prompts=PROMPTS[:4], budgets=[M, M, 16, 3])
    s.step()  # admits 0 and 1, decodes a chunk
    assert [r.status for r in s.requests] == ["running", "running", "queued", "queued"]
    s.cancel(3)  # a queued request never runs
    s.cancel(0)
    assert s.slots[0] is None and bool(np.asarray(s.state.done)[0])
    out = s.run()
    assert [r.status for r in out] == ["cancelled", "finished", "finished", "cancelled"]
    assert out[2].slot == 0 and out[3].tokens == []
    assert out[0].tokens == alone[0][: len(out[0].tokens)] and len(out[0].tokens) < M
    full = eng.generate([PROMPTS[1]], max_new_tokens=M)[0].tokens
    assert out[1].tokens == full and out[2].tokens == alone[2]


def test_admit_reports_each_insert_and_warm_leaves_an_empty_batch(eng, alone):
    """A server streams each first token as its prefill ends (`admit(on_insert=)`); `warm` runs every
    insert program once on a placeholder that leaves no running row and nothing in the n-gram table."""
    s = serve(eng, SpecConfig(method="ngram", k=2), slots=3, prompts=PROMPTS[:4], budgets=BUDGETS[:4])
    s.prepare()
    table = np.asarray(s.state.table.keys).copy()
    s.warm()
    assert s.slots == [None] * 3 and bool(np.asarray(s.state.done).all())
    np.testing.assert_array_equal(np.asarray(s.state.table.keys), table)
    seen = []
    s.admit(on_insert=lambda r: seen.append((r.id, r.status, list(r.tokens))))
    assert [x[0] for x in seen] == [0, 1, 2]  # three free slots, one call per request, in order
    assert all(status == "running" and len(toks) == 1 for _, status, toks in seen)
    out = s.run()
    assert [r.tokens for r in out] == alone[:4]


def test_compiles_once_per_k(eng):
    serve(eng, "auto").run()
    before = eng.compile_count
    s = serve(eng, "auto")
    s.run()
    assert eng.compile_count == before  # same shapes: nothing new, whichever K each chunk used
    assert {o.label for o in s.cost.seconds} == {"none", "ngram:2", "ngram:4", "ngram:8"}
    assert set(s.cost.seconds) == set(ControllerConfig().options) and PLAIN in s.cost.seconds


class FixedCosts(CostModel):
    """Step costs that the chunks do not move (`CostModel.observe` ignored)."""

    def observe(self, option, seconds, steps):
        pass


def fixed_costs(monkeypatch, seconds: dict):
    """Replaces the scheduler's timed calibration, and the costs its chunks measure, by fixed step
    costs: the tiny model's timings are noise, and a verify measured cheaper than a plain step would
    turn a test of acceptance into one of timing."""
    monkeypatch.setattr(Scheduler, "calibrate",
                        lambda self, *a, size=None, **kw: FixedCosts(seconds, batch=size or self.b))


@pytest.mark.parametrize("replay", [True, False])
def test_prompt_lookup_is_replayed_over_plain_chunks(eng, alone, replay, monkeypatch):
    """A pessimistic prior keeps every chunk plain; the replay still teaches the controller what
    prompt lookup would have kept on that text (the repeating prompts give it matches)."""
    fixed_costs(monkeypatch, {PLAIN: 1.0, SpecConfig(method="ngram", k=2): 1.05, SpecConfig(method="ngram", k=4): 1.1})
    cfg = ControllerConfig(ks=(0, 2, 4), prior_alpha=0.0, prior_weight=1e6, probe_every=10**6,
                           replay_ngram=replay)
    s = serve(eng, "auto", controller=cfg)
    out = s.run()
    assert {c.option for c in s.chunk_log} == {"none"}
    # the first row alone is inserted whole (no_gain); the rest bare, as nothing pays (bare)
    assert {c.reason for c in s.chunk_log} <= {"no_gain", "bare"} and all(c.expected_gain < 1.03 for c in s.chunk_log)
    assert [r.tokens for r in out] == alone
    a = s.controller.tasks.get(("a", "ngram"))
    if replay:
        assert a.tried[0] > 0 and a.kept[0] > 0 and a.tried[1] == a.kept[0]
    else:
        assert a is None


@pytest.mark.parametrize("pays", [False, True])
def test_auto_inserts_bare_where_speculation_does_not_pay(eng, alone, pays, monkeypatch):
    """Auto's plain runs bare (no method upkeep), and a request that joins a batch where no option is
    expected to pay is inserted bare: its prefill alone, plain chunks (reason "bare") until it leaves.
    A request alone is always inserted whole; with a cheap option that pays, none is bare. The
    tokens are the plain loop's either way."""
    fixed_costs(monkeypatch, {PLAIN: 1.0, SpecConfig(method="ngram", k=2): 1.0 if pays else 3.0})
    s = serve(eng, "auto", controller=ControllerConfig(ks=(0, 2), probe_every=10**6, explore_every=0))
    s.prepare()
    assert s.built.keys[PLAIN] == slot_ops.BARE
    inserted = []
    monkeypatch.setattr(s.batch, "insert", lambda slot, inputs, *, bare=False, insert=s.batch.insert:
                        inserted.append(bare) or insert(slot, inputs, bare=bare))
    out = s.run()
    assert [r.tokens for r in out] == alone and not s.steering.bare_rows
    assert inserted[0] is False and any(inserted) is not pays
    assert ("bare" in {c.reason for c in s.chunk_log}) is not pays


def test_opted_out_request_never_speculates(eng, alone):
    s = Scheduler(eng, slots=2, spec="auto", opts=GenerateOptions(max_new_tokens=M), chunk=3,
                  max_prompt_tokens=40)
    for i, (p, m) in enumerate(zip(PROMPTS[:3], BUDGETS[:3])):
        s.submit(p, max_new_tokens=m, opt_out=(i == 0))
    out = s.run()
    assert out[0].counters.num_drafts == 0 and set(out[0].chunks) == {"none"}
    assert [r.tokens for r in out] == alone[:3]


def test_poisson_arrivals(eng, alone):
    with pytest.raises(ValueError, match="rate"):
        poisson_arrivals(3, 0.0)
    with pytest.raises(ValueError, match="rate"):
        poisson_arrivals(3, -1.0)
    t = poisson_arrivals(4, 200.0, seed=1)
    assert len(t) == 4 and all(b > a for a, b in zip(t, t[1:])) and t[0] > 0
    s = Scheduler(eng, slots=2, opts=GenerateOptions(max_new_tokens=M), chunk=3, max_prompt_tokens=40)
    for p, m, a in zip(PROMPTS[:4], BUDGETS[:4], t):
        s.submit(p, max_new_tokens=m, arrival=a)
    out = s.run()
    assert [r.tokens for r in out] == alone[:4]
    assert all(r.arrived_s == a and r.emissions[0][0] >= a for r, a in zip(out, t))


def test_telemetry_records(eng):
    out = serve(eng, SpecConfig(method="ngram", k=4)).run()
    rows = telemetry.records([dict(id=r.id, task=r.task, counters=r.counters) for r in out], method="ngram")
    reqs = [x for x in rows if x["kind"] == "request"]
    agg = {x["task"]: x for x in rows if x["kind"] == "aggregate"}
    assert len(reqs) == len(out) and set(agg) == {"all", "a", "b"}
    assert agg["all"]["num_drafts"] == sum(x["num_drafts"] for x in reqs)
    assert agg["a"]["num_accepted_tokens"] + agg["b"]["num_accepted_tokens"] == agg["all"]["num_accepted_tokens"]
    assert agg["all"]["mean_acceptance_length"] == pytest.approx(
        1 + agg["all"]["num_accepted_tokens"] / agg["all"]["num_drafts"])
    res = eng.generate([PROMPTS[0]], max_new_tokens=M, spec=SpecConfig(method="ngram", k=4))[0]
    c = res.counters
    assert c.num_drafts == res.target_forwards and c.num_accepted_tokens == sum(c.accepted_tokens_per_pos)
    assert c.num_draft_tokens == 4 * c.num_drafts and sum(c.accept_hist) == c.num_drafts


def test_bad_input_fails_before_compiling(eng, tiny_model):
    before = eng.compile_count
    for kw, match in [(dict(slots=0), "slots"), (dict(slots=1.5), "slots"), (dict(slots=1, spec="fast"), "auto"),
                      (dict(slots=1, chunk=0), "chunk"),
                      (dict(slots=1, spec=SpecConfig(method="draft")), "draft model")]:
        with pytest.raises(ValueError, match=match):
            Scheduler(Engine(tiny_model), **kw)
    s = Scheduler(eng, slots=1, opts=GenerateOptions(max_new_tokens=8))
    with pytest.raises(ValueError, match="max_new_tokens"):
        s.submit([1, 2], max_new_tokens=9)
    with pytest.raises(ValueError, match="arrival"):
        s.submit([1, 2], arrival=-1.0)
    with pytest.raises(ValueError, match="empty"):
        s.submit([])
    assert eng.compile_count == before


@dataclasses.dataclass(frozen=True, kw_only=True)
class SelectiveOracle(Stateless):
    """Drafts the row's true greedy continuation (looked up by the prompt's first token) for prompts
    starting below token 32, and always-wrong tokens for the others. Costs next to nothing, so the
    controller's decision rests on acceptance alone."""

    k: int

    def propose(self, params, pstate, state, sampling_config, keys):
        cols = jnp.minimum(state.lengths[:, None] + jnp.arange(self.k)[None, :], params.shape[1] - 1)
        true = params[state.tokens[:, 0]][jnp.arange(state.tokens.shape[0])[:, None], cols]
        wrong = state.tokens[:, :1] >= 32
        return jnp.where(wrong, (true + 1) % 64, true), None, pstate


def _selective_method(eng, prompts, monkeypatch) -> ControllerConfig:
    """Registers method "selective" (`SelectiveOracle` over each prompt's plain continuation) and
    returns auto's settings over plain and selective:4."""
    table = np.zeros((64, 64), np.int32)
    for p, r in zip(prompts, eng.generate(prompts, max_new_tokens=M)):
        table[p[0], : len(p) + len(r.tokens)] = p + r.tokens
    monkeypatch.setitem(registry.RECORDS, "selective", registry.Record(
        "selective", lambda spec, assets: (SelectiveOracle(k=spec.k), jnp.asarray(table))))
    return ControllerConfig(ks=(0, 4), methods=("selective",), replay_ngram=False, margin=0.3)


def test_auto_falls_back_per_task_class(tiny_model, monkeypatch):
    """Class "copy" (drafts always right) keeps speculating, class "open" (never right) decodes plain
    once measured; the decision is in every chunk's record."""
    eng = Engine(tiny_model)
    tasks = ["copy", "open"] * 4
    prompts = [[3 + i, 5, 7] if t == "copy" else [40 + i, 5, 7] for i, t in enumerate(tasks)]
    cfg = _selective_method(eng, prompts, monkeypatch)
    # a fixed cost model (verify = 1.1 plain steps): timings of the tiny model are noise, and a
    # calibration that found the verify cheaper than a plain step once let an "open" row speculate
    fixed_costs(monkeypatch, {PLAIN: 1.0, SpecConfig(method="selective", k=4): 1.1})
    s = Scheduler(eng, slots=1, spec="auto", controller=cfg, opts=GenerateOptions(max_new_tokens=M), chunk=3,
                  max_prompt_tokens=16)
    for p, t in zip(prompts, tasks):
        s.submit(p, task=t)
    out = s.run()
    spec = lambda r: sum(n for k, n in r.chunks.items() if k != "none") / sum(r.chunks.values())
    copy = [spec(r) for r in out if r.task == "copy"]
    open_ = [spec(r) for r in out if r.task == "open"]
    assert all(x == 1.0 for x in copy), copy
    assert open_[0] > 0 and all(x == 0.0 for x in open_[1:]), open_  # measured once, then plain
    assert all(r.counters.num_accepted_tokens == 0 for r in out if r.task == "open")
    log = s.chunk_log
    assert {c.reason for c in log if c.tasks == {"open": 1} and not c.speculated} == {"no_gain"}
    assert all(c.reason == "gain" and c.expected_gain > 1 for c in log if c.tasks == {"copy": 1})


def test_auto_switches_between_plain_and_speculation_without_compiling(tiny_model, monkeypatch):
    """Fixed costs and drafts that are always right for class "copy" and never for "open": auto must
    run both plain and the speculative option, on both runs, and the second run compiles nothing."""
    eng = Engine(tiny_model)
    tasks = ["copy", "open", "open", "copy"]
    prompts = [[3 + i, 5, 7] if t == "copy" else [40 + i, 5, 7] for i, t in enumerate(tasks)]
    cfg = _selective_method(eng, prompts, monkeypatch)
    fixed_costs(monkeypatch, {PLAIN: 1.0, SpecConfig(method="selective", k=4): 1.1})

    def run():
        s = Scheduler(eng, slots=1, spec="auto", controller=cfg, opts=GenerateOptions(max_new_tokens=M),
                      chunk=3, max_prompt_tokens=16)
        for p, t in zip(prompts, tasks):
            s.submit(p, task=t)
        return s, s.run()

    s, out = run()
    before = eng.compile_count
    s2, out2 = run()
    assert eng.compile_count == before  # switching options reuses the programs the first run compiled
    assert [r.tokens for r in out2] == [r.tokens for r in out]
    for sched in (s, s2):
        log = sched.chunk_log
        assert {c.option for c in log} == {"none", "selective:4"}, log
        assert all(c.option == "selective:4" for c in log if c.tasks == {"copy": 1})
        assert any(c.option == "none" and c.reason == "no_gain" for c in log if c.tasks == {"open": 1})
    assert all(r.counters.num_accepted_tokens > 0 for r in out if r.task == "copy")


@pytest.mark.parametrize("method", ["none", "ngram", "auto", "draft", "medusa-tree", "eagle-tree"])
def test_smaller_batch_sizes_keep_every_row_exact(eng, alone, method, sizes_seen):
    """Rows packed at the front and chunks run at the smallest size holding them: same tokens."""
    s = serve(eng, SPECS[method], slots=4, batch_sizes=(1, 2))
    out = s.run()
    assert [r.tokens for r in out] == alone
    for c in s.chunk_log:  # running rows are packed: each chunk ran at the smallest size holding them
        assert c.batch_size == min(x for x in (1, 2, 4) if x >= c.rows), c
    assert sum(c.steps for c in s.chunk_log) == int(s.state.forwards)  # every chunk's steps counted
    assert all(c.steps >= 1 for c in s.chunk_log)
    if method == "auto":
        assert set(s.costs) == {1, 2, 4}
        assert all(0 < t < float("inf") for c in s.costs.values() for t in c.seconds.values()), s.costs
    sizes_seen.update(c.batch_size for c in s.chunk_log)


@pytest.fixture(scope="module")
def sizes_seen():
    seen = set()
    yield seen
    assert {1, 2, 4} <= seen, seen  # over the methods, every size ran

def test_an_option_and_its_resolved_spec_are_one_option(tiny_model):
    """tree="heads" is resolved by the Engine: the scheduler keys its options by the resolved spec,
    and a request naming the unresolved one gets that same option."""
    heads = MedusaHeads(HeadsConfig.for_model(tiny_model.config, num_heads=4), base=tiny_model, rngs=nnx.Rngs(0))
    e = Engine(tiny_model)
    e.set_asset("medusa", LoadedHeads(heads, tree=[[0], [1], [0, 0], [0, 0, 0]]))
    given = SpecConfig.make("medusa", tree="heads")
    resolved = e.resolve(given)
    assert given != resolved and resolved.label == "medusa-tree:3"  # the tuned tree, depth 3
    cfg = ControllerConfig(ks=(0, 2), extra=(given, resolved))
    s = Scheduler(e, slots=1, spec="auto", controller=cfg, opts=GenerateOptions(max_new_tokens=4), max_prompt_tokens=8)
    assert s.options == s.ccfg.options == (PLAIN, SpecConfig(method="ngram", k=2), resolved)
    assert list(s.specs) == [SpecConfig(method="ngram", k=2), resolved]
    rid = s.submit([3, 4, 5], speculation=given)
    assert s.live[rid].speculation == resolved
    with pytest.raises(ValueError, match="medusa:3.*none, ngram:2, medusa-tree:3"):
        s.submit([3, 4, 5], speculation=SpecConfig(method="medusa", k=3))
    with pytest.raises(ValueError, match="SpecConfig"):
        s.submit([3, 4, 5], speculation=("ngram", 2))
    fixed = Scheduler(e, slots=1, spec=given, with_plain=True, opts=GenerateOptions(max_new_tokens=4),
                      max_prompt_tokens=8)
    assert fixed.options == (PLAIN, resolved) and fixed.fixed == resolved
    assert fixed.live[fixed.submit([3, 4, 5], speculation=given)].speculation == resolved
