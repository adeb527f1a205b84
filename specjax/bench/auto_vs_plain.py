"""Auto against plain decoding on the same prompts, in turns: what `specjax generate --method auto`
reports (auto's speedup per task class with its spread, `specjax.bench.compare`).

Both arms run on a fresh scheduler of the same compiled programs: the plain arm's requests opt out
of speculation (`Scheduler.submit(opt_out=True)`: plain chunks, and their text never enters the
n-gram table), so the comparison compiles nothing twice, and each run starts with an empty n-gram
table (a repetition never looks up an earlier repetition's answer). Pairs alternate their order
(auto then plain, plain then auto, ...). The cost model is calibrated once, in the first run,
and the insert programs run once before any timed request (`Scheduler.warm`): a program's first
run costs more than the next ones, and it would land on whichever arm ran first.
Prompts with a `response_format` or a `regex` are answered under it in both arms (the plain arm is
constrained plain decoding, the oracle): the schedulers then carry a constraint pool sized to the
largest.

Example:
  >>> runs = auto_vs_plain.run(engine, prompts, GenerateOptions(max_new_tokens=64), ControllerConfig(),
  ...                          slots=4, repeats=3)
  >>> print(auto_vs_plain.report(runs, "all", range(len(prompts))).text())
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

from specjax.bench import compare

ARMS = ("auto", "plain")


@dataclasses.dataclass
class Runs:
    """The requests of each run of each arm (`auto[rep][i]` is prompt i's in repeat rep)."""

    prompts: list
    greedy: bool
    auto: list[list] = dataclasses.field(default_factory=list)
    plain: list[list] = dataclasses.field(default_factory=list)
    options: tuple[str, ...] = ()  # auto's option labels
    programs: int = 0  # programs the first run made ready
    compile_s: float = 0.0
    calibrate_s: float = 0.0

    @property
    def repeats(self) -> int:
        return len(self.auto)

    def identical(self, i: int) -> bool:
        """Prompt i's tokens were the same in both arms of every repeat."""
        return all(a[i].tokens == p[i].tokens for a, p in zip(self.auto, self.plain))


def run(engine, prompts: Sequence, opts, controller, *, slots: int, repeats: int = 3, chat: bool = False,
        stream: Callable[[list[int]], None] | None = None, log: Callable[[str], None] = lambda m: None) -> Runs:
    """Serves `prompts` (with `.text`, `.task`, `.prediction`, `.response_format`, `.regex`) `repeats`
    times in each arm, in turns; `stream` is called with the first prompt's tokens after every chunk
    of the first auto run; `log` gets progress lines."""
    from specjax.serving.scheduler import Scheduler

    if repeats < 1:
        raise ValueError(f"--repeats={repeats}: must be >= 1")
    longest = max(len(x) for x in engine.check([p.text for p in prompts], opts, chat=chat))
    tables = [engine.constraint_for(response_format=p.response_format, regex=p.regex)  # compiled once
              for p in prompts]
    pool = constraint_limits(tables)
    runs = Runs(prompts=list(prompts), greedy=opts.sampling.greedy)
    costs = None
    for rep in range(repeats):
        for arm in ARMS if rep % 2 == 0 else ARMS[::-1]:
            s = Scheduler(engine, slots=slots, spec="auto", controller=controller, opts=opts, chat=chat,
                          max_prompt_tokens=longest, costs=costs, constraint_pool=pool)
            for p, t in zip(prompts, tables):
                s.submit(p.text, task=p.task, opt_out=arm == "plain", prediction=p.prediction, constraint=t)
            if costs is None:
                t0, compiles = time.perf_counter(), engine.compile_count
                s.prepare()
                s.warm()  # an insert program's first run (~0.6 s here) would land on the first arm
                runs.options, runs.programs = tuple(o.label for o in s.options), engine.compile_count - compiles
                runs.compile_s, runs.calibrate_s = s.compile_s, time.perf_counter() - t0 - s.compile_s
                costs = s.costs
                log(f"[auto's options {', '.join(runs.options)}: {runs.programs} programs ready in "
                    f"{runs.compile_s:.1f} s (traced, then compiled or read from the compilation cache), "
                    f"step costs calibrated and inserts warmed in {runs.calibrate_s:.1f} s]")
            _serve(s, stream if arm == "auto" and rep == 0 else None)
            getattr(runs, arm).append(list(s.requests))
            if rep == 0 and arm == "auto":
                log(f"[timing auto and plain in turns on the same prompts, {repeats} run"
                    f"{'s' if repeats > 1 else ''} each ...]")
    return runs


def constraint_limits(tables: Sequence):
    """The smallest pool (`ConstraintLimits`, sizes rounded up to powers of two) that holds every
    constraint of `tables` (None: free); None when none is constrained."""
    from specjax.core.decoder import round_up_pow2
    from specjax.serving.constraints import ConstraintLimits

    shapes = [t.next_state.shape for t in tables if t is not None]
    if not shapes:
        return None
    return ConstraintLimits(states=round_up_pow2(max(s for s, _ in shapes)),
                            classes=round_up_pow2(max(c for _, c in shapes)))


def _serve(s, stream) -> None:
    if stream is None:
        s.run()
        return
    while s.step():
        stream(s.requests[0].tokens)


def report(runs: Runs, label: str, idx: Sequence[int]) -> compare.Report:
    """Auto's speedup over plain on the prompts `idx` (their summed latency per run), with the
    chunks auto ran, its tau, and (greedy) how many outputs equal plain's."""
    pair = lambda rep: (sum(rep[i].latency_s for i in idx), sum(len(rep[i].tokens) for i in idx))
    chunks: dict[str, int] = {}
    for rep in runs.auto:
        for i in idx:
            for k, n in rep[i].chunks.items():
                chunks[k] = chunks.get(k, 0) + n
    autos = [rep[i] for rep in runs.auto for i in idx]
    tau = sum(len(a.tokens) - 1 for a in autos) / max(1, sum(a.target_forwards for a in autos))
    same = sum(a[i].tokens == p[i].tokens for a, p in zip(runs.auto, runs.plain) for i in idx)
    return compare.report(label, [pair(rep) for rep in runs.auto], [pair(rep) for rep in runs.plain], chunks,
                          tau=tau, identical=(same, runs.repeats * len(idx)) if runs.greedy else None,
                          repeated=compare.repeated_share([rep[i].tokens for rep in runs.auto[:1] for i in idx]))


def by_task(runs: Runs) -> list[compare.Report]:
    """One report per task class, in the order the classes first appear."""
    out = []
    for task in dict.fromkeys(str(p.task) for p in runs.prompts):
        idx = [i for i, p in enumerate(runs.prompts) if str(p.task) == task]
        out.append(report(runs, "" if task == "None" else task, idx))
    return out


def records(runs: Runs, decode: Callable[[list[int]], str]) -> list[dict]:
    """One record per prompt: its first auto run's text, tokens, stop reason and counters, and its
    comparison."""
    out = []
    for i, p in enumerate(runs.prompts):
        a = runs.auto[0][i]
        out.append(dict(id=p.id, task=p.task, text=decode(a.tokens), tokens=a.tokens, stop_reason=a.stop_reason,
                        tau=a.tau, chunks=a.chunks,
                        comparison=report(runs, str(p.task), [i]).to_dict(),
                        identical_to_plain=runs.identical(i) if runs.greedy else None, **a.counters.to_dict()))
    return out
