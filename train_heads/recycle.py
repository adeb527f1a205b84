"""Token recycling's warm start and its templates, for a model on this machine.

`warm`: the target answers a prompt set greedily (its own answers, under the chat template), then one
batched forward over each prompt + answer writes the target's top-k at every position into an empty
matrix and second-order table, exactly as a prefill of that text would (`Decoder.prefill_target`
with recycling's shared state, in file order: a later position overwrites an earlier one). The
result is saved beside the heads (`specjax.methods.recycle.assets`), where `--method recycle` finds it.

`tune`: measures, on this machine, how often each node of a wide template is accepted and what a
verify step of each window costs (the decode loop itself, drafting and the matrix's update
included), and picks the chain, the tree (4-64 nodes) and the default (the faster of chain and
tree of at most `DEFAULT_NODES` nodes) with the best expected tokens per second
(`tree_search.choose_subtree`). It writes `tuning.json` beside the warm start;
`Engine.tuned("recycle")` (the default; `tree=True`: the tree) and `--method recycle` read it.

    specjax warm-recycle --prompts-file P.jsonl --out DIR
    specjax tune-recycle DIR --prompts-file P.jsonl

(`python -m train_heads.recycle warm|tune` runs the same.)
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import pathlib
import platform
import statistics
import sys
import time

import jax
import numpy as np
from flax import nnx

from specjax.bench import verify_profile
from specjax.bench.offline import SYNTHETIC_PROMPT
from specjax.bench.prompts import read_prompts
from specjax.core import shared as shared_state
from specjax.core.decoder import Decoder, Inputs, cache_length
from specjax.methods import tree_search
from specjax.methods.config import SpecConfig
from specjax.methods.recycle import assets
from specjax.methods.recycle.matrix import RecycleSpec
from specjax.serving.engine import Engine, GenerateOptions

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


def measurement_tree(nodes: int = MEASURE_TREE_NODES, depth: int = 8, ranks: int = 8) -> tuple:
    """The wide template whose nodes' acceptance `tune` measures: the best tree of `nodes` under a
    prior that halves with each rank and thins with depth (every smaller tree `tune` picks is a
    subtree of it)."""
    acc = np.array([[0.7 * 0.55 ** r for r in range(ranks)] for _ in range(depth)])
    return tree_search.best_tree(acc, nodes)


def node_rates(engine, prompts: list[str], template, *, max_new_tokens: int, log=print) -> np.ndarray:
    """How often each node of `template` was kept per step, greedy, over `prompts` (chat)."""
    spec = SpecConfig.make("recycle", tree=template)
    kept, steps = np.zeros(len(template)), 0
    for i, p in enumerate(prompts):
        r = engine.generate([p], chat=True, max_new_tokens=max_new_tokens, spec=spec)[0]
        kept += np.asarray(r.counters.accepted_per_node)
        steps += r.counters.num_drafts
        log(f"  prompt {i + 1}/{len(prompts)}: tau {r.tau:.2f}")
    return kept / max(steps, 1)


def step_costs(engine, templates: dict[int, tuple], *, steps: int = 48, repeats: int = 3) -> dict[int, float]:
    """Seconds per decode step of recycling with each template (window = nodes + 1; drafting and the
    matrix's update included), relative to a plain step, on this machine: the median of `repeats`
    runs, taken in turns so that drift spreads over all of them (`verify_profile.alternating`)."""
    specs = {1: SpecConfig(), **{len(t) + 1: SpecConfig.make("recycle", tree=t, recycle_warm="cold")
                                 for t in templates.values()}}
    opts = GenerateOptions(max_new_tokens=steps, stop_ids=())

    def per_step(w: int) -> float:
        batch = engine.start([SYNTHETIC_PROMPT], opts, chat=True, spec=specs[w])
        return batch.decode_s / batch.run()[0].target_forwards

    for w in specs:  # compiled and warm before any is timed
        per_step(w)
    times = verify_profile.alternating(specs, repeats, per_step)  # the bench's turns, order alternating
    plain = statistics.median(times[1])
    return {w: statistics.median(t) / plain for w, t in sorted(times.items())}


def tune(directory, model: str, prompts: list[str], *, max_new_tokens: int = 128, max_nodes: int = 64,
         default_nodes: int = DEFAULT_NODES, log=print) -> dict:
    """Measures per-node acceptance and window costs here; writes the chosen chain and tree (the
    default tree at most `default_nodes` nodes; the best of every size in `sizes` beside it) to
    `tuning.json` beside the warm start at `directory`."""

    engine = Engine.load(model)
    engine.load_asset("recycle", str(directory))
    wide = measurement_tree(max_nodes)
    log(f"per-node acceptance of a {len(wide)}-node template on {len(prompts)} prompts ...")
    rate = node_rates(engine, prompts, wide, max_new_tokens=max_new_tokens, log=log)
    spine = [i for i, p in enumerate(wide) if all(r == 0 for r in p)]
    sizes = [n for n in (4, 6, 8, 12, 16, 24, 32, 48, 64) if n <= len(wide)]
    templates = {n: tree_search.subtree(wide, rate, n) for n in sizes}
    chains = {d: tuple((0,) * i for i in range(1, d + 1)) for d in (2, 3, 4, 6, 8) if d <= len(spine)}
    log("window costs (plain step = 1) ...")
    tree_cost = step_costs(engine, templates)
    chain_cost = step_costs(engine, {d: chains[d] for d in chains})
    log(f"  trees: {tree_cost}\n  chains: {chain_cost}")
    small, small_speed, _ = tree_search.choose_subtree(wide, rate, tree_cost, [n for n in sizes if n <= default_nodes])
    tree, speed, everything = tree_search.choose_subtree(wide, rate, tree_cost, sizes)
    chain_rates = [rate[i] for i in spine]
    chain_tau = {d: 1.0 + sum(chain_rates[:d]) for d in chains}
    grid, vals = np.array(sorted(chain_cost)), np.array([chain_cost[w] for w in sorted(chain_cost)])
    chain_speed = {d: chain_tau[d] / float(np.interp(d + 1, grid, vals)) for d in chains}
    k = max(chain_speed, key=chain_speed.get)
    chain = dict(k=k, tau=round(chain_tau[k], 4), expected_speedup=round(chain_speed[k], 4))
    as_tree = lambda t, v: dict(tree=[list(p) for p in t], nodes=len(t), tau=everything[len(t)]["tau"],
                                expected_speedup=round(v, 4))
    tuning = dict(
        default=chain if chain_speed[k] > small_speed and k <= default_nodes else as_tree(small, small_speed),
        chain=chain, tree=as_tree(tree, speed),
        sizes={str(n): dict(v, tree=[list(p) for p in templates[n]]) for n, v in everything.items()},
        chains={str(d): dict(tau=round(chain_tau[d], 4), expected_speedup=round(chain_speed[d], 4)) for d in chains},
        costs=dict(tree={str(w): round(c, 4) for w, c in tree_cost.items()},
                   chain={str(w): round(c, 4) for w, c in chain_cost.items()}),
        acceptance=[dict(path=list(p), kept=round(float(r), 4)) for p, r in zip(wide, rate)],
        measured=dict(prompts=len(prompts), max_new_tokens=max_new_tokens, machine=platform.machine(),
                      cpus=os.cpu_count(), backend=jax.default_backend()))
    (pathlib.Path(directory) / assets.TUNING).write_text(json.dumps(tuning, indent=1) + "\n")
    return tuning


def select_prompts(files: list[str], skip: int, take: int | None) -> tuple[list[str], str]:
    """Prompts of each task class from the `skip`-th on (`take` of them, or all), in file order."""
    texts, names = [], []
    for f in files:
        seen: dict = {}
        for p in read_prompts(f):
            seen[p.task] = seen.get(p.task, 0) + 1
            if skip < seen[p.task] and (take is None or seen[p.task] <= skip + take):
                texts.append(p.text)
        names.append(f"{pathlib.Path(f).name} (per task class, prompts {skip + 1}.."
                     f"{'' if take is None else skip + take})")
    return texts, "; ".join(names)


def _main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m train_heads.recycle")
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("warm", help="warm a matrix from the target's own answers")
    t = sub.add_parser("tune", help="choose the chain and tree for this machine (tuning.json)")
    for p in (w, t):
        p.add_argument("--model", default="smollm2-135m")
        p.add_argument("--prompts-file", action="append", required=True, help="JSON lines (repeatable)")
        p.add_argument("--skip-per-task", type=int, default=0,
                       help="leave out the first N prompts of each task class (kept for measuring)")
        p.add_argument("--per-task", type=int, default=None, help="then take N of each class (default all)")
        p.add_argument("--max-new-tokens", type=int, default=128)
    w.add_argument("--out", required=True)
    w.add_argument("--k", type=int, default=8)
    w.add_argument("--batch-size", type=int, default=8)
    t.add_argument("dir", help="the warm start's directory (tuning.json is written there)")
    args = ap.parse_args(argv)
    log = lambda m: print(m, file=sys.stderr, flush=True)
    texts, source = select_prompts(args.prompts_file, args.skip_per_task, args.per_task)
    if args.cmd == "warm":
        out = warm(args.model, texts, args.out, k=args.k, max_new_tokens=args.max_new_tokens,
                   batch_size=args.batch_size, source=source, log=log)
    else:
        out = tune(args.dir, args.model, texts, max_new_tokens=args.max_new_tokens, log=log)
        out = {k: out[k] for k in ("default", "chain", "tree", "costs")}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
