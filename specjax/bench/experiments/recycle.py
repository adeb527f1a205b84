"""Token recycling against plain decoding, offline, side by side in one run (`specjax.bench.offline.run`:
each prompt with every arm back to back): tau, tok/s and speedup per task class, the step cost of
each arm's window relative to a plain step (measured in the same run: decode time per target
forward), tau by draft position, and the acceptance of each template node.

Arms (default: none, recycle, recycle-nospine, recycle-cold, recycle-chain):
  none                   the plain loop
  recycle                the tuned default template, warm start, prompt lookup on the spine
  recycle-nospine        the same without the spine
  recycle-cold           the same with the matrix cold
  recycle-first-order    the same without the second-order table
  recycle-chain          the tuned chain
  recycle-tree           the tuned tree (any size)
  recycle-tree:N         the tuned tree of N nodes (tuning.json's `sizes`)
  ngram                  prompt lookup, chain of 4

    flock /work/tools/heavy.lock .venv/bin/python -m specjax.bench.experiments.recycle \\
        --prompts-file ../shared/data/specbench-dev.jsonl --per-task 4 --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys



def arms(engine, names: list[str]) -> dict:
    from specjax.methods import registry
    from specjax.methods.config import SpecConfig
    from specjax.methods.recycle import record

    tuning = record._tuning(engine.assets)
    default = SpecConfig.make("recycle", **registry.tuned("recycle", engine.assets))
    tuned_tree = registry.tuned("recycle", engine.assets, tree=True)["tree"]
    tuned_chain = tuning.get("chain", {}).get("k", 4)
    sizes = tuning.get("sizes", {})
    out = {}
    for name in names:
        if name == "none":
            out[name] = SpecConfig()
        elif name == "recycle":
            out[name] = default
        elif name == "recycle-tree":
            out[name] = SpecConfig.make("recycle", tree=tuned_tree)
        elif name == "recycle-nospine":
            out[name] = default.with_options(recycle_spine=0)
        elif name == "recycle-cold":
            out[name] = default.with_options(recycle_warm="cold")
        elif name == "recycle-first-order":
            out[name] = default.with_options(recycle_order=1)
        elif name == "recycle-chain":
            out[name] = SpecConfig.make("recycle", k=tuned_chain)
        elif name.startswith("recycle-tree:"):
            out[name] = SpecConfig.make("recycle", tree=tuple(tuple(p) for p in sizes[name.split(":")[1]]["tree"]))
        elif name == "ngram":
            out[name] = SpecConfig.make("ngram", k=4)
        else:
            raise SystemExit(f"unknown arm {name}")
    return out


def summary(rows: list[dict], specs: dict, windows: dict[str, int]) -> list[dict]:
    """Per (arm, class and "all"): tau, tok/s, speedup, step cost (decode s per forward over plain's),
    tau by position, per-node acceptance (kept per step), identity with plain."""
    from specjax import telemetry

    tasks = ["all"] + sorted({str(r["task"]) for r in rows})
    base = {(r["rep"], r["id"]): r for r in rows if r["method"] == "none"}
    out = []
    for m in specs:
        for t in tasks:
            sel = [r for r in rows if r["method"] == m and (t == "all" or str(r["task"]) == t)]
            ref = [base[(r["rep"], r["id"])] for r in sel]
            tok_s = sum(r["new_tokens"] for r in sel) / sum(r["wall_s"] for r in sel)
            ref_tok_s = sum(r["new_tokens"] for r in ref) / sum(r["wall_s"] for r in ref)
            step = lambda rs: sum(r["wall_s"] - r["ttft_s"] for r in rs) / max(1, sum(r["forwards"] for r in rs))
            c = telemetry.aggregate(r["counters"] for r in sel)
            steps = max(c.num_drafts, 1)
            out.append(dict(
                arm=m, task=t, prompts=len(sel), window=windows[m],
                tau=sum(r["new_tokens"] - 1 for r in sel) / max(1, sum(r["forwards"] for r in sel)),
                tok_s=round(tok_s, 2), speedup=round(tok_s / ref_tok_s, 3), step_cost=round(step(sel) / step(ref), 3),
                tau_by_position=[round(x / steps, 3) for x in c.accepted_tokens_per_pos],
                kept_per_node=[round(x / steps, 3) for x in c.accepted_per_node],
                identical=f"{sum(r['tokens'] == x['tokens'] for r, x in zip(sel, ref))}/{len(sel)}"))
    return out


def markdown(records: list[dict]) -> str:
    head = "| arm | task | prompts | window | tau | tok/s | speedup | step cost | identical |\n|---|---|---|---|---|---|---|---|---|\n"
    return head + "\n".join(f"| {r['arm']} | {r['task']} | {r['prompts']} | {r['window']} | {r['tau']:.2f} | "
                            f"{r['tok_s']:.1f} | {r['speedup']:.2f}x | {r['step_cost']:.2f} | {r['identical']} |"
                            for r in records)


def main(argv=None) -> int:
    from specjax.bench import offline
    from specjax.bench.prompts import read_prompts
    from specjax.serving.engine import Engine, GenerateOptions

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompts-file", required=True)
    ap.add_argument("--per-task", type=int, default=4)
    ap.add_argument("--skip-per-task", type=int, default=0)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--arms", default="none,recycle,recycle-nospine,recycle-cold,recycle-chain")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    prompts, seen = [], {}
    for p in read_prompts(args.prompts_file):
        seen[p.task] = seen.get(p.task, 0) + 1
        if args.skip_per_task < seen[p.task] <= args.skip_per_task + args.per_task:
            prompts.append(p)
    engine = Engine.load(args.model)
    engine.load_asset("recycle")
    specs = arms(engine, ["none"] + [a for a in args.arms.split(",") if a != "none"])
    opts = GenerateOptions(max_new_tokens=args.max_new_tokens)
    print(f"{len(prompts)} prompts, arms {', '.join(specs)}", file=sys.stderr)
    for spec in specs.values():  # compile outside the timing
        engine.generate([prompts[0].text], chat=True, max_new_tokens=args.max_new_tokens, spec=spec)
    rows = offline.run(engine, prompts, specs, opts, chat=True, repeats=args.repeats, progress=False)
    from specjax.core.decoder import window_of

    windows = {m: 1 if s.method == "none" else window_of(engine.proposer(s)[0]) for m, s in specs.items()}
    records = summary(rows, specs, windows)
    print(markdown(records))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(records=records, specs={m: repr(s) for m, s in specs.items()},
                           window_ms=offline.window_costs(engine.model, windows=(1, 5, 9, 17, 33))), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
