"""`specjax train-heads --kind eagle`: an EAGLE head, teacher-forced on ShareGPT or on a feature
cache (`train_heads.eagle.train_eagle`)."""

from __future__ import annotations

import argparse
import pathlib

from specjax.cli import flags
from specjax.models import config as model_config
from specjax.models.eagle import EagleConfig
from train_heads.eagle import EagleTrainConfig, train_eagle

EAGLE_DEFAULTS = dict(steps=400, batch_size=4, lr=1e-3, warmup=20, eval_every=100, save_every=25,
                      conversations=None)


def add_arguments(t: argparse.ArgumentParser) -> None:
    """The EAGLE head's flags on `train-heads` (the features and the data are extract's too)."""
    t.add_argument("--features", default="final", choices=["final", "fused"],
                   help="eagle: the target's final hidden state (EAGLE-1) or fused low/mid/high layers (EAGLE-3)")
    t.add_argument("--feature-layers", default=None,
                   help="eagle --features fused: target layers whose input the head reads, e.g. 2,15,27 "
                        "(default: 2, L/2 and L-3 of an L-layer target)")
    t.add_argument("--draft-vocab", type=int, default=16384, help="eagle: tokens the head may propose")
    t.add_argument("--seq-len", type=int, default=512, help="eagle: tokens per conversation")
    t.add_argument("--unroll", type=int, default=3, help="eagle: training-time-test steps")
    t.add_argument("--data", default="sharegpt", choices=["sharegpt", "self"],
                   help="eagle: complete ShareGPT conversations, or ShareGPT prompts with the target's own "
                        "greedy answers (generated once, cached, shared with medusa's data)")
    t.add_argument("--init", default=None, help="eagle: start from this head directory (fine-tune)")
    t.add_argument("--cache", default=None, help="eagle: train from this feature cache (train-heads extract)")
    t.add_argument("--vocab", default=None, choices=["target", "data"],
                   help="eagle: rank the draft vocabulary by the target's own argmax (needs --cache; its default) "
                        "or by the training tokens")
    t.add_argument("--input-norm", action=argparse.BooleanOptionalAction, default=True,
                   help="eagle: RMSNorm the feature and the token embedding (and each fused tap) before fc")
    t.add_argument("--rest-class", action=argparse.BooleanOptionalAction, default=True,
                   help="eagle: KL over the draft vocabulary plus the rest-of-vocabulary mass")
    t.add_argument("--b2", type=float, default=0.95, help="eagle: Adam's second-moment decay")
    t.add_argument("--feature-weight", type=float, default=0.1, help="eagle: weight of the feature regression")
    t.add_argument("--step-weights", default=None,
                   help="eagle: loss weight of each unrolled step, e.g. 1,0.8,0.64 (default 0.8**j)")


def _check(args: argparse.Namespace, eagle: dict) -> None:
    """Everything checked before the model loads."""
    if args.cache is not None and not (pathlib.Path(args.cache) / "index.json").is_file():
        raise ValueError(f"--cache {args.cache}: no feature cache there (index.json missing); build one with "
                         "`specjax train-heads extract --out DIR`")
    if args.vocab == "target" and args.cache is None:
        raise ValueError("--vocab target ranks by the target's argmax, which a feature cache holds: pass --cache")
    if args.conversations is not None and args.conversations < 1 or args.eval_conversations < 1:
        raise ValueError("--conversations and --eval-conversations must be >= 1")
    if args.max_minutes is not None and args.max_minutes <= 0:
        raise ValueError(f"--max-minutes={args.max_minutes}: must be > 0")
    if args.draft_vocab < 1:
        raise ValueError(f"--draft-vocab={args.draft_vocab}: must be >= 1")
    if args.features == "final" or eagle["feature_layers"]:  # fused without layers: 2, L/2 and L-3 of the model
        EagleConfig(dim=1, vocab_size=args.draft_vocab, layer=model_config.preset("tiny"), **eagle)
    if args.init is not None and not (pathlib.Path(args.init) / "manifest.json").is_file():
        raise ValueError(f"--init {args.init}: no EAGLE head there (manifest.json missing)")


def run(args: argparse.Namespace) -> int:
    """Trains an EAGLE head teacher-forced on ShareGPT (`train_heads.eagle.train_eagle`)."""
    weights = tuple(float(x) for x in args.step_weights.split(",")) if args.step_weights else None
    cfg = EagleTrainConfig(steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
                           warmup=args.warmup, weight_decay=args.weight_decay, unroll=args.unroll,
                           step_weights=weights, b2=args.b2, feature_weight=args.feature_weight,
                           eval_every=args.eval_every, save_every=args.save_every, keep=args.keep, seed=args.seed)
    eagle = dict(features=args.features, feature_layers=flags.feature_layers(args), draft_vocab=args.draft_vocab,
                 input_norm=args.input_norm, rest_class=args.rest_class)
    _check(args, eagle)
    out = flags.out_dir(args.out)
    train_eagle(args.model, out, eagle=eagle, cfg=cfg, conversations=args.conversations,
                eval_conversations=args.eval_conversations, max_minutes=args.max_minutes,
                data=args.data, init=args.init, cache=args.cache, vocab=args.vocab, log=flags.log)
    return 0
