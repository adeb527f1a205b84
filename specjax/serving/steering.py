"""The host side of choosing each chunk's option: a fixed spec, or auto's controller with its cost
models and the evidence it learns from.

`Steering` is what a continuous-batching host (`specjax.serving.scheduler.Scheduler`) tells about its
requests: `bare` before one's prefill (may it skip speculation's state?), `start` when its first
token exists, `ran` after each chunk with its time, `chunk` with each row's counters, `end` when one
leaves. It feeds the `Controller` (auto's per-row acceptance and per-task state) and the host
replays (`specjax.serving.replays`), and `plan` asks the policy (`controller.plan`) for the next
chunk's option at the cost measured for the chunk's batch size. The cost models come from
`calibrate` (`Built.calibrate` per batch size, process 0's for every process) or from an earlier host
of the same options. A fixed spec needs none of this: `plan` returns it.
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

from specjax import sharding
from specjax.serving import controller as policy
from specjax.serving.controller import PLAIN, Controller, CostModel, Plan
from specjax.serving.options import OptionSet
from specjax.serving.replays import Replays
from specjax.telemetry import SpecCounters


class Steering:
    """Picks each chunk's option among `options` for a host of batch sizes `sizes` (the last the full
    batch); `costs`: an earlier host's cost models (`Scheduler.costs`), used instead of calibrating."""

    def __init__(self, options: OptionSet, *, sizes: Sequence[int], costs: dict[int, CostModel] | None = None):
        self.ccfg, self.fixed, self.plain, self.sizes = options.ccfg, options.fixed, PLAIN in options.options, sizes
        if costs is not None and (self.ccfg is None or set(costs) != set(sizes)):
            raise ValueError(f"costs for batch sizes {sorted(costs)}: give them to an 'auto' scheduler with "
                             f"batch sizes {list(sizes)} (an earlier one's Scheduler.costs)")
        self.controller: Controller | None = None
        self.bare_rows: set = set()  # the running requests inserted bare (`bare`)
        self.cost: CostModel | None = None  # at the full batch; `costs` per batch size
        self.costs: dict[int, CostModel] = costs or {}
        # auto: the options replayed on the host over the text other options commit
        self.replays = Replays(options.specs.values() if self.ccfg is not None and self.ccfg.replay_ngram else (),
                               lambda: self.controller.observe)

    def calibrate(self, measure: Callable[[int], CostModel]) -> None:
        """For auto: the cost model per batch size (`measure(size)`, unless given) and the controller."""
        if self.ccfg is None:
            return
        # timings differ per host: process 0's calibration is everyone's, or hosts would diverge
        self.costs = self.costs or sharding.broadcast_from_0({size: measure(size) for size in self.sizes})
        self.cost = self.costs[self.sizes[-1]]
        self.controller = Controller(self.ccfg, self.cost)

    def size_for(self, slots: Iterable[int]) -> int:
        """The smallest batch size whose first rows hold every one of `slots`."""
        last = max(slots)
        return next(x for x in self.sizes if x > last)

    def bare(self, active: Sequence, req, *, size: int) -> bool:
        """Whether auto inserts `req` bare (`RunningBatch.insert(bare=True)`: the target's prefill
        alone, no proposer state, the batch-shared state not shown the prompt): when the batch of
        `active` and `req`, more than one row, at batch size `size`, is not expected to gain from
        speculation (`Controller.pays`), or `req` opted out. Plain chunks then run until it leaves,
        without probes: under load speculation costs nothing while it does not pay. A single row (not
        opted out) is always inserted whole, so that the controller still probes a class judged poor.
        Process 0's answer is every process's."""
        if self.controller is None or any(r.speculation is not None for r in (*active, req)):
            return False
        if req.opt_out:
            return True
        self.controller.cost = self.costs.get(size, self.cost)
        return bool(sharding.broadcast_from_0(bool(active) and not self.controller.pays([r.id for r in active],
                                                                                          task=req.task)))

    def plan(self, active: Sequence, *, size: int | None = None) -> Plan:
        """The next chunk's option (`controller.plan`: the policy), the controller comparing options at
        the cost measured for batch size `size`; every process runs process 0's choice. Plain while a
        row inserted bare (`bare`) runs, whatever option the running requests name."""
        if self.controller is None:
            return policy.plan(active, controller=None, fixed=self.fixed, plain=self.plain)
        if any(r.id in self.bare_rows for r in active) and not any(r.opt_out for r in active):
            return Plan(PLAIN, 1.0, policy.Reason.BARE)  # (an opted-out row keeps it plain as "opt_out")
        self.controller.cost = self.costs.get(size or self.sizes[-1], self.cost)
        return sharding.broadcast_from_0(policy.plan(active, controller=self.controller, fixed=self.fixed,
                                                     plain=self.plain))

    def start(self, req, *, bare: bool = False) -> None:
        if bare:
            self.bare_rows.add(req.id)
        if self.controller is not None:
            self.controller.add_row(req.id, task=req.task, opt_out=req.opt_out)
        self.replays.start(req)

    def ran(self, option, seconds: float, steps: int) -> None:
        """What a step of `option` cost here, as it ran."""
        if self.controller is not None:
            self.controller.observe_chunk(option, seconds, steps)

    def chunk(self, req, option, counters: SpecCounters) -> None:
        """Row `req`'s counters over a chunk of `option`, and its replays over the text it committed."""
        if counters.num_drafts and self.controller is not None:
            self.controller.observe(req.id, option.kind, counters.accepted_tokens_per_pos, counters.num_drafts)
        self.replays.chunk(req, ran=option.kind)

    def end(self, req) -> None:
        self.bare_rows.discard(req.id)
        if self.controller is not None:
            self.controller.remove_row(req.id)
        self.replays.end(req)
