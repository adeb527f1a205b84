"""Adaptive controller on synthetic acceptance traces (pure host arithmetic, no model)."""

import numpy as np
import pytest

from specjax.methods.config import SpecConfig
from specjax.serving.controller import (PLAIN, Controller, ControllerConfig, CostModel, Plan, Reason, expected_tokens,
                                        expected_tokens_rates, plan, position_counts)


def ngram(k: int) -> SpecConfig:
    return SpecConfig(method="ngram", k=k)


# batch 1 on CPU: a 9-token verify costs about 1.5 plain steps (docs/BENCHMARKS.md)
LIGHT = CostModel({PLAIN: 1.0, ngram(2): 1.15, ngram(4): 1.3, ngram(8): 1.6}, batch=1)
# compute-bound: a K+1 window costs a little more than K+1 plain steps
HEAVY = CostModel({PLAIN: 1.0, ngram(2): 3.1, ngram(4): 5.2, ngram(8): 9.3}, batch=16)
# batch 16 as measured on CPU (verify at K=4: 2.5x a plain step)
MEASURED_16 = CostModel({PLAIN: 1.0, ngram(2): 1.8, ngram(4): 2.5, ngram(8): 4.0}, batch=16)


def trace(alpha, k, steps, rng):
    """Per-position acceptance counts of `steps` steps where each draft is kept with prob alpha."""
    n = np.minimum(rng.geometric(1 - alpha, size=steps) - 1, k) if alpha < 1 else np.full(steps, k)
    return [int((n > j).sum()) for j in range(k)]


def run(controller, rows, alphas, chunks=30, steps=8, seed=0):
    """Feeds a controller chunk by chunk as the scheduler does; returns the options it chose."""
    rng = np.random.default_rng(seed)
    chosen = []
    for _ in range(chunks):
        plan = controller.choose(rows)
        chosen.append(plan.option)
        if plan.k:
            for r in rows:
                controller.observe(r, plan.option.kind, trace(alphas[r], plan.k, steps, rng), steps)
    return chosen


def test_expected_tokens():
    assert expected_tokens(0.0, 4) == 1.0 and expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert expected_tokens(0.7, 0) == 1.0
    a, k = 0.6, 5
    assert expected_tokens(a, k) == pytest.approx(sum(a ** j for j in range(k + 1)))


def test_position_counts_and_rates():
    # 10 steps at K=3: position 0 tried 10 times, kept 6; position 1 tried 6, kept 3; ...
    tried, kept = position_counts([6, 3, 1], steps=10)
    assert tried.tolist() == [10, 6, 3] and kept.tolist() == [6, 3, 1]
    assert expected_tokens_rates([0.6, 0.5, 1 / 3], 3) == pytest.approx(1 + 0.6 + 0.3 + 0.1)
    assert expected_tokens_rates([0.5] * 4, 4) == pytest.approx(expected_tokens(0.5, 4))
    # a proposer that is either wholly right or wholly wrong: the first draft is the gamble
    c = Controller(ControllerConfig(prior_weight=0.0), LIGHT)
    c.add_row("a")
    c.observe("a", "ngram", [3, 3, 3, 3], steps=10)
    assert c.rates("a", "ngram")[:4].tolist() == pytest.approx([0.3, 1, 1, 1])
    assert c.expected("a", ngram(4)) == pytest.approx(1 + 4 * 0.3)
    assert c.alpha("a", "ngram") == pytest.approx(12 / 19)


def test_high_acceptance_raises_k():
    c = Controller(ControllerConfig(), LIGHT)
    c.add_row("a", task="translation")
    chosen = run(c, ["a"], {"a": 0.9})
    assert chosen[-10:] == [ngram(8)] * 10
    assert c.alpha("a", "ngram") == pytest.approx(0.9, abs=0.08)
    assert c.rates("a", "ngram")[:8] == pytest.approx([0.9] * 8, abs=0.1)

    mid = Controller(ControllerConfig(), LIGHT)
    mid.add_row("b", task="qa")
    k_mid = run(mid, ["b"], {"b": 0.45})[-1].depth
    assert 0 < k_mid < 8  # medium acceptance: a shorter window pays best


def test_low_acceptance_falls_back_to_plain():
    c = Controller(ControllerConfig(), LIGHT)
    c.add_row("a", task="mt_bench")
    chosen = run(c, ["a"], {"a": 0.05}, chunks=40)
    assert chosen[0] != PLAIN  # the prior says try it
    late = chosen[10:]
    assert late.count(PLAIN) >= len(late) - 3  # at most a rare probe once acceptance is known
    assert c.choose(["a"]).gain < 1.0


def test_heavy_load_switches_speculation_off():
    """When a verify step costs K+1 plain steps nothing can pay, even a perfect proposer."""
    c = Controller(ControllerConfig(), HEAVY)
    c.add_row("a")
    chosen = run(c, ["a"], {"a": 1.0}, chunks=50)
    assert set(chosen) == {PLAIN}
    # with the costs measured at batch 16, prompt lookup's typical acceptance does not pay either
    rows = [f"r{i}" for i in range(16)]
    c = Controller(ControllerConfig(), MEASURED_16)
    for r in rows:
        c.add_row(r, task="qa")
    chosen = run(c, rows, {r: 0.35 for r in rows}, chunks=60)
    assert chosen[10:].count(PLAIN) >= 48
    # the same acceptance at batch 1 does pay
    c = Controller(ControllerConfig(), LIGHT)
    c.add_row("x")
    assert run(c, ["x"], {"x": 0.35}, chunks=20)[-1] != PLAIN


def test_opted_out_request_never_speculates():
    c = Controller(ControllerConfig(probe_every=1), LIGHT)
    c.add_row("out", opt_out=True)
    c.add_row("in")
    assert c.choose_row("out") == PLAIN and c.choose_row("in") != PLAIN
    assert set(run(c, ["out", "in"], {"out": 1.0, "in": 1.0}, chunks=20)) == {PLAIN}
    assert c.choose(["out", "in"]).reason == "opt_out"
    assert c.choose(["in"]).option != PLAIN  # once it leaves, the batch speculates again


def test_statistics_per_task_seed_new_rows():
    c = Controller(ControllerConfig(), LIGHT)
    c.add_row("t1", task="translation")
    c.add_row("m1", task="mt_bench")
    run(c, ["t1"], {"t1": 0.9}, chunks=10)
    c.remove_row("t1")
    c.add_row("m1b", task="mt_bench")
    c.observe("m1b", "ngram", [0, 0, 0, 0], steps=40)
    c.add_row("t2", task="translation")  # a new request of a task seen before starts from it
    assert c.alpha("t2", "ngram") > 0.8
    assert c.task_alpha("mt_bench", "ngram") < 0.1
    s = c.summary()
    assert set(s) == {"translation", "mt_bench"} and s["translation"]["ngram"]["expected_tau"][8] > 4


def test_a_kind_not_yet_tried_starts_from_its_class_evidence():
    """A class whose text prompt lookup (its host replay) keeps little: a method never run there is
    judged by that pooled evidence, so it is not run once at the prior's optimism (0.5: gain 1.59
    here) to learn that it loses too; a class with no evidence still starts from the prior (the
    control), another class's evidence does not leak in, and the probe still tries the method (the
    cheapest option, untried: its bonus is whole)."""
    other = SpecConfig(method="medusa", k=2)
    cost = CostModel({**LIGHT.seconds, other: 1.1}, batch=1)
    c = Controller(ControllerConfig(extra=(other,), probe_every=4, follow_costs=False), cost)
    for row, task in (("q", "qa"), ("t", "translation"), ("n", "new")):
        c.add_row(row, task=task)
    c.observe("q", "ngram", [2, 1, 0, 0], steps=40)
    c.observe("t", "ngram", [36, 33, 30, 27], steps=40)
    pooled = (3 + 0.5 * 4) / (43 + 4)  # kept / tried over positions, shrunk to the prior by its weight
    assert c.task_rates("qa", "medusa")[0] == pytest.approx((2 + pooled * 4) / (40 + 4))
    assert c.gain(["q"], other) < 1.0 < c.gain(["n"], other) == pytest.approx(1.75 / 1.1)
    assert c.task_rates("translation", "medusa")[0] > 0.8  # its own class's evidence, not qa's
    plans = [c.choose(["q"]) for _ in range(6)]
    assert [p.reason for p in plans[:4]] == [Reason.NO_GAIN] * 4
    assert plans[4].reason == Reason.PROBE and plans[4].option == other


def test_probe_after_plain_run_only_when_it_could_pay():
    cfg = ControllerConfig(probe_every=4, prior_weight=1.0)
    c = Controller(cfg, LIGHT)
    c.add_row("a")
    c.observe("a", "ngram", [0, 0], steps=3)  # little evidence of failure
    reasons = [c.choose(["a"]).reason for _ in range(10)]
    assert "probe" in reasons and reasons[0] == "no_gain"
    h = Controller(cfg, HEAVY)
    h.add_row("a")
    assert "probe" not in [h.choose(["a"]).reason for _ in range(20)]


def test_bad_config():
    with pytest.raises(ValueError, match="ks"):
        ControllerConfig(ks=(0, -2))
    with pytest.raises(ValueError, match="methods"):
        ControllerConfig(methods=("none",))
    with pytest.raises(ValueError, match="plain_every=0"):
        ControllerConfig(plain_every=0)
    with pytest.raises(ValueError, match="lacks"):
        Controller(ControllerConfig(ks=(0, 3)), LIGHT)
    assert ControllerConfig(ks=(4, 2)).options == (PLAIN, ngram(2), ngram(4))
    medusa = SpecConfig(method="medusa", k=3)
    assert ControllerConfig(ks=(2,), extra=(medusa, medusa)).options == (PLAIN, ngram(2), medusa)
    assert [o.label for o in ControllerConfig(ks=(2,), extra=(medusa,)).options] == ["none", "ngram:2", "medusa:3"]
    with pytest.raises(ValueError, match="extra"):
        ControllerConfig(extra=(("medusa", 3),))  # options are SpecConfigs
    with pytest.raises(ValueError, match="extra"):
        ControllerConfig(extra=(PLAIN,))


def test_max_step_cost_bounds_the_options_at_this_batch_size():
    """An option dearer than the bound is never chosen, however well it would pay; probes obey it too."""
    cost = CostModel({PLAIN: 1.0, ngram(2): 1.2, ngram(4): 1.4, ngram(8): 1.8})
    c = Controller(ControllerConfig(max_step_cost=1.5, probe_every=1), cost)
    c.add_row("r", task="t")
    c.observe("r", "ngram", accepted_per_position=[10] * 8, steps=10)  # every draft kept
    assert c.choose(["r"]).option == ngram(4)  # K=8 would pay more, but costs 1.8 plain steps
    c.cost = CostModel({PLAIN: 1.0, ngram(2): 1.6, ngram(4): 2.5, ngram(8): 3.8}, batch=16)
    assert c.allowed() == [] and all(c.choose(["r"]).option == PLAIN for _ in range(5))
    with pytest.raises(ValueError, match="max_step_cost"):
        ControllerConfig(max_step_cost=0.5)


def test_the_chunk_policy_and_its_reasons():
    """`plan`, the one policy of a host's chunk: an opted-out request keeps the batch plain, the option
    the running requests name wins (plain when they differ), else the fixed option or the controller.
    Every reason is a `Reason`, which reads as its string in logs and JSON."""
    from types import SimpleNamespace as Row

    row = lambda i, opt_out=False, speculation=None: Row(id=i, opt_out=opt_out, speculation=speculation)
    fixed = ngram(4)
    assert plan([row(0), row(1, opt_out=True)], controller=None, fixed=fixed) == Plan(PLAIN, 1.0, Reason.OPT_OUT)
    assert plan([row(0, opt_out=True)], controller=None, fixed=fixed, plain=False).reason == Reason.FIXED
    assert plan([row(0, speculation=ngram(2)), row(1)], controller=None, fixed=fixed) == Plan(
        ngram(2), 1.0, Reason.REQUESTED)
    assert plan([row(0, speculation=ngram(2)), row(1, speculation=ngram(8))], controller=None,
                fixed=fixed).reason == "requests_differ"
    assert plan([row(0)], controller=None, fixed=fixed) == Plan(fixed, 1.0, Reason.FIXED)
    c = Controller(ControllerConfig(), LIGHT)
    for r in ("a", "b"):
        c.add_row(r, opt_out=r == "b")
    assert plan([row("a")], controller=c).reason == Reason.GAIN  # the prior: prompt lookup may pay at batch 1
    assert plan([row("a"), row("b", opt_out=True)], controller=c).reason == Reason.OPT_OUT
    assert c.choose([]).reason == Reason.IDLE
    assert {str(x) for x in Reason} == {"gain", "no_gain", "probe", "opt_out", "idle", "requested",
                                        "requests_differ", "fixed", "explore", "bare"}


def test_costs_follow_the_chunks_that_run_and_plain_is_measured_beside_them():
    """A calibration skewed by a busy machine (plain timed at 744 ms a step at batch 16, then run at
    313 ms, as in a loadbench here) makes verify windows look free; the chunks that run correct it:
    after one speculative chunk, a plain one measures plain, and the measured ratio turns
    speculation off. Where the chunks confirm that speculation pays, it goes on, with plain
    measured again every `plain_every` speculative chunks."""
    skewed = CostModel({PLAIN: 0.744, ngram(2): 0.850, ngram(4): 1.044, ngram(8): 1.087}, batch=16)
    c = Controller(ControllerConfig(probe_every=16), skewed)
    c.add_row("r", task="qa")
    c.observe("r", "ngram", accepted_per_position=[5, 4, 3, 2], steps=10)  # alpha ~ 0.5: E(2) ~ 1.9
    first = c.choose(["r"])
    assert first.reason == Reason.GAIN and first.option != PLAIN  # the calibration's word, at first
    c.observe_chunk(first.option, 8 * 1.08, 8)
    probe = c.choose(["r"])
    assert (probe.option, probe.reason) == (PLAIN, Reason.PROBE)
    c.observe_chunk(PLAIN, 8 * 0.313, 8)
    assert c.cost.relative(first.option) == pytest.approx(1.08 / 0.313)
    for _ in range(5):
        plan = c.choose(["r"])
        assert plan.option == PLAIN and plan.reason == Reason.NO_GAIN
        c.observe_chunk(PLAIN, 8 * 0.313, 8)
    # a speculative step never reads as cheaper than a plain one, however it was timed
    assert CostModel({PLAIN: 1.0, ngram(4): 0.8}).relative(ngram(4)) == 1.0
    # where speculation does pay, the chunks confirm it; plain is re-measured every plain_every chunks
    good = Controller(ControllerConfig(plain_every=4), CostModel({PLAIN: 1.0, ngram(2): 1.1, ngram(4): 1.2,
                                                                  ngram(8): 1.5}, batch=1))
    good.add_row("r", task="copy")
    good.observe("r", "ngram", accepted_per_position=[9, 9, 8, 8, 8, 8, 8, 8], steps=10)
    reasons = []
    for _ in range(12):
        plan = good.choose(["r"])
        reasons.append(str(plan.reason))
        good.observe_chunk(plan.option, 8 * good.cost.seconds[plan.option], 8)
    assert reasons == ["gain", "probe"] + ["gain"] * 4 + ["probe"] + ["gain"] * 4 + ["probe"], reasons
    # follow_costs=False keeps the costs given: the skewed calibration's word stands, chunk after chunk
    fixed = Controller(ControllerConfig(probe_every=16, follow_costs=False), CostModel(dict(skewed.seconds), batch=16))
    fixed.add_row("r", task="qa")
    fixed.observe("r", "ngram", accepted_per_position=[5, 4, 3, 2], steps=10)
    for _ in range(3):
        plan = fixed.choose(["r"])
        assert plan.reason == Reason.GAIN and plan.option == first.option
        fixed.observe_chunk(plan.option, 8 * 1.08, 8)
    assert fixed.cost.measured == {}


def test_an_option_its_prior_undersells_is_explored_then_chosen():
    """Prompt lookup measured good, and a dearer method never run whose prior (the class's pooled
    evidence, prompt lookup's rates) loses to it: the greedy choice would never run the second
    method. Every `explore_every` speculative chunks one chunk explores the option of highest
    optimistic gain; once measured better, it is chosen. With `explore_every=0` it is never run
    (the negative control)."""
    other = SpecConfig.make("recycle", k=8)
    cost = CostModel({**LIGHT.seconds, other: 2.0}, batch=1)

    def chosen(explore_every: int) -> list[Plan]:
        c = Controller(ControllerConfig(extra=(other,), explore_every=explore_every, follow_costs=False), cost)
        c.add_row("r")
        rng = np.random.default_rng(0)
        c.observe("r", "ngram", trace(0.75, 8, 100, rng), 100)  # measured: gain ~2.3 against the prior's ~1.85
        plans = []
        for _ in range(40):
            p = c.choose(["r"])
            plans.append(p)
            if p.k:
                alpha = 0.95 if p.option == other else 0.75
                c.observe("r", p.option.kind, trace(alpha, p.k, 8, rng), 8)
        return plans

    greedy = chosen(0)
    assert other not in [p.option for p in greedy] and all(p.reason == Reason.GAIN for p in greedy)
    plans = chosen(4)
    first = next(i for i, p in enumerate(plans) if p.option == other)
    assert first == 3 and plans[first].reason == Reason.EXPLORE, [(p.option.label, p.reason) for p in plans[:6]]
    assert all(p.option == other for p in plans[first + 1:]), [p.option.label for p in plans]
