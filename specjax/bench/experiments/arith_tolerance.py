"""How far "q8" arithmetic (`weights_arith="q8"`, llama.cpp's) moves a model from the exact one.

For each prompt of a shipped set: the exact model's greedy continuation, then both arithmetics read
prompt + continuation teacher-forced, 8 tokens a forward (a row computes the same in any window, so
these are the logits decoding would see after the same tokens).
Per continuation position: KL(exact || q8) of the next-token distributions, whether their top-1
agree, and the largest logit difference. Also whether each prompt's free-running greedy output is the
same in both.

    python -m specjax.bench.experiments.arith_tolerance --prompts-file tasks --per-task 2
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.bench.prompts import read_prompts
from specjax.models import loader
from specjax.serving.engine import Engine

WINDOW = 8


def _teacher_forced(model, tokens: list[int]) -> np.ndarray:
    """Next-token log-probabilities `[len(tokens), V]` read `WINDOW` tokens a forward."""
    graphdef, params = nnx.split(model)

    @jax.jit
    def fwd(params, toks, pos, cache):
        out = nnx.merge(graphdef, params)(toks, pos, cache)
        return jax.nn.log_softmax(out.logits, -1), out.cache

    n = -(-len(tokens) // WINDOW) * WINDOW
    toks = np.zeros((1, n), np.int32)
    toks[0, :len(tokens)] = tokens
    cache, rows = model.init_cache(1, n), []
    for i in range(0, n, WINDOW):
        lp, cache = fwd(params, jnp.asarray(toks[:, i:i + WINDOW]), jnp.arange(i, i + WINDOW, dtype=jnp.int32)[None],
                        cache)
        rows.append(np.asarray(lp[0]))
    return np.concatenate(rows)[:len(tokens)]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--prompts-file", default="tasks")
    p.add_argument("--per-task", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=64)
    a = p.parse_args(argv)
    exact = loader.load(a.model, weights="packed")
    q8 = loader.load(a.model, weights="packed", weights_arith="q8")
    prompts = read_prompts(a.prompts_file, per_task=a.per_task)
    e_exact, e_q8 = Engine(exact.model, exact.tokenizer), Engine(q8.model, q8.tokenizer)
    kl, agree, dmax, same = [], [], [], 0
    for pr in prompts:
        (ids,) = e_exact.encode([pr.text], chat=True)
        (ge,) = e_exact.generate([ids], max_new_tokens=a.max_new_tokens)
        (gq,) = e_q8.generate([ids], max_new_tokens=a.max_new_tokens)
        same += ge.tokens == gq.tokens
        seq = ids + list(ge.tokens)
        le, lq = (_teacher_forced(m.model, seq)[len(ids) - 1:len(seq) - 1] for m in (exact, q8))
        kl.extend(np.sum(np.exp(le) * (le - lq), -1))
        agree.extend(le.argmax(-1) == lq.argmax(-1))
        dmax.append(float(np.abs(le - lq).max()))
    kl, agree = np.asarray(kl), np.asarray(agree)
    print(f"{a.model}, {len(prompts)} prompts of {a.prompts_file}, {len(kl)} continuation positions, "
          f"windows of {WINDOW}:")
    print(f"  KL(exact || q8): mean {kl.mean():.2e}, p99 {np.quantile(kl, 0.99):.2e}, max {kl.max():.2e}")
    print(f"  top-1 agreement: {agree.mean():.4f} ({int((~agree).sum())} of {len(agree)} differ)")
    print(f"  largest log-probability difference: {max(dmax):.3f}")
    print(f"  free-running greedy output identical: {same} of {len(prompts)}")


if __name__ == "__main__":
    main()
