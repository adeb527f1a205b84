"""Adaptive speculation: pick the speculation length per chunk from measured benefit.

The policy is plain host-side arithmetic over two measurements:

- a cost model per batch size: seconds per target step of the plain loop and of each speculative
  loop in the compiled set, timed at start-up at the batch's actual shape (batch size = load, cache
  length) on the current machine (`calibrate`, on forks of the running batch), then followed from
  the chunks that run (`CostModel.observe`): an option that has run is judged by its own chunks against plain's, and
  plain is measured at a batch size once chunks run there and again every `plain_every`
  speculative chunks, so a calibration skewed by a busy machine is corrected within two chunks;
- a running acceptance estimate per row and per task class: for each draft position j, the rate
  at which draft j is accepted given that drafts 0..j-1 were. Each chunk's counters update it; old
  evidence decays geometrically (an EMA), so the estimate follows a row whose text changes. A
  proposer not yet run on a class starts from the class's evidence of every proposer pooled (a
  class nothing guesses well stays plain instead of running each proposer once to learn it), and
  from `prior_alpha` only where the class has none.

A step with K drafts then commits on average

    E(K) = 1 + a_0 + a_0 a_1 + ... + a_0 ... a_(K-1)

tokens, against 1 for a plain step. With one rate alpha for every position this is the familiar
(1 - alpha^(K+1)) / (1 - alpha); prompt lookup is far from that (its first draft is the gamble),
which is why the rates are kept per position. The gain of option K over plain for a batch is
`(sum over active rows of E_r(K) / cost(K)) / (rows / cost(0))`. The controller runs the argmax
and falls back to plain (K = 0) when the best gain is below `1 + margin`: speculation never runs
where it is expected to lose. Under heavy load a verify step costs several plain steps (the step is
compute-bound), so the gain drops below 1 and speculation switches itself off.

The compiled batch has one K per chunk, so a per-row choice is folded into a per-batch one. A row
that opted out counts as a row that cannot speculate: while it is active, the batch decodes plain,
so an opted-out request is never speculated on (lossless either way; this keeps "never" literal).
When plain has been chosen for `probe_every` chunks in a row, one probe chunk re-measures
acceptance, with the cheapest option that an optimistic estimate (rates plus an uncertainty bonus)
says could pay; with plenty of evidence that nothing does (heavy load), no probe runs.
"""

from __future__ import annotations

import dataclasses
import enum
import statistics
import time
from typing import Hashable, Protocol, Sequence

import numpy as np

from specjax.methods.config import MAX_K, SpecConfig
from specjax.methods import registry

PLAIN = SpecConfig()  # the plain loop; every other option is a speculative SpecConfig


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens committed per step with K drafts when each draft is kept with probability alpha."""
    if k <= 0:
        return 1.0
    alpha = min(max(alpha, 0.0), 1.0)
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ControllerConfig:
    """Static policy settings.

    Attributes:
      ks: the compiled speculation lengths to choose from; 0 is the plain loop (always included).
      methods: proposers the controller may use with each K > 0, as `SpecConfig(method=m, k=K)` (default: prompt lookup alone,
        the methods the scheduler can replay on the host, `registry.looks_up`, but those that pay only
        with what a request brings, `Record.on_request`); stateful ones (a draft
        model's cache) go stale across plain chunks.
      margin: speculate only when the expected gain is at least 1 + margin.
      decay: weight kept by old evidence each time a row or task is observed (EMA factor).
      prior_alpha, prior_weight: the acceptance assumed before any evidence of the class, worth
        this many draft attempts.
      probe_every: after this many plain chunks in a row, probe once (see module docstring).
      plain_every: after this many speculative chunks at a batch size, one plain chunk measures
        plain's step cost there again (the costs follow the chunks that run; module docstring).
      follow_costs: the costs follow the chunks that run (`CostModel.observe`); False keeps the
        calibrated (or given) costs, so two runs given the same costs decide alike (tests, replays).
      probe_bonus: optimism of the probe test: alpha + probe_bonus / sqrt(attempts + 1).
      explore_every: after this many speculative chunks in a row, one chunk runs the option of
        highest optimistic gain when that is not the best one (an option with little evidence is
        measured instead of judged by its prior forever); 0 never explores.
      extra: more options, each a speculative `SpecConfig`, e.g. Medusa's chain of 3 when only
        some K suit a method, or a tree (`with_assets` adds them from the loaded assets' records).
      max_step_cost: a bound on inter-token latency: options whose step costs more than this many
        plain steps at the chunk's batch size are never chosen (None: no bound). A verify step
        that is 1.3x a plain step at batch 1 can be 2-4x at batch 16 on a compute-bound machine;
        there a rejected window makes one token take that long, which is what raises ITL p99.
      replay_ngram: the scheduler replays the options a method's record can replay on the host
        (prompt lookup, and forced text under a request's constraint) over the text other options
        commit (`specjax.core.host_lookup.replay`) and feeds what they would have kept to the
        estimates, so they need no chunk of their own to learn they pay.
    """

    ks: tuple[int, ...] = (0, 2, 4, 8)
    methods: tuple[str, ...] = tuple(m for m, rec in registry.RECORDS.items() if registry.looks_up(m)
                                     and not rec.on_request)
    margin: float = 0.03
    decay: float = 0.9
    prior_alpha: float = 0.5
    prior_weight: float = 4.0
    probe_every: int = 16
    plain_every: int = 64
    follow_costs: bool = True
    probe_bonus: float = 1.0
    explore_every: int = 16
    extra: tuple[SpecConfig, ...] = ()
    max_step_cost: float | None = None
    replay_ngram: bool = True

    def __post_init__(self):
        if not self.ks or any(int(k) != k or k < 0 for k in self.ks):
            raise ValueError(f"ks={self.ks}: give integers >= 0 (0 = plain)")
        if "none" in self.methods or not (self.methods or self.extra):
            raise ValueError(f"methods={self.methods}: give speculative methods (e.g. 'ngram')")
        bad = [o for o in self.extra if not isinstance(o, SpecConfig) or o.method == "none"]
        if bad:
            raise ValueError(f"extra={bad}: give speculative SpecConfigs (e.g. SpecConfig(method='medusa', k=3))")
        if not 0 <= self.prior_alpha <= 1 or self.prior_weight < 0:
            raise ValueError("prior_alpha must lie in [0, 1] and prior_weight be >= 0")
        if not 0 < self.decay <= 1:
            raise ValueError(f"decay={self.decay}: must lie in (0, 1]")
        if self.probe_every < 1 or self.plain_every < 1:
            raise ValueError(f"probe_every={self.probe_every}, plain_every={self.plain_every}: must be >= 1")
        if self.explore_every < 0:
            raise ValueError(f"explore_every={self.explore_every}: must be >= 0 (0 = never)")
        if self.max_step_cost is not None and not self.max_step_cost >= 1:
            raise ValueError(f"max_step_cost={self.max_step_cost}: must be >= 1 (plain steps)")

    def with_assets(self, assets: registry.Assets,
                    given: dict[str, SpecConfig] | None = None) -> "ControllerConfig":
        """These settings with the options the loaded `assets` allow added to `extra` (each record's
        `auto`: Medusa's chain lengths and tree, EAGLE's tuned chain and tree, as `SpecConfig`s);
        `given` maps a method to the spec given for it (a Medusa tree)."""
        extra = tuple(SpecConfig.make(**f) for f in registry.auto_options(assets, self.ks, given))
        return dataclasses.replace(self, extra=tuple(dict.fromkeys(self.extra + extra)))

    @property
    def options(self) -> tuple[SpecConfig, ...]:
        """Plain, then each method at each K > 0, then `extra` (each option once)."""
        spec = sorted({int(k) for k in self.ks if k > 0})
        opts = tuple(SpecConfig(method=m, k=k) for m in self.methods for k in spec)
        return tuple(dict.fromkeys((PLAIN,) + opts + tuple(self.extra)))


@dataclasses.dataclass
class CostModel:
    """Seconds per target step of each option at one batch size: calibrated at start-up on
    placeholder rows (`seconds`), then followed from the chunks that run there (`observe`).

    Once an option has run real chunks, their decayed seconds per step replace its calibration: a
    few placeholder steps timed once on a busy machine can be far off (in one run here plain
    calibrated at 744 ms a step at batch 16 and then ran at 313 ms, so every verify window looked
    cheap and auto lost half the throughput). A speculative step verifies the plain step's token
    and more, so it never costs less than a plain step: `relative` is at least 1 for it.
    """

    seconds: dict[SpecConfig, float]
    batch: int = 1
    decay: float = 0.7  # weight kept by an option's earlier chunks at each new one
    measured: dict[SpecConfig, tuple[float, float]] = dataclasses.field(default_factory=dict)  # decayed s, steps
    since_plain: int = 0  # speculative chunks run here since the last plain one

    def observe(self, option: SpecConfig, seconds: float, steps: int) -> None:
        """One chunk of `option` ran `steps` target steps in `seconds`."""
        if steps <= 0 or option not in self.seconds:
            return
        s, n = self.measured.get(option, (0.0, 0.0))
        self.measured[option] = (s * self.decay + seconds, n * self.decay + steps)
        self.since_plain = 0 if option == PLAIN else self.since_plain + 1

    def step_seconds(self, option: SpecConfig) -> float:
        """Seconds per step of `option`: measured in its chunks, else calibrated."""
        s, n = self.measured.get(option, (0.0, 0.0))
        return s / n if n > 0 else self.seconds[option]

    def relative(self, option: SpecConfig) -> float:
        """Cost of one step of `option` in plain steps (at least 1 for a speculative option)."""
        r = self.step_seconds(option) / self.step_seconds(PLAIN)
        return r if option == PLAIN else max(1.0, r)


class Forkable(Protocol):
    """What calibration needs of a running batch (`specjax.core.slots.RunningBatch`)."""

    def fork(self, inputs): ...  # a second batch of the same programs, prefilled from `inputs`

    def run(self, loop, steps: int, *, size: int | None = None): ...  # a chunk; `.steps` it ran


def calibrate(batch: Forkable, loops: dict[SpecConfig, Hashable], windows: dict[SpecConfig, int], busy, *,
              cache_length: int, steps: int = 4, repeats: int = 3, size: int = 1) -> CostModel:
    """The cost model at batch size `size`: seconds per target step of each option (`loops[o]`: the
    batch's name of its loop, `windows[o]`: its verify window), timed on forks of `batch` prefilled
    with `busy` (placeholder rows that never stop).

    Options take turns (repeat 1 of each, then repeat 2, ...) so that drift on a busy machine spreads
    over all of them; each turn starts from a fresh fork (the empty-batch program, cheap) and a
    one-step warm-up, and the median per option is kept.
    """
    ts: dict[SpecConfig, list[float]] = {o: [] for o in loops}
    for _ in range(repeats):
        for o, loop in loops.items():
            n = max(1, min(steps, (cache_length - 2) // windows[o] - 2))  # rows must not fill the cache
            trial = batch.fork(busy)
            trial.run(loop, 1, size=size)
            t0 = time.perf_counter()
            fwd = trial.run(loop, n, size=size).steps
            seconds = time.perf_counter() - t0
            if fwd:
                ts[o].append(seconds / fwd)
            del trial
    return CostModel({o: statistics.median(t) if t else float("inf") for o, t in ts.items()}, batch=size)


def expected_tokens_rates(rates: Sequence[float], k: int) -> float:
    """Tokens per step with K drafts when draft j is kept with probability rates[j] given that
    drafts 0..j-1 were: 1 + sum over i <= K of rates[0] * ... * rates[i-1]."""
    total, p = 1.0, 1.0
    for j in range(k):
        p *= min(max(float(rates[j]), 0.0), 1.0)
        total += p
    return total


def position_counts(accepted_per_position: Sequence[int], steps: int) -> tuple[np.ndarray, np.ndarray]:
    """Per draft position, (tried, kept): position j is tried only when position j - 1 was kept."""
    kept = np.asarray(accepted_per_position, np.float64)
    tried = np.concatenate([[float(steps)], kept[:-1]]) if kept.size else kept
    return tried, kept


@dataclasses.dataclass
class Acceptance:
    """Decayed counts of draft positions tried and kept, per position (up to `MAX_K`).

    Prompt lookup is far from geometric: the first draft is the gamble (is there a match?), and
    once it is kept the next ones usually are too. So the estimate keeps one conditional rate per
    position, each shrunk towards a prior (for a task: its pooled rate; for a row: its task's rate
    at that position). A task's position never tried takes the rate of the position before it.
    """

    tried: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(MAX_K))
    kept: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(MAX_K))

    def update(self, accepted_per_position: Sequence[int], steps: int, decay: float) -> None:
        tried, kept = position_counts(accepted_per_position, steps)
        self.tried *= decay
        self.kept *= decay
        self.tried[: tried.size] += tried
        self.kept[: kept.size] += kept

    def alpha(self, prior: float, weight: float) -> float:
        """The pooled rate (the geometric model's alpha)."""
        t, k = self.tried.sum(), self.kept.sum()
        return (k + prior * weight) / (t + weight) if t + weight else prior

    def rates(self, prior: np.ndarray, weight: float) -> np.ndarray:
        """Conditional rate per position, shrunk towards `prior` (per position) by `weight`."""
        return np.where(self.tried + weight > 0,
                        (self.kept + prior * weight) / np.maximum(self.tried + weight, 1e-12), prior)


class Reason(enum.StrEnum):
    """Why a chunk runs its option (`Plan.reason`; the chunk log's `reason`)."""

    GAIN = "gain"  # the controller expects the option to beat plain by its margin
    NO_GAIN = "no_gain"  # no option is expected to: plain
    PROBE = "probe"  # a measurement: after plain chunks, an option that could pay; or plain itself, not yet
    # measured at this batch size or not for `plain_every` speculative chunks
    EXPLORE = "explore"  # a measurement: after speculative chunks, the option of highest optimistic gain
    OPT_OUT = "opt_out"  # a running request opted out of speculation: plain
    IDLE = "idle"  # no row runs
    REQUESTED = "requested"  # the running requests name this option
    REQUESTS_DIFFER = "requests_differ"  # they name different ones: plain
    FIXED = "fixed"  # the host runs one option
    BARE = "bare"  # a running request was inserted bare (auto judged speculation would not pay): plain


@dataclasses.dataclass(frozen=True)
class Plan:
    """The choice for one chunk: the option, its expected gain over plain, and why."""

    option: SpecConfig
    gain: float
    reason: Reason

    @property
    def k(self) -> int:
        return self.option.depth


class Controller:
    """Chooses the option of each chunk from the cost model and the acceptance estimates.

    Rows are identified by any hashable id (the scheduler uses request ids). Statistics per task
    class persist after a row leaves, and seed the estimate of the next row of the same class.
    Options are `SpecConfig`s; evidence is kept per option `kind` (the method, or "medusa-tree").

    Example:
      >>> (lookup,) = ControllerConfig().methods  # prompt lookup
      >>> cost = CostModel({PLAIN: 1.0, **{SpecConfig(method=lookup, k=k): c for k, c in ((2, 1.2), (4, 1.4), (8, 1.8))}})
      >>> c = Controller(ControllerConfig(), cost)
      >>> c.add_row("r1", task="translation")
      >>> c.observe("r1", lookup, accepted_per_position=[9, 8, 7, 6], steps=10)
      >>> c.choose(["r1"]).option.label
      'ngram:8'
    """

    def __init__(self, config: ControllerConfig, cost: CostModel):
        missing = [o for o in config.options if o not in cost.seconds]
        if missing:
            raise ValueError(f"cost model lacks options {missing}")
        self.config, self.cost = config, cost
        self.rows: dict[Hashable, dict] = {}
        self.tasks: dict[tuple[str | None, str], Acceptance] = {}
        self._pooled: dict[str | None, Acceptance] = {}  # `class_evidence`, per task class
        self.plain_run = 0  # plain chunks chosen in a row
        self.spec_run = 0  # speculative chunks chosen for their gain since the last exploration

    # ---- rows and evidence -----------------------------------------------------------------
    def add_row(self, row: Hashable, *, task: str | None = None, opt_out: bool = False) -> None:
        self.rows[row] = dict(task=task, opt_out=opt_out, acc={})

    def remove_row(self, row: Hashable) -> None:
        self.rows.pop(row, None)

    def observe(self, row: Hashable, method: str, accepted_per_position: Sequence[int],
                steps: int) -> None:
        """Adds one chunk's counters of `row` (speculated with an option of kind `method`, its
        `SpecConfig.kind`) to its estimates."""
        if steps <= 0 or len(accepted_per_position) == 0:
            return
        r = self.rows[row]
        d = self.config.decay
        r["acc"].setdefault(method, Acceptance()).update(accepted_per_position, steps, d)
        self.tasks.setdefault((r["task"], method), Acceptance()).update(accepted_per_position, steps, d)
        self._pooled.pop(r["task"], None)

    def class_evidence(self, task: str | None) -> Acceptance:
        """The task class's evidence of every kind pooled: the prior of a kind not yet tried on it.
        Text that one drafter cannot guess is seldom easy for another (prompt lookup's host replay
        measures every chunk of a class for free), so a class where the kinds tried keep little
        does not run each untried kind once at the prior's optimism to learn that it loses too;
        the probe (`probe_every`) still tries them, the cheapest first."""
        if task not in self._pooled:  # emptied by every observation
            pooled = self._pooled[task] = Acceptance()
            for (t, _), acc in self.tasks.items():
                if t == task:
                    pooled.tried += acc.tried
                    pooled.kept += acc.kept
        return self._pooled[task]

    def task_evidence(self, task: str | None, method: str) -> Acceptance:
        """The class's evidence of kind `method`, or of every kind pooled while it has none."""
        acc = self.tasks.get((task, method))
        return self.class_evidence(task) if acc is None else acc

    def task_rates(self, task: str | None, method: str) -> np.ndarray:
        c = self.config
        acc = self.task_evidence(task, method)
        rates = acc.rates(np.full(MAX_K, acc.alpha(c.prior_alpha, c.prior_weight)), c.prior_weight)
        for j in range(1, MAX_K):  # a position never tried: as the one before it (as geometric)
            if acc.tried[j] < 1e-6:
                rates[j] = rates[j - 1]
        return rates

    def task_alpha(self, task: str | None, method: str) -> float:
        c = self.config
        return self.task_evidence(task, method).alpha(c.prior_alpha, c.prior_weight)

    def rates(self, row: Hashable, method: str, *, optimistic: bool = False) -> np.ndarray:
        """The row's conditional acceptance per draft position, its task's estimate as prior.

        Optimistic adds an uncertainty bonus, `probe_bonus / sqrt(tried + 1)` per position.
        """
        r = self.rows[row]
        acc = r["acc"].get(method, Acceptance())
        a = acc.rates(self.task_rates(r["task"], method), self.config.prior_weight)
        if optimistic:
            task_acc = self.tasks.get((r["task"], method), Acceptance())
            a = a + self.config.probe_bonus / np.sqrt(acc.tried + task_acc.tried + 1.0)
        return np.minimum(a, 1.0)

    def alpha(self, row: Hashable, method: str) -> float:
        """The row's pooled acceptance rate (its own evidence over its task's as prior)."""
        r = self.rows[row]
        acc = r["acc"].get(method, Acceptance())
        return acc.alpha(self.task_alpha(r["task"], method), self.config.prior_weight)

    # ---- decisions -------------------------------------------------------------------------
    def expected(self, row: Hashable, option: SpecConfig, *, optimistic: bool = False) -> float:
        """Expected tokens per step of `row` under `option`."""
        if option == PLAIN:
            return 1.0
        return expected_tokens_rates(self.rates(row, option.kind, optimistic=optimistic), option.depth)

    def gain(self, rows: Sequence[Hashable], option: SpecConfig, *, optimistic: bool = False) -> float:
        """Expected batch throughput of `option` over plain, for these active rows."""
        if option == PLAIN or not rows:
            return 1.0
        tokens = sum(self.expected(r, option, optimistic=optimistic) for r in rows)
        return tokens / len(rows) / self.cost.relative(option)

    def allowed(self) -> list[SpecConfig]:
        """The speculative options within `max_step_cost` at the current cost model's batch size."""
        bound = self.config.max_step_cost
        return [o for o in self.config.options
                if o != PLAIN and (bound is None or self.cost.relative(o) <= bound)]

    def best(self, rows: Sequence[Hashable], *, optimistic: bool = False) -> tuple[SpecConfig, float]:
        """The speculative option of highest expected gain, and that gain."""
        gains = {o: self.gain(rows, o, optimistic=optimistic) for o in self.allowed()}
        if not gains:
            return PLAIN, 1.0
        option = max(gains, key=gains.get)
        return option, gains[option]

    def pays(self, rows: Sequence[Hashable], *, task: str | None = None) -> bool:
        """Whether the best option is expected to beat plain by the margin (not optimistic) for `rows`
        and one more row of task `task`, not yet added, at the current cost model's batch size."""
        new = object()
        self.add_row(new, task=task)
        try:
            return self.best([*rows, new])[1] >= 1.0 + self.config.margin
        finally:
            self.remove_row(new)

    def choose_row(self, row: Hashable) -> SpecConfig:
        """The option this row alone would run (plain for an opted-out row)."""
        if self.rows[row]["opt_out"]:
            return PLAIN
        option, g = self.best([row])
        return option if g >= 1.0 + self.config.margin else PLAIN

    def choose(self, rows: Sequence[Hashable]) -> Plan:
        """The option of the next chunk for a batch whose active rows are `rows`."""
        if not rows:
            return Plan(PLAIN, 1.0, Reason.IDLE)
        if any(self.rows[r]["opt_out"] for r in rows):
            return self._plain(1.0, Reason.OPT_OUT, probe=False)
        option, g = self.best(rows)
        if g >= 1.0 + self.config.margin:
            if self._plain_due():
                return Plan(PLAIN, g, Reason.PROBE)
            self.plain_run = 0
            return self._explore(rows) or Plan(option, g, Reason.GAIN)
        return self._plain(g, Reason.NO_GAIN, probe=True, rows=rows)

    def _explore(self, rows: Sequence[Hashable]) -> Plan | None:
        """Every `explore_every` speculative chunks: the option of highest optimistic gain, when it is
        not the best by the estimates (None otherwise). Without it, an option whose prior loses to a
        measured one is never run, however well it would do (token recycling's long chain on answers
        that recur, against prompt lookup's measured rates)."""
        self.spec_run += 1
        if not self.config.explore_every or self.spec_run < self.config.explore_every:
            return None
        self.spec_run = 0
        option, _ = self.best(rows)
        bold, _ = self.best(rows, optimistic=True)
        return None if bold == option else Plan(bold, self.gain(rows, bold), Reason.EXPLORE)

    def _plain_due(self) -> bool:
        """Speculation is judged against plain measured at this batch size: once chunks run here, a
        plain one measures it first, and again after every `plain_every` speculative ones."""
        m = self.cost.measured
        return bool(m) and (PLAIN not in m or self.cost.since_plain >= self.config.plain_every)

    def observe_chunk(self, option: SpecConfig, seconds: float, steps: int) -> None:
        """A chunk of `option` ran `steps` steps in `seconds` at the current cost model's batch size."""
        if self.config.follow_costs:
            self.cost.observe(option, seconds, steps)

    def _plain(self, g: float, reason: Reason, *, probe: bool, rows=()) -> Plan:
        self.plain_run += 1
        if probe and self.plain_run > self.config.probe_every:
            # the cheapest option that could pay: a probe that disappoints costs the least
            could = [o for o in self.allowed() if self.gain(rows, o, optimistic=True) >= 1.0 + self.config.margin]
            if could:
                option = min(could, key=self.cost.relative)
                self.plain_run = 0
                return Plan(option, self.gain(rows, option), Reason.PROBE)
        return Plan(PLAIN, g, reason)

    def summary(self) -> dict:
        """Acceptance per (task, method): pooled alpha, conditional rate per position, and the tau
        they imply at each compiled K."""
        out = {}
        for (task, m), acc in sorted(self.tasks.items(), key=lambda x: (str(x[0][0]), x[0][1])):
            rates = self.task_rates(task, m)
            out.setdefault(str(task), {})[m] = dict(
                alpha=self.task_alpha(task, m), rates=rates[: max(self.config.ks)].tolist(),
                tried=float(acc.tried.sum()), kept=float(acc.kept.sum()),
                expected_tau={k: expected_tokens_rates(rates, k) for k in self.config.ks if k > 0})
        return out


class Running(Protocol):
    """What the policy reads of a running request (`specjax.serving.requests.Request`)."""

    id: Hashable
    opt_out: bool
    speculation: SpecConfig | None


def plan(active: Sequence[Running], *, controller: "Controller | None", fixed: SpecConfig = PLAIN,
         plain: bool = True) -> Plan:
    """The option of a host's next chunk, for the requests running in it: plain while one that opted
    out runs (`plain`: the host compiled the plain loop); the option they name, when they name one
    (plain when they name different ones); else the `controller`'s choice (its `cost` set for the
    chunk's batch size), or the host's `fixed` option without one."""
    if plain and any(r.opt_out for r in active):
        return Plan(PLAIN, 1.0, Reason.OPT_OUT) if controller is None else controller.choose([r.id for r in active])
    named = {r.speculation for r in active if r.speculation is not None}
    if named:
        return Plan(named.pop(), 1.0, Reason.REQUESTED) if len(named) == 1 else Plan(PLAIN, 1.0, Reason.REQUESTS_DIFFER)
    if controller is None:
        return Plan(fixed, 1.0, Reason.FIXED)
    return controller.choose([r.id for r in active])
