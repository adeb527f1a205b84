"""What a constraint's mask costs a plain decode step: the same prompt decoded plain without a pool,
and under a JSON schema inside the loop (the pool of one, the mask at every step, the automaton
advanced), interleaved; milliseconds per target forward of the decode loop (prefill excluded).

    .venv/bin/python -m specjax.bench.experiments.mask_cost                 # SmolLM2-135M, the demo schema
    .venv/bin/python -m specjax.bench.experiments.mask_cost --repeats 9 --max-new-tokens 64

The constrained answer is shorter than the free one (it ends when the JSON is complete), so the
comparison is per step; both arms run the same compiled step shape apart from the pool.
"""

from __future__ import annotations

import argparse
import statistics

from specjax.bench.prompts import DEMO, read_prompts
from specjax.serving.engine import Engine, GenerateOptions


def measure(engine: Engine, prompt: str, response_format: dict, *, max_new_tokens: int, repeats: int) -> dict:
    opts = GenerateOptions(max_new_tokens=max_new_tokens)
    tables = engine.constraint_for(response_format=response_format)
    arms = {"free": None, "constrained": tables}
    for t in arms.values():  # compiled outside the timing
        engine.start([prompt], opts, chat=True, constraint=t).run()
    ms: dict[str, list[float]] = {a: [] for a in arms}
    tokens = {}
    for i in range(repeats):
        for arm in (list(arms) if i % 2 == 0 else list(arms)[::-1]):
            batch = engine.start([prompt], opts, chat=True, constraint=arms[arm])
            (res,) = batch.run()
            ms[arm].append(batch.decode_s / max(1, res.target_forwards) * 1e3)
            tokens[arm] = res.new_tokens
    free, held = statistics.median(ms["free"]), statistics.median(ms["constrained"])
    return dict(free_ms=free, constrained_ms=held, cost=held / free - 1, tokens=tokens, repeats=repeats,
                free_range=(min(ms["free"]), max(ms["free"])), constrained_range=(min(ms["constrained"]),
                                                                                 max(ms["constrained"])))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    args = ap.parse_args(argv)
    (demo,) = [p for p in read_prompts(DEMO) if p.response_format is not None]
    r = measure(Engine.load(args.model), demo.text, demo.response_format, max_new_tokens=args.max_new_tokens,
                repeats=args.repeats)
    print(f"{args.model}, {demo.id}: plain step {r['free_ms']:.2f} ms free ({r['free_range'][0]:.2f}-"
          f"{r['free_range'][1]:.2f}), {r['constrained_ms']:.2f} ms under the schema ({r['constrained_range'][0]:.2f}-"
          f"{r['constrained_range'][1]:.2f}): the mask costs {r['cost']:+.1%} (median of {r['repeats']} interleaved; "
          f"{r['tokens']['free']} and {r['tokens']['constrained']} tokens)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
