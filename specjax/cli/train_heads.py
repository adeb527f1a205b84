"""`specjax train-heads`: Medusa heads on self-distilled ShareGPT data (default), an EAGLE head
(`--kind eagle`, `specjax.cli.train_eagle`), a feature cache (`train-heads extract`,
`specjax.cli.extract`) or the draft vocabularies' coverage (`train-heads coverage`,
`specjax.cli.coverage`)."""

from __future__ import annotations

import argparse

from specjax.cli import coverage, extract, flags, train_eagle
from specjax.methods import registry
from specjax.models.heads import HeadsConfig
from train_heads.train import TrainConfig, train_heads

MEDUSA_DEFAULTS = dict(steps=1000, batch_size=256, lr=1e-3, warmup=50, eval_every=200, save_every=100,
                       conversations=1024)


def add_parser(sub) -> None:
    t = sub.add_parser("train-heads", help="train Medusa heads on self-distilled ShareGPT data (`train-heads "
                                           "extract`: build a feature cache to train EAGLE heads from)")
    t.add_argument("action", nargs="?", default="train", choices=["train", "extract", "coverage"],
                   help="train (default); extract: run the target once over the corpus (--data, "
                        "--conversations, --seq-len, --features) and write its features to --out; coverage: "
                        "how much of the target's greedy output on --prompts-file each draft vocabulary "
                        "(ranked from --cache, and --eagle's) holds, per task class, written to --out")
    t.add_argument("--model", default="smollm2-135m", help="registry name, .gguf file or HF directory")
    t.add_argument("--out", required=True, help="run directory: heads (for --heads), checkpoints, metrics")
    flags.add_mesh(t)
    t.add_argument("--kind", default=registry.MEDUSA, choices=list(TRAIN_KINDS),
                   help="medusa: heads on self-distilled answers; eagle: one-layer feature head, teacher-forced")
    _add_training(t)
    _add_medusa(t)
    train_eagle.add_arguments(t)
    extract.add_arguments(t)
    coverage.add_arguments(t)
    t.set_defaults(func=run)


def _add_training(t: argparse.ArgumentParser) -> None:
    """The optimisation and the data, both kinds (defaults per kind: `MEDUSA_DEFAULTS`, `EAGLE_DEFAULTS`)."""
    t.add_argument("--steps", type=int, default=None, help="default 1000 (medusa) / 400 (eagle)")
    t.add_argument("--batch-size", type=int, default=None,
                   help="token positions (medusa, default 256) or sequences (eagle, default 4) per step")
    t.add_argument("--lr", type=float, default=None, help="default 1e-3")
    t.add_argument("--warmup", type=int, default=None, help="default 50 (medusa) / 20 (eagle)")
    t.add_argument("--weight-decay", type=float, default=0.0)
    t.add_argument("--eval-every", type=int, default=None, help="default 200 (medusa) / 100 (eagle)")
    t.add_argument("--save-every", type=int, default=None, help="default 100 (medusa) / 25 (eagle)")
    t.add_argument("--keep", type=int, default=3, help="training checkpoints kept")
    t.add_argument("--conversations", type=int, default=None,
                   help="ShareGPT prompts to distill (medusa, default 1024) / training conversations "
                        "(eagle, default steps x batch size)")
    t.add_argument("--eval-conversations", type=int, default=64, help="of those, held out")
    t.add_argument("--max-new-tokens", type=int, default=128, help="response length (greedy)")
    t.add_argument("--max-minutes", type=float, default=None,
                   help="eagle/extract: stop (checkpointed / between shards) after this long; run again to continue")
    t.add_argument("--seed", type=int, default=0)


def _add_medusa(t: argparse.ArgumentParser) -> None:
    t.add_argument("--num-heads", type=int, default=4)
    t.add_argument("--num-layers", type=int, default=1, help="residual blocks per head")
    t.add_argument("--own-projection", action="store_true", help="own [D, V] projection per head")
    t.add_argument("--token-input", action="store_true",
                   help="feed the heads the next token's embedding too (EAGLE/Hydra-style input)")
    t.add_argument("--head-decay", type=float, default=0.8, help="loss weight w**m of head m")
    t.add_argument("--max-prompt-tokens", type=int, default=256, help="longer prompts are skipped")
    t.add_argument("--gen-batch-size", type=int, default=16)


def run(args: argparse.Namespace) -> int:
    """Trains the heads of `--kind` (`TRAIN_KINDS`: its defaults and its command); `extract` builds a
    feature cache instead, `coverage` measures draft vocabularies."""
    if args.action == "extract":
        return extract.run(args)
    if args.action == "coverage":
        return coverage.run(args)
    defaults, train = TRAIN_KINDS[args.kind]
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    return train(args)


def train_medusa(args: argparse.Namespace) -> int:
    """Trains Medusa heads on self-distilled ShareGPT data (`train_heads.train.train_heads`)."""
    # Everything is checked before the model loads or any data is generated.
    config = TrainConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr, warmup=args.warmup,
                         weight_decay=args.weight_decay, head_decay=args.head_decay,
                         eval_every=args.eval_every, save_every=args.save_every, keep=args.keep,
                         seed=args.seed)
    heads = dict(num_heads=args.num_heads, num_layers=args.num_layers, own_projection=args.own_projection,
                 token_input=args.token_input)
    HeadsConfig(dim=1, vocab_size=1, **heads)
    if not 0 < args.eval_conversations < args.conversations:
        raise ValueError(f"--eval-conversations={args.eval_conversations}: must be >= 1 and less than "
                         f"--conversations={args.conversations}")
    if args.max_new_tokens < 2 or args.max_prompt_tokens < 1 or args.gen_batch_size < 1:
        raise ValueError("--max-new-tokens must be >= 2, --max-prompt-tokens and --gen-batch-size >= 1")
    out = flags.out_dir(args.out)
    train_heads(args.model, out, heads=heads, config=config, conversations=args.conversations,
                eval_conversations=args.eval_conversations, max_new_tokens=args.max_new_tokens,
                max_prompt_tokens=args.max_prompt_tokens, gen_batch_size=args.gen_batch_size,
                log=flags.log, mesh=flags.mesh_arg(args), cache=args.cache)
    return 0


# the heads `train-heads --kind` trains, for the method of that name: defaults and the command
TRAIN_KINDS = {registry.MEDUSA: (MEDUSA_DEFAULTS, train_medusa),
               registry.EAGLE: (train_eagle.EAGLE_DEFAULTS, train_eagle.run)}
