"""Structured answers on a real model: what a constraint's mask costs a plain step, and what the
methods buy under it, on the demo's schema prompt (`demo-schema`: a configuration's settings as JSON).

    .venv/bin/python -m specjax.bench.experiments.constrained                 # SmolLM2-135M
    .venv/bin/python -m specjax.bench.experiments.constrained --repeats 7 --methods none,ngram,forced

1. The mask: the prompt decoded plain without a pool, and under the schema inside the loop (the pool of
   one, the mask at every step, the automaton advanced), interleaved; milliseconds per target forward
   of the decode loop (prefill excluded). The constrained answer is shorter than the free one (it ends
   when the JSON is complete), so the comparison is per step.
2. The methods under the schema (greedy, each equal to constrained plain token for token): target
   forwards, tau and decode time, interleaved, each method's ratio to plain in the same run.
"""

from __future__ import annotations

import argparse
import statistics

from specjax.bench.prompts import DEMO, read_prompts
from specjax.bench.verify_profile import alternating
from specjax.methods.config import SpecConfig
from specjax.serving.engine import Engine, GenerateOptions


def mask_cost(engine: Engine, prompt: str, tables, *, max_new_tokens: int, repeats: int) -> dict:
    opts = GenerateOptions(max_new_tokens=max_new_tokens)
    arms = {"free": None, "constrained": tables}
    for t in arms.values():  # compiled outside the timing
        engine.start([prompt], opts, chat=True, constraint=t).run()

    def run(arm):
        batch = engine.start([prompt], opts, chat=True, constraint=arms[arm])
        (res,) = batch.run()
        return batch.decode_s / max(1, res.target_forwards) * 1e3

    ms = alternating(arms, repeats, run)
    free, held = statistics.median(ms["free"]), statistics.median(ms["constrained"])
    return dict(free_ms=free, constrained_ms=held, cost=held / free - 1)


def methods(engine: Engine, prompt: str, tables, specs: dict[str, SpecConfig], *, max_new_tokens: int,
            repeats: int) -> dict[str, dict]:
    opts = GenerateOptions(max_new_tokens=max_new_tokens)
    first = {a: engine.start([prompt], opts, chat=True, spec=s, constraint=tables).run()[0] for a, s in specs.items()}

    def run(arm):
        batch = engine.start([prompt], opts, chat=True, spec=specs[arm], constraint=tables)
        batch.run()
        return batch.decode_s

    secs = alternating(specs, repeats, run)
    plain = statistics.median(secs["none"]) if "none" in secs else None
    return {a: dict(tokens=r.new_tokens, forwards=r.target_forwards, tau=r.tau, same=r.tokens == first["none"].tokens
                    if "none" in first else None, decode_s=statistics.median(secs[a]),
                    speedup=None if plain is None else plain / statistics.median(secs[a]))
            for a, r in first.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--methods", default="none,ngram,forced", help="comma-separated, each at --k")
    ap.add_argument("--k", type=int, default=6)
    args = ap.parse_args(argv)
    (demo,) = [p for p in read_prompts(DEMO) if p.response_format is not None]
    engine = Engine.load(args.model)
    tables = engine.constraint_for(response_format=demo.response_format)
    m = mask_cost(engine, demo.text, tables, max_new_tokens=args.max_new_tokens, repeats=args.repeats)
    print(f"{args.model}, {demo.id}: plain step {m['free_ms']:.2f} ms free, {m['constrained_ms']:.2f} ms under the "
          f"schema: the mask costs {m['cost']:+.1%} (medians of {args.repeats}, interleaved)")
    specs = {name: SpecConfig() if name == "none" else SpecConfig(method=name, k=args.k)
             for name in (x.strip() for x in args.methods.split(",") if x.strip())}
    for name, r in methods(engine, demo.text, tables, specs, max_new_tokens=args.max_new_tokens,
                           repeats=args.repeats).items():
        ratio = "" if r["speedup"] is None else f", {r['speedup']:.2f}x plain"
        print(f"  {name:>8}: {r['tokens']} tokens in {r['forwards']} target forwards (tau {r['tau']:.2f}), decode "
              f"{r['decode_s']:.2f} s{ratio}; same tokens as plain: {r['same']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
