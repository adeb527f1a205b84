"""The head-training run's checkpoints; heads themselves are saved by `specjax.models.heads_io`.

Training checkpoints (`TrainCheckpoints`) use orbax's `CheckpointManager`: each step is written to a
temporary directory and renamed when complete, old steps are pruned only after a newer one is
finalised (`max_to_keep`), and a latest step that cannot be read is set aside in favour of the one
before it.
"""

from __future__ import annotations

import abc
import dataclasses
import json
import math
import os
import pathlib
import shutil
import time
import warnings

import jax
import orbax.checkpoint as ocp
from tqdm import tqdm

from specjax.models.heads_io import (  # noqa: F401  (re-exported for training code)
    MANIFEST, abstract_heads, heads_from_params, load_heads, params_of, save_heads, shipped_heads_dir)


# Bookkeeping settings that may change between a run and its resumption.
_BOOKKEEPING = ("eval_every", "save_every", "keep", "log_every")


def run_settings(config) -> dict:
    """A training config's fields that a resumed run must match: all but the bookkeeping ones."""
    return {k: v for k, v in dataclasses.asdict(config).items() if k not in _BOOKKEEPING}


def _identity(run: dict | None) -> dict | None:
    if not isinstance(run, dict) or not isinstance(run.get("train"), dict):
        return run
    return dict(run, train={k: v for k, v in run["train"].items() if k not in _BOOKKEEPING})


class NonFiniteLoss(ValueError):
    """The training loss became NaN or infinite; the run stopped without saving that step."""


def _shapes(tree) -> dict[str, tuple]:
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {jax.tree_util.keystr(path, simple=True, separator="/").removesuffix("/value"): tuple(leaf.shape)
            for path, leaf in flat}


class TrainCheckpoints:
    """Periodic, atomic, keep-last-N checkpoints of a training run (orbax `CheckpointManager`).

    Each checkpoint holds the parameters, the optimiser state and a JSON `meta` dict; `restore`
    refuses a directory whose `meta["run"]` differs from the current run's (other data or settings;
    how often it evaluates, saves or logs may change).
    """

    def __init__(self, directory: str | os.PathLike, *, keep: int):
        self.directory = pathlib.Path(directory).resolve()
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                               enable_async_checkpointing=False)
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def save(self, step: int, state: dict, meta: dict) -> None:
        self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))
        self.manager.wait_until_finished()

    def restore(self, abstract_state: dict, run: dict) -> tuple[int, dict, dict] | None:
        """(step, state, meta) of the newest readable checkpoint, or None if there is none.

        A checkpoint of another run (other array shapes, or other settings) is refused with a
        ValueError before anything is read into the run or touched on disk. A newest step that cannot
        be read (a crash mid-write that left files behind, a damaged disk) is renamed to
        `<step>.corrupt` and the previous one is used; if none can be read, ValueError says so.
        """
        steps = sorted(self.manager.all_steps(), reverse=True)
        for step in steps:
            self._refuse_another_run(step, abstract_state, run)
            try:
                out = self.manager.restore(step, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()))
            except Exception as e:
                warnings.warn(f"training checkpoint {self.directory / str(step)} is unreadable "
                              f"({type(e).__name__}); set aside as {step}.corrupt, trying the previous one")
                self._set_aside(step)
                continue
            if _identity(out.meta.get("run")) != _identity(run):
                raise ValueError(
                    f"{self.directory} holds checkpoints of another run (settings {out.meta.get('run')}, "
                    f"this run {run}); use another --out directory or the same settings")
            return step, out.state, out.meta
        if steps:
            raise ValueError(f"no readable checkpoint in {self.directory} (tried steps {steps}); "
                             "delete the directory to start over")
        return None

    def _refuse_another_run(self, step: int, abstract_state: dict, run: dict) -> None:
        """ValueError if checkpoint `step` is readable enough to tell that it belongs to another run."""
        try:
            tree = ocp.StandardCheckpointHandler().metadata(self.directory / str(step) / "state").tree
            theirs = _shapes(tree)
        except Exception:  # unreadable: `restore` sets it aside
            return
        ours = _shapes(abstract_state)
        if theirs != ours:
            diff = [f"{k}: {ours.get(k, 'absent')} here, {theirs.get(k, 'absent')} in the checkpoint"
                    for k in sorted(set(ours) | set(theirs), key=lambda k: (not k.startswith("params"), k))
                    if ours.get(k) != theirs.get(k)]  # the parameters first: they name the difference
            more = f"; {len(diff) - 3} more" if len(diff) > 3 else ""
            raise ValueError(f"{self.directory.parent} holds a run with other shapes ({'; '.join(diff[:3])}{more}); "
                             "choose another --out or pass --init")
        try:
            meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
        except Exception:
            return
        if _identity(meta.get("run")) != _identity(run):
            raise ValueError(
                f"{self.directory} holds checkpoints of another run (settings {meta.get('run')}, "
                f"this run {run}); use another --out directory or the same settings")

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def _set_aside(self, step: int) -> None:
        src = self.directory / str(step)
        dst = self.directory / f"{step}.corrupt"
        if dst.exists():
            shutil.rmtree(dst)
        if src.exists():
            os.replace(src, dst)
        self.manager.reload()

    def close(self) -> None:
        self.manager.close()


class ResumableRun(abc.ABC):
    """What a training run shares with every other: the loop (`fit`), resume from and save to its
    checkpoints, and append metrics to `out/metrics.jsonl`.

    A subclass sets `params`, `opt_state`, `step`, `elapsed` (training seconds), `run` (the settings
    a resumed run must match), `ckpts` (`TrainCheckpoints`), `out` and `schedule` (its config: `steps`,
    `log_every`, `eval_every`, `save_every`), and may set `loader` (an object with `state()` and
    `restore(state)`, e.g. `train_heads.cache.EpochLoader`), whose position is saved in every
    checkpoint and restored with it. The method is in four hooks: `train_step_once` (one optimiser
    step), `record` (a metrics line), `evaluate` (held-out metrics) and `evaluates` (whether it has
    held-out data); `eval_key` names its held-out lines.
    """

    params: dict
    opt_state: dict
    step: int
    elapsed: float
    run: dict
    ckpts: TrainCheckpoints
    out: pathlib.Path
    schedule: object
    eval_key = "eval"
    desc = "train"

    # ---- the method's hooks --------------------------------------------------------------------
    @abc.abstractmethod
    def train_step_once(self) -> tuple[dict, dict, dict]:
        """One optimiser step on the loader's next batch: (params, opt_state, host metrics with "loss")."""

    @abc.abstractmethod
    def record(self, metrics: list[dict], seconds: float) -> tuple[dict, dict]:
        """A metrics line from the steps since the last one (their host metrics, their seconds), and the
        progress bar's postfix."""

    @abc.abstractmethod
    def evaluate(self) -> dict:
        """Held-out metrics of the current params."""

    @property
    def evaluates(self) -> bool:
        return True

    # ---- the loop ------------------------------------------------------------------------------
    def fit(self, *, stop_at: int | None = None, max_seconds: float | None = None, progress: bool = True) -> dict:
        """Trains from the current step to `schedule.steps`, or to `stop_at`, or until `max_seconds`
        pass (each a pause: it saves there). Logs a line every `log_every` steps, evaluates every
        `eval_every` and at the pause, saves every `save_every` and at the pause. A non-finite loss
        stops it before that step is counted or saved (`check_finite`). Returns the last held-out metrics ({}
        without held-out data)."""
        c = self.schedule
        end = min(c.steps, stop_at or c.steps)
        t_start, window, seen, last = time.perf_counter(), 0.0, [], {}
        bar = tqdm(total=end, initial=self.step, disable=not progress, desc=self.desc, unit="step")
        while self.step < end:
            t0 = time.perf_counter()
            self.params, self.opt_state, m = self.train_step_once()  # (a step may donate the old ones)
            self.check_finite(float(m["loss"]), self.step + 1)
            self.step += 1
            seen.append(m)
            dt = time.perf_counter() - t0
            self.elapsed, window = self.elapsed + dt, window + dt
            bar.update(1)
            timed_out = max_seconds is not None and time.perf_counter() - t_start > max_seconds
            pause = self.step == end or timed_out
            if self.step % c.log_every == 0 or pause:
                line, postfix = self.record(seen, window)
                self._log(dict(step=self.step, **line))
                bar.set_postfix(postfix)
                seen, window = [], 0.0
            if self.step % c.save_every == 0 or pause:
                self.save()
            if self.evaluates and (self.step % c.eval_every == 0 or pause):
                last = self.evaluate()
                self._log({"step": self.step, self.eval_key: last})
            if timed_out:
                break
        bar.close()
        return last or (self.evaluate() if self.evaluates else {})  # (a run already at its end: evaluated)

    @property
    def metrics_path(self) -> pathlib.Path:
        return pathlib.Path(self.out) / "metrics.jsonl"

    def resume(self) -> int:
        """Restores the newest readable checkpoint of this run, if any, onto this run's layout
        (whatever mesh wrote it); returns the step to continue from."""
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                                dict(params=self.params, opt_state=self.opt_state))
        found = self.ckpts.restore(abstract, self.run)
        if found is not None:
            self.step, state, meta = found
            self.params, self.opt_state = state["params"], state["opt_state"]
            self.elapsed = float(meta.get("elapsed_s", meta.get("elapsed", 0.0)))  # "elapsed": older EAGLE runs
            if getattr(self, "loader", None) is not None:
                self.loader.restore(meta.get("loader") or self.loader.state_at(self.step))
        self._trim_metrics()
        return self.step

    def save(self) -> None:
        meta = dict(run=self.run, step=self.step, elapsed_s=self.elapsed)
        if getattr(self, "loader", None) is not None:
            meta["loader"] = self.loader.state()
        self.ckpts.save(self.step, dict(params=self.params, opt_state=self.opt_state), meta)

    def check_finite(self, loss: float, step: int) -> None:
        """Raises `NonFiniteLoss` naming `step` (1-based) when `loss` is NaN or infinite; nothing is saved,
        so the newest checkpoint is the last good one."""
        if not math.isfinite(loss):
            last = self.ckpts.latest_step()
            kept = f"the last good checkpoint, step {last}, is kept in {self.ckpts.directory}" if last is not None \
                else "no checkpoint was saved before it"
            raise NonFiniteLoss(f"training loss is {loss} at step {step}: stopped without saving it; {kept}. "
                                "Lower --lr or check the data, then run again to resume from the checkpoint")

    def _trim_metrics(self) -> None:
        # Lines past the restored step were written by the killed run; the resumed one rewrites them.
        if self.metrics_path.is_file():
            lines = [l for l in self.metrics_path.read_text().splitlines()
                     if l.strip() and json.loads(l)["step"] <= self.step]
            self.metrics_path.write_text("".join(l + "\n" for l in lines))

    def _log(self, record: dict) -> None:
        self.metrics_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(record) + "\n")
