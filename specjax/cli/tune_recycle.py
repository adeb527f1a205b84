"""`specjax tune-recycle`: token recycling's chain and tree for this machine, from the per-node
acceptance of a wide template and the verify window's cost measured here
(`train_heads.recycle.tune`); written to `tuning.json` beside the warm start, where
`--method recycle` and auto read it."""

from __future__ import annotations

import argparse
import json
import pathlib

from specjax.cli import flags, warm_recycle
from train_heads import recycle


def add_parser(sub) -> None:
    t = sub.add_parser("tune-recycle", help="choose token recycling's chain and tree for this machine "
                                            "(tuning.json beside a warm start)")
    t.add_argument("dir", help="the warm start's directory (from warm-recycle)")
    warm_recycle.add_prompt_args(t)
    t.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    warm_recycle.check(args)
    if not (pathlib.Path(args.dir) / "manifest.json").is_file():
        raise ValueError(f"{args.dir}: no manifest.json there; give a warm-recycle output directory")
    texts, _ = recycle.select_prompts(args.prompts_file, args.skip_per_task, args.per_task)
    out = recycle.tune(args.dir, args.model, texts, max_new_tokens=args.max_new_tokens, log=flags.log)
    print(json.dumps({k: out[k] for k in ("default", "chain", "tree", "costs")}, indent=1))
    return 0
