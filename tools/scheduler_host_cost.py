"""The scheduler's host cost per chunk at two commits, side by side in one run.

Serves 12 requests through a 4-slot Scheduler (plain, then prompt lookup) on the tiny random model,
where a step's device time is about 1 ms, so a chunk's wall time is mostly the host's work (slot
operations, reads, bookkeeping). Each commit runs in its own process from a checked-out worktree
(see compare_commits.py); the commits alternate per round. Prints ms per chunk and whether the
outputs are identical.

With MODEL=smollm2-135m in the environment the same requests run on that model instead, where a
chunk's time is mostly the device's: the per-chunk times then compare the compiled loops.

Usage: [MODEL=smollm2-135m] .venv/bin/python tools/scheduler_host_cost.py BASE [HEAD] [ROUNDS]
"""
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))


def worker(tree):
    sys.path.insert(0, tree)
    import time

    from specjax.methods.config import SpecConfig
    from specjax.serving.engine import Engine, GenerateOptions
    from specjax.serving.scheduler import Scheduler
    from specjax.models import config, loader
    model = os.environ.get("MODEL")
    eng = Engine.load(model) if model else Engine(loader.init_model(config.preset("tiny"), seed=0))
    out = {}
    for name, spec in (("none", SpecConfig()), ("ngram", SpecConfig(method="ngram", k=4))):
        for _ in range(3):
            s = Scheduler(eng, slots=4, spec=spec, opts=GenerateOptions(max_new_tokens=96))
            for i in range(12):
                s.submit([1 + i, 2, 3, 4, 5, 6] * 3)
            s.prepare()
            s.warm()
            t0 = time.perf_counter()
            done = s.run()
            w = time.perf_counter() - t0
            loop = sum(c.seconds for c in s.chunk_log)
            out.setdefault(name, []).append(dict(wall=w, chunks=len(s.chunk_log), chunk_s=loop,
                                                 toks=[r.tokens for r in done]))
    print(json.dumps(out))


def main():
    from compare_commits import _package_tree
    base = sys.argv[1]
    head = sys.argv[2] if len(sys.argv) > 2 else "HEAD"
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    tmp = pathlib.Path(tempfile.mkdtemp())
    trees = {}
    for c in (base, head):
        wt = tmp / f"wt-{c}"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(wt), c], check=True,
                       capture_output=True)
        _package_tree(wt, tmp / f"pkg-{c}")
        trees[c] = str(tmp / f"pkg-{c}")
    res = {c: [] for c in trees}
    try:
        for r in range(rounds):
            for c in ((base, head) if r % 2 == 0 else (head, base)):
                p = subprocess.run([sys.executable, __file__, "--worker", trees[c]], capture_output=True, text=True,
                                   env=dict(os.environ, JAX_PLATFORMS="cpu"))
                if p.returncode:
                    raise SystemExit(p.stderr[-3000:])
                res[c].append(json.loads(p.stdout.strip().splitlines()[-1]))
    finally:
        for c in trees:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tmp / f"wt-{c}")])
    for name in ("none", "ngram"):
        for c in trees:
            runs = [x for rnd in res[c] for x in rnd[name]]
            per = [x["wall"] / x["chunks"] * 1e3 for x in runs]
            loop = [x["chunk_s"] / x["chunks"] * 1e3 for x in runs]
            print(f"{name:6s} {c:8s} chunks {runs[0]['chunks']:4d}  ms/chunk median {statistics.median(per):6.2f} "
                  f"min {min(per):6.2f}  in chunks {statistics.median(loop):6.2f}  wall median {statistics.median(x['wall'] for x in runs):.3f}s")
        same = all(x["toks"] == res[base][0][name][0]["toks"] for c in trees for rnd in res[c] for x in rnd[name])
        print(name, "outputs identical:", same)


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        raise SystemExit(__doc__)
    if sys.argv[1] == "--worker":
        worker(sys.argv[2])
    else:
        main()
