"""`specjax train-heads extract`: the frozen target's features over a corpus into a feature cache
(`train_heads.eagle.extract_cache`), to train EAGLE heads from."""

from __future__ import annotations

import argparse

from specjax.cli import flags
from train_heads.eagle import extract_cache


def add_arguments(t: argparse.ArgumentParser) -> None:
    """extract's own flags on `train-heads` (it shares --data, --features, --seq-len with eagle)."""
    t.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="extract: feature dtype")
    t.add_argument("--shard-size", type=int, default=64, help="extract: sequences per shard (unit of resumption)")
    t.add_argument("--forward-batch-size", type=int, default=4, help="extract: sequences per target forward")


def run(args: argparse.Namespace) -> int:
    conversations = 1024 if args.conversations is None else args.conversations
    if conversations < 1 or args.seq_len < 4 or args.shard_size < 1 or args.forward_batch_size < 1:
        raise ValueError("--conversations, --shard-size and --forward-batch-size must be >= 1, --seq-len >= 4")
    if args.max_minutes is not None and args.max_minutes <= 0:
        raise ValueError(f"--max-minutes={args.max_minutes}: must be > 0")
    out = flags.out_dir(args.out)
    layers = flags.feature_layers(args)
    extract_cache(args.model, out, data=args.data, conversations=conversations, seq_len=args.seq_len,
                  features=args.features, feature_layers=layers, dtype=args.dtype, shard_size=args.shard_size,
                  batch_size=args.forward_batch_size, max_minutes=args.max_minutes, log=flags.log)
    return 0
