"""Token recycling's warm start and its templates, for a model on this machine.

`warm`: the target answers a prompt set greedily (its own answers, under the chat template), then one
batched forward over each prompt + answer writes the target's top-k at every position into an empty
matrix and second-order table, exactly as a prefill of that text would (`Decoder.prefill_target`
with recycling's shared state, in file order: a later position overwrites an earlier one). The
result is saved beside the heads (`specjax.methods.recycle.assets`), where `--method recycle` finds it.

`tune`: measures, on this machine, how often each node of a wide template is accepted and what a
verify step of each window costs (the decode loop itself, drafting and the matrix's update
included), and picks the chain and the tree (4-64 nodes; the default tree at most `DEFAULT_NODES`)
with the best expected tokens per second (`tree_search.choose_subtree`). It writes `tuning.json`
beside the warm start; `Engine.tuned("recycle")` and `--method recycle` read it.

    python -m specjax.train_heads.recycle warm --prompts-file P.jsonl --out DIR
    python -m specjax.train_heads.recycle tune DIR --prompts-file P.jsonl
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import statistics
import sys
import time

import jax
import numpy as np
from flax import nnx

DEFAULT_NODES = 16  # the default tree: at most this many nodes
MEASURE_TREE_NODES = 64


def sequences(engine, prompts: list[str], *, max_new_tokens: int, batch_size: int, log=print) -> list[list[int]]:
    """Each prompt (chat template) followed by the target's own greedy answer."""
    ids = engine.encode(prompts, chat=True)
    out = []
    t0 = time.perf_counter()
    for i in range(0, len(ids), batch_size):
        part = ids[i:i + batch_size]
        res = engine.generate(part, batch_size=batch_size, max_new_tokens=max_new_tokens)
        out += [p + r.tokens for p, r in zip(part, res)]
        log(f"answered {len(out)}/{len(ids)} prompts ({time.perf_counter() - t0:.0f} s)")
    return out


def write(engine, seqs: list[list[int]], spec, *, tokens_per_batch: int = 4096):
    """The recycling state after a prefill over every sequence, in order (batches of one bucket)."""
    from specjax.core import shared as shared_state
    from specjax.core.decoder import Decoder, Inputs, cache_length

    parts = shared_state.init((spec,))
    for bucket in sorted({engine.bucket_for(len(s)) for s in seqs}):
        group = [s for s in seqs if engine.bucket_for(len(s)) == bucket]
        rows = max(1, tokens_per_batch // bucket)
        dec = Decoder(cache_length=cache_length(bucket, 1, 1), shared=(spec,))
        for i in range(0, len(group), rows):
            part = group[i:i + rows]  # padding rows repeat row 0 and write nothing (contribute False)
            inputs = Inputs.create(part, bucket=bucket, batch_size=rows, max_new_tokens=1,
                                   contribute=[True] * len(part))
            parts = _prefill_parts(engine.graphdef, engine.params, inputs, parts, dec=dec)
    return parts[spec.name]


@functools.partial(jax.jit, static_argnames=("graphdef", "dec"), donate_argnames=("parts",))
def _prefill_parts(graphdef, params, inputs, parts, *, dec):
    return dec.prefill_target(nnx.merge(graphdef, params), inputs, parts)[0].shared.parts


def warm(model: str, prompts: list[str], out, *, k: int = 8, order: int = 2, table: int = 1 << 16,
         max_new_tokens: int = 128, batch_size: int = 8, source: str = "", log=print) -> dict:
    """Warms a matrix on `prompts` and saves it to `out`; returns its manifest."""
    from specjax.methods.recycle import assets
    from specjax.methods.recycle.matrix import RecycleSpec
    from specjax.serving.engine import Engine

    engine = Engine.load(model)
    spec = RecycleSpec(vocab=engine.config.vocab_size, k=k, order=order, table=table)
    seqs = sequences(engine, prompts, max_new_tokens=max_new_tokens, batch_size=batch_size, log=log)
    t0 = time.perf_counter()
    state = write(engine, seqs, spec)
    first, written = np.asarray(state.first[0]), np.asarray(state.first_owner[0]) == 0
    keys, second = np.asarray(state.keys), np.asarray(state.second)
    keys = np.where((np.asarray(state.owner) == 0)[:, None], keys, -1)
    log(f"wrote the top-{k} at {sum(map(len, seqs))} positions in {time.perf_counter() - t0:.0f} s: "
        f"{int(written.sum())} matrix rows, {int((keys >= 0).all(1).sum())} second-order entries")
    manifest = dict(model=engine.name, weights_id=engine.weights_id, order=order, prompts=len(prompts),
                    positions=int(sum(map(len, seqs))), max_new_tokens=max_new_tokens, source=source,
                    answers="target, greedy, chat template")
    old = pathlib.Path(out) / assets.TUNING
    tuning = json.loads(old.read_text()) if old.is_file() else None
    assets.save(out, first=first, written=written, keys=keys, second=second, manifest=manifest, tuning=tuning)
    return assets.read(out)[0]


def _main(argv=None) -> int:
    from specjax.bench.prompts import read_prompts

    ap = argparse.ArgumentParser(prog="python -m specjax.train_heads.recycle")
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("warm", help="warm a matrix from the target's own answers")
    w.add_argument("--model", default="smollm2-135m")
    w.add_argument("--prompts-file", action="append", required=True, help="JSON lines (repeatable)")
    w.add_argument("--skip-per-task", type=int, default=0,
                   help="leave out the first N prompts of each task class (kept for measuring)")
    w.add_argument("--out", required=True)
    w.add_argument("--k", type=int, default=8)
    w.add_argument("--max-new-tokens", type=int, default=128)
    w.add_argument("--batch-size", type=int, default=8)
    args = ap.parse_args(argv)
    log = lambda m: print(m, file=sys.stderr, flush=True)
    texts, names = [], []
    for f in args.prompts_file:
        seen: dict = {}
        for p in read_prompts(f):
            seen[p.task] = seen.get(p.task, 0) + 1
            if seen[p.task] > args.skip_per_task:
                texts.append(p.text)
        names.append(f"{pathlib.Path(f).name} (each task class but its first {args.skip_per_task})")
    man = warm(args.model, texts, args.out, k=args.k, max_new_tokens=args.max_new_tokens,
               batch_size=args.batch_size, source="; ".join(names), log=log)
    print(json.dumps(man, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
