"""Flag groups the subcommands share, and what they read back: the model, the mesh, sampling, the
benches' prompts and outputs, and a method's flags (its record's, `specjax.methods.registry.Flag`)."""

from __future__ import annotations

import argparse
import pathlib
import sys

from specjax.bench.prompts import SHIPPED, Prompt, read_prompts
from specjax.methods import registry


def add_model(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m",
                   help="catalogue name (smollm2-135m, qwen2.5-coder-0.5b, qwen2.5-coder-1.5b, gemma3-270m), "
                        ".gguf file or HF directory")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="compute dtype (float32 is the fast one on CPU)")
    p.add_argument("--weights-arith", default="exact", choices=["exact", "q8"],
                   help="how a GGUF file's packed weights are multiplied: exact (gguf's fp32 weights, HF's "
                        "numbers) or q8 (llama.cpp's int8 activations and integer dots: faster, not "
                        "HF-identical; plain and speculative decoding share it)")


def add_mesh(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mesh", default=None,
                   help="run on a device mesh, e.g. data=4,model=2 (batch rows over data, tensor "
                        "parallel over model; data*model = all devices of all processes)")
    p.add_argument("--distributed", action="store_true",
                   help="call jax.distributed.initialize() first (coordinator from the environment: "
                        "TPU slice, Slurm, Open MPI, or JAX_COORDINATOR_ADDRESS etc.)")


def mesh_arg(args):
    """The `--mesh` of a command as a `jax.sharding.Mesh`, or None."""
    from specjax import sharding

    spec = getattr(args, "mesh", None)
    return None if spec is None else sharding.make_mesh(spec)


def add_sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    p.add_argument("--seed", type=int, default=0)


def add_prompt_selection(p: argparse.ArgumentParser) -> None:
    p.add_argument("--per-task", type=int, default=None, help="first N prompts of each task class")
    p.add_argument("--tasks", default=None, help="comma-separated task classes to keep")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template")


def add_bench(p: argparse.ArgumentParser) -> None:
    """What both benches share: the prompts, the budget, the chat template, the JSON output."""
    p.add_argument("--prompts-file", default=None,
                   help=f"JSON lines with task and turns, or a shipped set ({', '.join(SHIPPED)}; "
                        "default: a synthetic ~100-token prompt)")
    add_prompt_selection(p)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--json", dest="json_path", default=None, help="write the records to this path")


def add_methods(p: argparse.ArgumentParser, *, many: bool = False, default: str = "none") -> None:
    """`--method` (or with `many`, `--methods`), then every method's flags: its asset flag and its
    options' flags (`registry.flags()`)."""
    if many:
        p.add_argument("--methods", default=default,
                       help=f"comma-separated: none, {', '.join(registry.RECORDS)}, a method's tuned tree as "
                            "METHOD-tree (eagle-tree), and auto (loadbench); none is always measured as the "
                            "baseline")
    else:
        p.add_argument("--method", default="none", choices=["none", *registry.RECORDS, "auto"],
                       help="speculation method (none = plain decoding; auto = the adaptive controller "
                            "through the scheduler, with the plain loop measured beside it)")
    for rec in registry.RECORDS.values():
        if rec.flag is not None:
            p.add_argument(rec.flag, default=None, help=rec.flag_help)
    for f in registry.flags():
        p.add_argument(f.name, type=f.type, default=None, help=f.help)


def log(message: str) -> None:
    """A progress line on stderr."""
    print(message, file=sys.stderr, flush=True)


def quiet_unless_process_0() -> None:
    import os

    import jax

    if jax.process_index() != 0:  # every process runs the same program; one of them talks
        sys.stdout = open(os.devnull, "w")


def prompts_of(args, demo: tuple[Prompt, ...] = ()) -> list[Prompt]:
    """The prompts a command runs: `--prompt`, `--prompts-file` (with `--per-task`, `--tasks`) or
    (`--demo`) `demo`; exactly one of them."""
    if getattr(args, "demo", False):
        if args.prompt is not None or args.prompts_file:
            raise SystemExit("error: --demo runs its own prompts: drop --prompt / --prompts-file, or --demo")
        return list(demo)
    if args.prompt is not None and args.prompts_file:
        raise SystemExit("error: give --prompt or --prompts-file, not both")
    if args.prompts_file:
        tasks = tuple(t.strip() for t in args.tasks.split(",")) if getattr(args, "tasks", None) else None
        return read_prompts(args.prompts_file, per_task=getattr(args, "per_task", None), tasks=tasks)
    if args.prompt is None:
        raise SystemExit("error: give --prompt TEXT or --prompts-file FILE")
    if not args.prompt:
        raise SystemExit("error: --prompt is empty")
    return [Prompt(id=1, text=args.prompt)]


def names(text: str) -> tuple[str, ...]:
    """A comma-separated flag as names, each once, in order."""
    return tuple(dict.fromkeys(m.strip() for m in text.split(",") if m.strip()))


def out_dir(path: str) -> pathlib.Path:
    """`--out` as a directory (it may not exist yet); ValueError when it is a file."""
    out = pathlib.Path(path)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; give a directory")
    return out


def feature_layers(args: argparse.Namespace) -> tuple[int, ...]:
    """`--feature-layers` as integers (checked against `--features`)."""
    layers = tuple(int(x) for x in args.feature_layers.split(",")) if args.feature_layers else ()
    if args.features == "final" and layers:
        raise ValueError("--feature-layers is for --features fused")
    return layers
