"""`specjax bench`: offline, the plain loop and each method side by side on the same prompts, per
task class, with the roofline (`specjax.bench.offline`); `--verify-profile` instead times what
verify windows cost (`specjax.bench.verify_profile`)."""

from __future__ import annotations

import argparse
import json
import sys

from specjax.cli import flags, specs


def add_parser(sub) -> None:
    b = sub.add_parser("bench", help="offline: the plain loop and each method side by side on the same "
                                     "prompts, per task class, with the roofline")
    flags.add_model(b)
    flags.add_mesh(b)
    flags.add_methods(b, many=True, default="none,ngram")
    flags.add_bench(b)
    b.add_argument("--batch-size", type=int, default=1, help="prompts per compiled batch")
    b.add_argument("--repeats", type=int, default=1, help="runs over all prompts, interleaved")
    b.add_argument("--hf", action="store_true", help="also time HF transformers' plain loop (oracle extra)")
    b.add_argument("--verify-profile", action="store_true",
                   help="instead: what 1/4/5/9/16-row products and forwards cost per matmul, beside the memory "
                        "and compute floors (random weights of --model's shape; see specjax.bench.verify_profile)")
    b.set_defaults(func=run)


def _check(args: argparse.Namespace):
    """Everything checked before the model loads: (methods, specs without the tuned ones, options)."""
    from specjax.bench import offline
    from specjax.bench.prompts import check_output_paths
    from specjax.methods import registry
    from specjax.serving.engine import GenerateOptions

    methods = tuple(dict.fromkeys(("none",) + flags.names(args.methods)))
    bad = [m for m in methods if m not in offline.OFFLINE_METHODS]
    if bad:
        hint = " (auto is a scheduler policy: see `specjax loadbench`)" if "auto" in bad else ""
        raise ValueError(f"unknown method {bad[0]!r}: use one of {', '.join(offline.OFFLINE_METHODS)}{hint}")
    opts = GenerateOptions(max_new_tokens=args.max_new_tokens, stop_ids=None if args.chat else ())
    opts.validate()
    check_output_paths(args.json_path)
    if args.repeats < 1 or args.batch_size < 1:
        raise ValueError(f"--repeats={args.repeats}, --batch-size={args.batch_size}: must be >= 1")
    specs.check_given(args, [registry.base(m) for m in methods if m != "none"], how=specs.INCLUDES_NEEDS_FLAG)
    return methods, {m: specs.bench_spec(args, m) for m in methods}, opts


def run(args: argparse.Namespace) -> int:
    """Validates everything, loads the model, runs, prints and writes."""
    from specjax.bench import offline
    from specjax.bench.prompts import bench_prompts
    from specjax.methods import registry

    if args.verify_profile:
        from specjax.bench import verify_profile

        verify_profile.main([args.model], repeats=max(args.repeats, 15), json_path=args.json_path)
        return 0
    methods, given, opts = _check(args)
    prompts = bench_prompts(args.prompts_file, per_task=args.per_task, tasks=args.tasks,
                            default=offline.SYNTHETIC_PROMPT)
    engine = specs.engine_for(args, [registry.base(m) for m in methods if m != "none"])
    by_label = {m: spec or specs.bench_spec(args, m, engine) for m, spec in given.items()}
    engine.check([p.text for p in prompts], opts, chat=args.chat)
    for spec in by_label.values():
        engine.proposer(spec)
    print(f"model {engine.config.name}, {len(prompts)} prompts, {args.max_new_tokens} new tokens, "
          f"methods {', '.join(methods)}, batch {args.batch_size}, greedy", file=sys.stderr)
    rows = offline.run(engine, prompts, by_label, opts, chat=args.chat, batch_size=args.batch_size,
                       repeats=args.repeats)
    records = offline.summarize(rows)
    extra = offline.roofline(engine.model)
    plain = next(r for r in records if r["method"] == "none" and r["task"] == "all")
    extra["fraction_of_roofline"] = plain["tok_s"] / extra["roofline_tok_s"] if args.batch_size == 1 else None
    extra["memory_per_device"] = offline.memory(engine, prompts, by_label, opts, chat=args.chat,
                                                batch_size=args.batch_size)
    if args.hf:
        extra.update(offline.hf_baseline(args.model, engine, prompts, opts, rows, chat=args.chat))
    print(offline.markdown(records))
    print()
    print(offline.roofline_markdown(extra))
    if args.json_path:
        roof = dict(extra, memory_per_device=dict(extra["memory_per_device"].to_dict(),
                                                  mesh=extra["memory_per_device"].mesh))
        with open(args.json_path, "w") as f:
            json.dump(dict(records=records, roofline=roof), f, indent=1, default=str)
    return 0
