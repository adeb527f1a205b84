"""`specjax train-heads coverage`: the draft vocabularies' share of the target's greedy tokens, per
task class (`train_heads.coverage`)."""

from __future__ import annotations

import argparse
import json
import pathlib

import numpy as np

from specjax.bench.prompts import read_prompts
from specjax.models import eagle_io
from specjax.serving.engine import Engine
from train_heads import cache as feature_cache, coverage
from train_heads.sequences import draft_vocabulary

SIZES = (4096, 8192, 16384)


def add_arguments(t: argparse.ArgumentParser) -> None:
    t.add_argument("--prompts-file", default=None, help="coverage: JSON lines with a task field, or a shipped "
                                                        "set (tasks, ops)")
    t.add_argument("--per-task", type=int, default=4, help="coverage: prompts per task class")
    t.add_argument("--eagle", default=None, help="coverage: also an EAGLE head's draft vocabulary")


def _rankings(args: argparse.Namespace, fc, vocab_size: int) -> dict:
    """Each draft vocabulary, most frequent first: ranked from the cache, and `--eagle`'s."""
    ids = range(len(fc))
    tokens = np.concatenate([fc.sequence(i)["tokens"] for i in ids])[None]
    mask = np.concatenate([fc.sequence(i)["mask"] for i in ids])[None]
    out = {"target argmax (cache)": feature_cache.target_vocabulary(fc, ids, max(SIZES)),
           "data tokens (cache)": draft_vocabulary(tokens, mask, max(SIZES), vocab_size)}
    if args.eagle:
        out[f"head {args.eagle}"] = eagle_io.load_head(args.eagle)[1]
    return out


def run(args: argparse.Namespace) -> int:
    if args.prompts_file is None or args.cache is None:
        raise ValueError("coverage needs --prompts-file (with task classes) and --cache (to rank from)")
    if args.per_task < 1:
        raise ValueError(f"--per-task={args.per_task}: must be >= 1")
    fc = feature_cache.FeatureCache(args.cache, require_complete=False)
    prompts = read_prompts(args.prompts_file, per_task=args.per_task)
    engine = Engine.load(args.model)
    answers = coverage.greedy_answers(engine, prompts, max_new_tokens=args.max_new_tokens)
    rankings = _rankings(args, fc, engine.config.vocab_size)
    tables = {k: coverage.coverage(answers, v, [s for s in SIZES if s <= len(v)] or [len(v)])
              for k, v in rankings.items()}
    text = coverage.format_table(tables, list(SIZES)) if all(len(v) >= max(SIZES) for v in rankings.values()) \
        else json.dumps(tables, indent=1)
    print(text)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(prompts=str(args.prompts_file), per_task=args.per_task,
                                   max_new_tokens=args.max_new_tokens, answer_tokens={k: int(sum(map(len, v)))
                                   for k, v in answers.items()}, coverage=tables), indent=1))
    return 0
