"""`specjax warm-recycle`: token recycling's warm start for a model, from the target's own greedy
answers to a prompt set (`train_heads.recycle.warm`); `--method recycle` reads it with
`--recycle-warm DIR`, and the one shipped for the model by default."""

from __future__ import annotations

import argparse
import json

from specjax.cli import flags
from specjax.methods.recycle.options import MAX_CANDIDATES
from train_heads import recycle


def add_prompt_args(p: argparse.ArgumentParser) -> None:
    """The prompts both recycling commands run, and the answers' length."""
    p.add_argument("--model", default="smollm2-135m", help="catalogue name, .gguf file or HF directory")
    p.add_argument("--prompts-file", action="append", required=True,
                   help="JSON lines with task and turns, or a shipped set (tasks, ops); repeatable")
    p.add_argument("--skip-per-task", type=int, default=0,
                   help="leave out the first N prompts of each task class (kept for measuring)")
    p.add_argument("--per-task", type=int, default=None, help="then take N of each class (default: all)")
    p.add_argument("--max-new-tokens", type=int, default=128)


def add_parser(sub) -> None:
    w = sub.add_parser("warm-recycle", help="warm token recycling's matrix from the target's own answers "
                                            "to a prompt set")
    add_prompt_args(w)
    w.add_argument("--out", required=True, help="the warm start's directory")
    w.add_argument("--recycle-k", type=int, default=8, help="candidates kept per token, 1..32")
    w.add_argument("--batch-size", type=int, default=8)
    w.set_defaults(func=run)


def check(args: argparse.Namespace) -> None:
    if args.skip_per_task < 0 or (args.per_task is not None and args.per_task < 1) or args.max_new_tokens < 1:
        raise ValueError("--skip-per-task must be >= 0, --per-task >= 1 and --max-new-tokens >= 1")


def run(args: argparse.Namespace) -> int:
    check(args)
    if not 1 <= args.recycle_k <= MAX_CANDIDATES or args.batch_size < 1:
        raise ValueError(f"--recycle-k must be in 1..{MAX_CANDIDATES} and --batch-size >= 1")
    texts, source = recycle.select_prompts(args.prompts_file, args.skip_per_task, args.per_task)
    out = recycle.warm(args.model, texts, args.out, k=args.recycle_k, max_new_tokens=args.max_new_tokens,
                       batch_size=args.batch_size, source=source, log=flags.log)
    print(json.dumps(out, indent=1))
    return 0
