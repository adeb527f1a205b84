"""Side-by-side regression check of two commits in one run: plain and every method, same prompts.

Each commit is checked out into a temporary worktree and imported from a symlink tree that mirrors
the installed package layout (specjax/, specjax/models -> models/, and train_heads/ beside them;
also specjax/train_heads for commits from before it was a top-level package). Workers for the two commits alternate (A B, then B A, ...), each in its own process,
so drift on a busy machine spreads over both. Per commit and method: tokens per second (wall time
includes time to first token, compile excluded), tau, time to first token and compile time.

With `--scheduler SLOTS` every method serves all prompts at once through a `Scheduler` of SLOTS
slots instead (compile and warm-up excluded; tok/s is the run's tokens over its wall time), and
`auto` (the adaptive controller over its default options) may be among the methods.

Usage:
  python tools/compare_commits.py BASE [HEAD] [--rounds 2] [--per-task 1] [--max-new-tokens 128]
                                    [--methods none,ngram,medusa,medusa-tree] [--scheduler 4]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

METHODS = {"none": dict(), "ngram": dict(method="ngram", k=4), "medusa": dict(method="medusa", k=4),
           "medusa-tree": dict(method="medusa", tree="heads"), "auto": None}  # auto: --scheduler only
ROOT = pathlib.Path(__file__).resolve().parents[1]


def _package_tree(worktree: pathlib.Path, into: pathlib.Path) -> None:
    pkg = into / "specjax"
    pkg.mkdir(parents=True)
    for entry in (worktree / "specjax").iterdir():
        (pkg / entry.name).symlink_to(entry)
    (pkg / "models").symlink_to(worktree / "models")
    (into / "train_heads").symlink_to(worktree / "train_heads")  # a top-level package
    (pkg / "train_heads").symlink_to(worktree / "train_heads")  # commits before it was one import specjax.train_heads


def worker(args) -> None:
    sys.path.insert(0, args.worker)
    from specjax.methods.config import SpecConfig
    from specjax.serving.engine import Engine
    from specjax.bench.prompts import read_prompts

    prompts = read_prompts(args.prompts_file, per_task=args.per_task)
    eng = Engine.load("smollm2-135m", assets={"medusa": "default"})
    if args.scheduler:
        return print(json.dumps(_serve(eng, prompts, args)))
    rows = []
    for p in prompts:
        for m, kw in ((m, METHODS[m]) for m in args.methods.split(",")):
            r = eng.generate([p.text], chat=True, max_new_tokens=args.max_new_tokens, spec=SpecConfig.make(**kw))[0]
            tau = r.tau if hasattr(r, "tau") else r.extra["tau"]
            rows.append(dict(method=m, task=p.task, tokens=r.tokens, new=r.new_tokens, wall=r.wall_s,
                             ttft=r.ttft_s, compile=r.compile_s, tau=tau, fwd=r.target_forwards))
    print(json.dumps(rows))


def _serve(eng, prompts, args) -> list[dict]:
    """Every method serves all prompts through one Scheduler of `args.scheduler` slots."""
    import time

    from specjax.methods.config import SpecConfig
    from specjax.serving.engine import GenerateOptions
    from specjax.serving.scheduler import Scheduler

    rows = []
    for m in args.methods.split(","):
        spec = "auto" if METHODS[m] is None else SpecConfig.make(**METHODS[m])
        s = Scheduler(eng, slots=args.scheduler, spec=spec, opts=GenerateOptions(max_new_tokens=args.max_new_tokens),
                      chat=True)
        for p in prompts:
            s.submit(p.text, task=p.task)
        s.prepare()
        s.warm()
        t0 = time.perf_counter()
        done = s.run()
        wall = (time.perf_counter() - t0) / len(done)  # the run's wall time, spread over its requests
        rows += [dict(method=m, task=r.task, tokens=r.tokens, new=len(r.tokens), wall=wall, ttft=r.ttft_s,
                      compile=0.0, tau=r.tau, fwd=r.target_forwards) for r in done]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("base")
    ap.add_argument("head", nargs="?", default="HEAD")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--per-task", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--prompts-file", default="tasks", help="a file, or a shipped set (tasks, ops)")
    ap.add_argument("--methods", default="none,ngram,medusa,medusa-tree", help=f"some of {','.join(METHODS)}")
    ap.add_argument("--scheduler", type=int, default=0, help="serve through a Scheduler of this many slots")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if not args.methods or set(args.methods.split(",")) - set(METHODS):
        ap.error(f"--methods {args.methods!r}: give some of {','.join(METHODS)}")
    if "auto" in args.methods.split(",") and not args.scheduler:
        ap.error("auto is a scheduler policy: add --scheduler SLOTS")
    if args.worker:
        return worker(args)
    from specjax.bench.prompts import resolve  # this checkout's: the workers get a file, whatever their commit

    args.prompts_file = str(resolve(args.prompts_file).resolve())
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="specjax-compare-"))
    trees = {}
    for name in (args.base, args.head):
        wt = tmp / f"wt-{len(trees)}"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(wt), name], check=True,
                       capture_output=True)
        _package_tree(wt, tmp / f"pkg-{len(trees)}")
        trees[name] = tmp / f"pkg-{len(trees)}"
    results: dict[str, list] = {n: [] for n in trees}
    try:
        for rnd in range(args.rounds):
            order = list(trees.items())
            for name, pkg in (order if rnd % 2 == 0 else order[::-1]):  # A B, then B A: drift hits both
                print(f"round {rnd + 1}: {name}", file=sys.stderr, flush=True)
                out = subprocess.run([sys.executable, __file__, name, "--worker", str(pkg), "--per-task",
                                      str(args.per_task), "--max-new-tokens", str(args.max_new_tokens),
                                      "--methods", args.methods, "--scheduler", str(args.scheduler),
                                      "--prompts-file", args.prompts_file], check=True, capture_output=True,
                                     text=True, env=dict(os.environ, PYTHONPATH=str(pkg)))
                results[name] += json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        for i in range(len(trees)):
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tmp / f"wt-{i}")],
                           capture_output=True)
    # TTFT apart for calls that compiled: the first run of a freshly compiled program pays a one-time
    # cost in XLA:CPU (on [N, K] weights ~0.9 s for a SmolLM2 prefill), which is not the prefill's speed
    print("| method | commit | tok/s | tau | TTFT p50 | TTFT p50, calls that compiled | compile (max) | identical to base |")
    print("|---|---|---|---|---|---|---|---|")
    p50 = lambda rows: f"{statistics.median(r['ttft'] for r in rows) * 1e3:.0f} ms" if rows else "-"
    base_tokens = {}
    for m in args.methods.split(","):
        for name, rows in results.items():
            sel = [r for r in rows if r["method"] == m]
            if name == args.base:
                base_tokens[m] = [r["tokens"] for r in sel]
            same = sum(a["tokens"] == b for a, b in zip(sel, base_tokens[m]))
            print(f"| {m} | {name[:10]} | {sum(r['new'] for r in sel) / sum(r['wall'] for r in sel):.1f} | "
                  f"{sum(r['new'] - 1 for r in sel) / sum(r['fwd'] for r in sel):.2f} | "
                  f"{p50([r for r in sel if not r['compile']])} | {p50([r for r in sel if r['compile']])} | "
                  f"{max(r['compile'] for r in sel):.1f} s | {same}/{len(sel)} |")


if __name__ == "__main__":
    main()
