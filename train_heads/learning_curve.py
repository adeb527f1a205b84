"""A learning curve for EAGLE heads: one run from a feature cache with a head saved at each budget, then
live-loop acceptance and tau of each head on a prompt file (plain decoding in the same process).

    python -m train_heads.learning_curve train CACHE OUT 50,100,200,400 \\
        [--draft-vocab 4096 --batch-size 1 --seq-len 512 --unroll 2 --lr 1e-3 --eval 4]
    python -m train_heads.learning_curve bench OUT.json PROMPTS.jsonl HEAD_DIR[,HEAD_DIR...] \\
        [--per-task 2 --k 3 --max-new-tokens 128]
    python -m train_heads.learning_curve plot docs/plots/eagle_learning_curve.json \\
        docs/plots/eagle_learning_curve.png

Heads land in OUT/head-<updates>/ (loadable with `--eagle`); training metrics in OUT/metrics.jsonl.
The budgets are points along one warmup-cosine schedule that ends at the largest.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import numpy as np

from specjax.bench import offline as b
from specjax.bench.prompts import read_prompts
from specjax.methods.config import SpecConfig
from specjax.models import eagle_io
from specjax.models.eagle import EagleConfig
from specjax.serving.engine import Engine, GenerateOptions
from train_heads import cache as fc, eagle as tr


def train(cache_dir, out, budgets, *, draft_vocab=4096, batch_size=1, seq_len=512, unroll=2, lr=1e-3,
          n_eval=4, model="smollm2-135m", deadline: float | None = None, log=print) -> list[dict]:
    """`model`: a registry name or path, or an already loaded target (anything with `model`, `config`,
    `name` and `weights_id`, such as an `Engine`: the accelerator route loads one without a tokenizer).
    `deadline` (a `time.perf_counter()` value): training stops there, checkpointed, and the head of the
    budget it reached is saved as `head-<updates>`; later budgets are skipped."""
    out = pathlib.Path(out)
    if isinstance(model, (str, pathlib.Path)):
        engine = Engine.load(str(model))
    else:
        engine = model
    c = fc.FeatureCache(cache_dir, require_complete=False)
    held, data = fc.CachedSequences(c, np.arange(n_eval)), fc.CachedSequences(c, np.arange(n_eval, len(c)))
    ids = fc.target_vocabulary(c, data.ids, draft_vocab)
    config = EagleConfig.for_model(engine.config, draft_vocab=draft_vocab, input_norm=True, rest_class=True)
    cfg = tr.EagleTrainConfig(steps=max(budgets), batch_size=batch_size, seq_len=seq_len, unroll=unroll, lr=lr,
                              warmup=min(50, max(budgets) // 10), log_every=10, save_every=50, eval_every=10**9,
                              keep=2)
    run_info = dict(model=engine.name, weights_id=engine.weights_id, conversations=len(data),
                    cache=c.index["corpus"], eval_conversations=len(held), vocab="target")
    t = tr.EagleTrainer(config, engine.model, data, held, ids, out, cfg, run_info=run_info)
    t.resume()
    log(f"{len(data)} training sequences ({data.num_tokens} train positions), {len(held)} held out")
    records = []
    for b in sorted(budgets):
        if deadline is not None and t.step < b:
            left = deadline - time.perf_counter()
            if left <= 0:
                log(f"out of time at {t.step} updates: budgets from {b} on are skipped")
                break
            m = t.fit(stop_at=b, max_seconds=left, progress=False)
            b = t.step  # the budget reached (short of b when time ran out)
        else:
            m = t.fit(stop_at=b, progress=False) if t.step < b else t.evaluate()
        lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        rec = dict(step=t.step, held_out=m, train_s=round(t.elapsed, 1),
                   positions=sum(r["train"]["tokens"] for r in lines if "loss" in r and r["step"] <= b))
        log(json.dumps(rec))
        records.append(rec)
        head_dir = out / f"head-{b}"
        if not (head_dir / "manifest.json").is_file():
            eagle_io.save_head(head_dir, t.head, ids, dict(
                model=engine.name, weights_id=engine.weights_id, steps=t.step, train_time_s=rec["train_s"],
                data=dict(source=c.meta.get("source"), cache=str(cache_dir), sequences=len(data),
                          train_positions=data.num_tokens, positions_seen=rec["positions"], vocab="target"),
                train=dict(vars(cfg)), metrics=m))
    t.ckpts.close()
    return records


def bench(out_json, prompts_file, heads, *, per_task=2, k=3, max_new_tokens=128, model="smollm2-135m",
          log=print) -> dict:
    engine = Engine.load(model)
    prompts = read_prompts(prompts_file, per_task=per_task)
    opts = GenerateOptions(max_new_tokens=max_new_tokens)
    rows = b.run(engine, prompts, {"none": SpecConfig()}, opts, chat=True, progress=False)
    results = {}
    for h in heads:
        engine.load_asset("eagle", h)
        spec = engine.tuned("eagle", k=k)
        t0 = time.perf_counter()
        rows += b.run(engine, prompts, {h: spec}, opts, chat=True, progress=False)
        results[h] = [s for s in b.summarize([x for x in rows if x["method"] in ("none", h)]) if s["method"] == h]
        a = results[h][0]
        log(f"{h}: tau {a['tau']:.3f} speed {a['speedup_vs_none']:.2f}x accepted/pos {a['accepted_tokens_per_pos']} "
            f"identical {a['greedy_identical_n']}/{a['prompts']} ({time.perf_counter() - t0:.0f}s)")
        report = dict(per_task=per_task, k=k, results=results,
                      plain=[s for s in b.summarize(rows) if s["method"] == "none"])
        pathlib.Path(out_json).write_text(json.dumps(report, indent=1, default=str))
    return report


def plot(points_json, out_png) -> str:
    """Live first-position acceptance and tau against positions seen in training, one line per run,
    from `points_json`: {"runs": {name: [{"updates", "positions", "acc1", "tau"}, ...]}, "reference":
    {name: {"acc1", "tau"}}} (the table in docs/BENCHMARKS.md, kept beside the plot)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    data = json.loads(pathlib.Path(points_json).read_text())
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, label in zip(axes, ("acc1", "tau"), ("live acceptance, first draft", "tau (chain K=3)")):
        for name, pts in data["runs"].items():
            pts = sorted(pts, key=lambda q: q["positions"])
            ax.plot([q["positions"] for q in pts], [q[key] for q in pts], "o-", label=name)
            for q in pts:
                ax.annotate(str(q["updates"]), (q["positions"], q[key]), textcoords="offset points", xytext=(3, 3),
                            fontsize=7)
        for name, ref in data.get("reference", {}).items():
            ax.axhline(ref[key], ls="--", lw=1, color="gray", label=name)
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel("positions seen in training (labels: updates)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    return str(out_png)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    t = sub.add_parser("train")
    t.add_argument("cache")
    t.add_argument("out")
    t.add_argument("budgets")
    t.add_argument("--draft-vocab", type=int, default=4096)
    t.add_argument("--batch-size", type=int, default=1)
    t.add_argument("--seq-len", type=int, default=512)
    t.add_argument("--unroll", type=int, default=2)
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--eval", type=int, default=4)
    bb = sub.add_parser("bench")
    bb.add_argument("out_json")
    bb.add_argument("prompts_file")
    bb.add_argument("heads")
    bb.add_argument("--per-task", type=int, default=2)
    bb.add_argument("--k", type=int, default=3)
    bb.add_argument("--max-new-tokens", type=int, default=128)
    pl = sub.add_parser("plot")
    pl.add_argument("points_json")
    pl.add_argument("out_png")
    a = p.parse_args(argv)
    if a.what == "plot":
        plot(a.points_json, a.out_png)
    elif a.what == "train":
        train(a.cache, a.out, [int(x) for x in a.budgets.split(",")], draft_vocab=a.draft_vocab,
              batch_size=a.batch_size, seq_len=a.seq_len, unroll=a.unroll, lr=a.lr, n_eval=a.eval)
    else:
        bench(a.out_json, a.prompts_file, a.heads.split(","), per_task=a.per_task, k=a.k,
              max_new_tokens=a.max_new_tokens)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
