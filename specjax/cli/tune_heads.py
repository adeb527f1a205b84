"""`specjax tune-heads`: trained heads' token subset and candidate tree (`--heads`,
`train_heads.tune`), or an EAGLE head's chain, tree and draft vocabulary (`--eagle`,
`train_heads.tune_eagle`), from held-out accuracy and costs measured on this machine."""

from __future__ import annotations

import argparse
import pathlib

from specjax.cli import flags
from train_heads import tune as medusa_tuning, tune_eagle as eagle_tuning


def add_parser(sub) -> None:
    u = sub.add_parser("tune-heads", help="choose trained heads' token subset and candidate tree "
                                          "from held-out accuracy and costs measured on this machine "
                                          "(--eagle DIR: an EAGLE head's chain, tree and draft vocabulary)")
    who = u.add_mutually_exclusive_group(required=True)
    who.add_argument("--heads", help="Medusa heads directory (from train-heads)")
    who.add_argument("--eagle", help="EAGLE head directory (from train-heads --kind eagle)")
    u.add_argument("--model", default="smollm2-135m")
    u.add_argument("--vocab-size", type=int, default=8192, help="medusa: tokens the heads may propose")
    u.add_argument("--max-nodes", type=int, default=32, help="medusa: largest tree considered")
    u.add_argument("--prompts", type=int, default=6, help="eagle: held-out ShareGPT prompts measured")
    u.add_argument("--max-new-tokens", type=int, default=96, help="eagle: tokens per measured prompt")
    u.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    return tune_eagle(args) if args.eagle else tune_medusa(args)


def tune_eagle(args: argparse.Namespace) -> int:
    if not (pathlib.Path(args.eagle) / "manifest.json").is_file():
        raise ValueError(f"--eagle {args.eagle}: no manifest.json there; give a train-heads --kind eagle directory")
    if args.prompts < 1 or args.max_new_tokens < 2:
        raise ValueError("--prompts must be >= 1 and --max-new-tokens >= 2")
    eagle_tuning.tune(args.eagle, args.model, prompts=args.prompts, max_new_tokens=args.max_new_tokens, log=flags.log)
    return 0


def tune_medusa(args: argparse.Namespace) -> int:
    if not (pathlib.Path(args.heads) / "manifest.json").is_file():
        raise ValueError(f"--heads {args.heads}: no manifest.json there; give a train-heads output directory")
    if args.vocab_size < 1 or not 1 <= args.max_nodes <= 64:
        raise ValueError("--vocab-size must be >= 1 and --max-nodes in [1, 64]")
    medusa_tuning.tune(args.heads, args.model, vocab_size=args.vocab_size, max_nodes=args.max_nodes)
    return 0
