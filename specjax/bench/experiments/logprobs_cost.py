"""What recording logprobs costs a step: each method decoded with `logprobs` off and at 20
alternatives (`Engine.generate(logprobs=)`), interleaved, milliseconds per target forward of the decode
loop (prefill excluded), on the shipped demo's open question.

    .venv/bin/python -m specjax.bench.experiments.logprobs_cost                   # SmolLM2-135M, q8
    .venv/bin/python -m specjax.bench.experiments.logprobs_cost --arith exact --methods none --repeats 9

With logprobs on, every scored slot adds a log-softmax over the vocabulary and a top-k: one row per
plain step, the verify window's rows for a method. The tokens are the same either way (checked).
"""

from __future__ import annotations

import argparse
import statistics

from specjax.bench.prompts import DEMO, read_prompts
from specjax.bench.verify_profile import alternating
from specjax.methods.config import SpecConfig
from specjax.serving.engine import Engine, GenerateOptions


def cost(engine: Engine, prompt: str, spec: SpecConfig, *, top: int, max_new_tokens: int, repeats: int) -> dict:
    opts = GenerateOptions(max_new_tokens=max_new_tokens)
    arms = {"off": None, f"top {top}": top}
    first = {a: engine.start([prompt], opts, chat=True, spec=spec, logprobs=n).run()[0] for a, n in arms.items()}
    if len({tuple(r.tokens) for r in first.values()}) != 1:
        raise AssertionError("recording logprobs changed the tokens")

    def run(arm):
        batch = engine.start([prompt], opts, chat=True, spec=spec, logprobs=arms[arm])
        (res,) = batch.run()
        return batch.decode_s / max(1, res.target_forwards) * 1e3

    ms = {a: statistics.median(v) for a, v in alternating(arms, repeats, run).items()}
    off, on = ms["off"], ms[f"top {top}"]
    return dict(off_ms=off, on_ms=on, cost=on / off - 1, forwards=first["off"].target_forwards)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--arith", default="q8", choices=("exact", "q8"))
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--methods", default="none,ngram", help="comma-separated, each at --k")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--top", type=int, default=20)
    args = ap.parse_args(argv)
    prompt = next(p for p in read_prompts(DEMO) if p.response_format is None and p.prediction is None)
    engine = Engine.load(args.model, weights_arith=args.arith)
    print(f"{args.model} ({args.arith}), {prompt.id}, medians of {args.repeats}, interleaved:")
    for name in (x.strip() for x in args.methods.split(",") if x.strip()):
        spec = SpecConfig() if name == "none" else SpecConfig(method=name, k=args.k)
        r = cost(engine, prompt.text, spec, top=args.top, max_new_tokens=args.max_new_tokens, repeats=args.repeats)
        print(f"  {spec.label:>8}: {r['off_ms']:.2f} ms per target forward without logprobs, {r['on_ms']:.2f} with "
              f"{args.top} alternatives ({r['cost']:+.1%}; {r['forwards']} forwards)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
