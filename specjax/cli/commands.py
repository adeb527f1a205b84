"""`specjax` command line: generate, bench (offline), loadbench (under load), train-heads, tune-heads."""

from __future__ import annotations

import argparse
import json
import sys

from specjax.bench.prompts import Prompt, read_prompts
from specjax.methods import registry
from specjax.methods.registry import RECORDS


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m",
                   help="registry name (smollm2-135m, qwen2.5-coder-0.5b, qwen2.5-coder-1.5b), "
                        ".gguf file or HF directory")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="compute dtype (float32 is the fast one on CPU)")


def _add_mesh_args(p: argparse.ArgumentParser) -> None:
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


def _quiet_unless_process_0() -> None:
    import os

    import jax

    if jax.process_index() != 0:  # every process runs the same program; one of them talks
        sys.stdout = open(os.devnull, "w")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    p.add_argument("--seed", type=int, default=0)


def _add_bench_args(p: argparse.ArgumentParser) -> None:
    """What both benches share: the prompts, the budget, the chat template, the JSON output."""
    p.add_argument("--prompts-file", default=None,
                   help="JSON lines with task and turns (default: a synthetic ~100-token prompt)")
    p.add_argument("--per-task", type=int, default=None, help="first N prompts of each task class")
    p.add_argument("--tasks", default=None, help="comma-separated task classes to keep")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--chat", action="store_true", help="apply the model's chat template")
    p.add_argument("--json", dest="json_path", default=None, help="write the records to this path")


def _add_spec_args(p: argparse.ArgumentParser, *, many: bool = False, default: str = "none") -> None:
    if many:
        p.add_argument("--methods", default=default,
                       help="comma-separated: none,ngram,draft,medusa,eagle,eagle-tree (bench), and auto "
                            "(loadbench); "
                            "none is always measured as the baseline")
    else:
        p.add_argument("--method", default="none", choices=["none", *RECORDS, "auto"],
                       help="speculation method (none = plain decoding; auto = the adaptive controller "
                            "through the scheduler, with the plain loop measured beside it)")
    p.add_argument("--k", type=int, default=None,
                   help="drafted tokens per step (default 4; eagle: the head's tuned chain, or tree depth)")
    p.add_argument("--draft-model", default=None, help="draft model for --method draft")
    p.add_argument("--ngram-min", type=int, default=None, help="ngram: shortest n-gram tried (default 1)")
    p.add_argument("--ngram-max", type=int, default=None, help="ngram: longest n-gram tried (default 3)")
    p.add_argument("--heads", default=None,
                   help="Medusa heads directory for --method medusa (default: the heads shipped "
                        "for the model)")
    p.add_argument("--tree", default=None,
                   help="Medusa candidate tree: a name (chain4, small, medium; heads = the tree "
                        "tuned with the heads) or paths as JSON, "
                        "e.g. '[[0],[1],[0,0]]'; default: a chain of --k heads")
    p.add_argument("--eagle", default=None,
                   help="EAGLE head directory for --method eagle (default: the head shipped for the model)")
    p.add_argument("--nodes", type=int, default=None,
                   help="eagle: nodes of the dynamic tree built each step (--k is its depth; default: "
                        "a chain). Unset values come from the head's tuning (tune-heads --eagle)")
    p.add_argument("--topk", type=int, default=None, help="eagle trees: children per expanded node")
    p.add_argument("--draft-vocab", type=int, default=None,
                   help="eagle: propose from the head's N most frequent tokens (default: as tuned)")


def _spec(args):
    from specjax.methods.config import SpecConfig, parse_tree

    if args.method in ("none", "auto"):
        return SpecConfig()
    if registry.record(args.method).tuned is not None:
        return None  # from the loaded assets' tuning (`tuned_spec`)
    tree = parse_tree(getattr(args, "tree", None))
    return SpecConfig.make(args.method, k=4 if args.k is None else args.k, tree=tree,
                           **_method_options(args, args.method, strict=True))


def _method_options(args, method: str, *, strict: bool = False) -> dict:
    """The flags of `method`'s own options (`Record.option_type`'s fields, `--ngram-min` for
    `ngram_min`) that were given; with `strict`, a given flag of another method's option is refused."""
    import dataclasses as dc

    given = {}
    for rec in RECORDS.values():
        for f in dc.fields(rec.option_type) if rec.option_type is not None else ():
            v = getattr(args, f.name, None)
            if v is None:
                continue
            if rec.name == method:
                given[f.name] = v
            elif strict:
                raise ValueError(f"--{f.name.replace('_', '-')} applies to --method {rec.name} only")
    return given


def tuned_spec(engine, method: str, args, *, tree: bool | None = None):
    """A method with tuned settings (`--method eagle`): the loaded assets' tuned chain (or tree, with
    --nodes), flags overriding."""
    tree = bool(args.nodes) if tree is None else tree
    return engine.tuned(method, tree=tree, k=args.k, nodes=args.nodes if tree else None,
                        topk=args.topk if tree else None, draft_vocab=args.draft_vocab)


def _given(args, method: str):
    """What the method's asset flag gave (`--heads DIR`, `--draft-model NAME`, ...), or None."""
    flag = registry.record(method).flag
    return None if flag is None else getattr(args, flag.lstrip("-").replace("-", "_"), None)


def _check_given(args, methods, *, how: str) -> None:
    """A method whose asset ships with no model (a draft model) needs its flag: fail before loading."""
    for m in methods:
        rec = registry.record(m)
        if rec.flag is not None and rec.shipped is None and not _given(args, m):
            raise ValueError(how.format(method=m, flag=rec.flag, value=rec.flag_value))


def _load_assets(engine, args, methods) -> None:
    """Loads the assets of `methods` that the Engine does not take itself: the given ones, else those
    shipped for the model ("default")."""
    for m in dict.fromkeys(methods):
        rec = registry.record(m)
        if rec.load is not None:
            rec.load(engine, _given(args, m) or "default")


NEEDS_FLAG = "--method {method} needs {flag} {value}"
INCLUDES_NEEDS_FLAG = "--methods includes {method}: give {flag} {value}"


def _prompts(args) -> list[Prompt]:
    if getattr(args, "demo", False):
        if args.prompt is not None or args.prompts_file:
            raise SystemExit("error: --demo runs its own prompts: drop --prompt / --prompts-file, or --demo")
        return list(DEMO_PROMPTS)
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


def _record(p: Prompt, res) -> dict:
    return {"id": p.id, "task": p.task, **res.to_dict()}


def cmd_generate(args) -> int:
    from specjax.serving.engine import Engine, GenerateOptions

    opts = GenerateOptions(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                           top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    opts.validate()  # fail before the model is loaded
    spec = _spec(args)
    for name in ("k", "nodes", "topk", "draft_vocab"):
        v = getattr(args, name, None)
        if v is not None and v < (0 if name == "nodes" else 1):
            raise ValueError(f"--{name.replace('_', '-')}={v}: must be >= {0 if name == 'nodes' else 1}")
    if args.batch_size < 1:
        raise ValueError(f"--batch-size={args.batch_size}: must be >= 1")
    if args.method not in ("none", "auto"):
        _check_given(args, [args.method], how=NEEDS_FLAG)
    if args.method != "auto" and (args.repeats is not None or args.auto_methods is not None):
        raise ValueError("--repeats and --auto-methods are for --method auto")
    prompts = _prompts(args)
    if args.method == "auto":
        return _generate_auto(args, opts, prompts)
    engine = Engine.load(args.model, dtype=args.dtype, draft_model=args.draft_model, mesh=mesh_arg(args))
    if args.method != "none":
        _load_assets(engine, args, [args.method])
    if spec is None:
        spec = tuned_spec(engine, args.method, args)
    texts = [p.text for p in prompts]
    b = engine.rows_for(min(args.batch_size, len(prompts)))
    engine.check(texts, opts, chat=args.chat)  # all prompts, before anything compiles
    for i in range(0, len(texts), b):
        batch = engine.start(texts[i:i + b], opts, chat=args.chat, batch_size=b, spec=spec, row_offset=i)
        if args.json:
            for p, res in zip(prompts[i:i + b], batch.run()):
                print(json.dumps(_record(p, res), ensure_ascii=False), flush=True)
        elif batch.n_real == 1:
            dec = engine.tokenizer.decode_stream(skip_special=True)
            for new in batch.stream(chunk=4):
                sys.stdout.write(dec.push(new[0]))
                sys.stdout.flush()
            res = batch.results()[0]
            sys.stdout.write(dec.flush() + "\n")
            sys.stdout.flush()
            print(f"[{res.new_tokens} tokens, {res.tok_per_s:.1f} tok/s, tau {res.tau:.2f}, "
                  f"ttft {res.ttft_s * 1e3:.0f} ms, compile {res.compile_s:.1f} s]", file=sys.stderr)
        else:
            for p, res in zip(prompts[i:i + b], batch.run()):
                print(f"--- {p.id} ---\n{res.text}")
    return 0


# what auto may choose: prompt lookup, and the methods whose loaded assets give it options
AUTO_METHODS = tuple(m for m, r in RECORDS.items() if registry.looks_up(m) or r.auto is not None)

# `--demo`: what the library is for, in one run. Speculation pays where the answer repeats text it can
# look up (a configuration file names its service, ports and paths again and again) and cannot where
# every sentence is new (an open question): there auto falls back to plain decoding.
DEMO_PROMPTS = (
    Prompt(id="demo-config", task="configuration request",
           text="Write a docker-compose.yml for a service called ledger (image node:20, port 3000) with Redis."),
    Prompt(id="demo-question", task="open question", text="What makes a code review useful?"),
)


def _auto_methods(args) -> tuple[str, ...] | None:
    """`--auto-methods` as a tuple (None: every method the model has assets for)."""
    if args.auto_methods is None:
        return None
    methods = tuple(dict.fromkeys(m.strip() for m in args.auto_methods.split(",") if m.strip()))
    bad = [m for m in methods if m not in AUTO_METHODS]
    if bad or not methods:
        raise ValueError(f"--auto-methods {args.auto_methods!r}: give some of {','.join(AUTO_METHODS)}")
    return methods


def _generate_auto(args, opts, prompts) -> int:
    """`--method auto`: serve the prompts through the scheduler with the adaptive controller (prompt
    lookup with the cross-request table, and the Medusa heads and EAGLE head shipped for the model,
    or the `--auto-methods` given), and the same prompts with speculation off, in turns (`--repeats`
    pairs, compile excluded); print auto's speedup per task class with its spread
    (`specjax.bench.compare`), or that auto decoded plain throughout and claims none.

    Both arms run on a fresh scheduler of the same compiled programs: the plain arm's requests opt
    out of speculation (`Scheduler.submit(opt_out=True)`: plain chunks, and their text never enters
    the n-gram table), so the comparison compiles nothing twice, and each run starts with an empty
    n-gram table (a repetition never looks up an earlier repetition's answer). The cost model is
    calibrated once, in the first run.
    """
    import dataclasses
    import time

    from specjax.bench import compare
    from specjax.bench import load as loadbench
    from specjax.serving.controller import ControllerConfig
    from specjax.serving.engine import Engine
    from specjax.serving.scheduler import Scheduler

    methods = _auto_methods(args)
    repeats = 3 if args.repeats is None else args.repeats
    if repeats < 1:
        raise ValueError(f"--repeats={repeats}: must be >= 1")
    log = lambda m: print(m, file=sys.stderr, flush=True)
    engine = Engine.load(args.model, dtype=args.dtype, mesh=mesh_arg(args))

    def wanted(m: str) -> bool:  # chosen, or (none chosen) the model has assets for it, given or shipped
        rec = registry.record(m)
        return rec.load is not None and (
            m in methods if methods is not None else bool(_given(args, m) or rec.shipped(engine.name)))

    _load_assets(engine, args, [m for m in AUTO_METHODS if wanted(m)])
    ccfg = loadbench.with_assets(engine, ControllerConfig())
    if methods is not None:  # the assets' options are in `extra`; `methods` keeps prompt lookup if chosen
        ccfg = dataclasses.replace(ccfg, methods=tuple(m for m in ccfg.methods if m in methods))
    texts = [p.text for p in prompts]
    longest = max(len(x) for x in engine.check(texts, opts, chat=args.chat))
    slots = min(args.batch_size, len(prompts))
    stream = len(prompts) == 1 and not args.json
    costs = None

    def serve(plain: bool, show: bool):
        s = Scheduler(engine, slots=slots, spec="auto", controller=ccfg, opts=opts, chat=args.chat,
                      max_prompt_tokens=longest, costs=costs)
        for p in prompts:
            s.submit(p.text, task=p.task, opt_out=plain)
        t0, compiles = time.perf_counter(), engine.compile_count
        s.prepare()
        if costs is None:
            log(f"[auto's options {', '.join(o.label for o in s.options)}: {engine.compile_count - compiles} "
                f"programs ready in {s.compile_s:.1f} s (traced, then compiled or read from the compilation "
                f"cache), step costs calibrated in {time.perf_counter() - t0 - s.compile_s:.1f} s]")
        if show:
            dec, seen = engine.tokenizer.decode_stream(skip_special=True), 0
            while s.step():
                toks = s.requests[0].tokens
                sys.stdout.write(dec.push(toks[seen:]))
                sys.stdout.flush()
                seen = len(toks)
            sys.stdout.write(dec.flush() + "\n")
        else:
            s.run()
        return s

    runs: dict[str, list] = {"auto": [], "plain": []}
    for r in range(repeats):
        for arm in ("auto", "plain") if r % 2 == 0 else ("plain", "auto"):  # each pair in turn
            s = serve(arm == "plain", show=stream and arm == "auto" and r == 0)
            costs = s.costs
            runs[arm].append(list(s.requests))
            if r == 0 and arm == "auto":
                if not stream and not args.json:
                    for p, a in zip(prompts, runs["auto"][0]):
                        print(f"--- {p.id} ({p.task}) ---\n"
                              f"{engine.tokenizer.decode(a.tokens, skip_special=True)}", flush=True)
                log(f"[timing auto and plain in turns on the same prompts, {repeats} run"
                    f"{'s' if repeats > 1 else ''} each ...]")
    greedy = opts.sampling.greedy

    def report(label: str, idx: list[int]) -> compare.Report:
        pair = lambda arm, rep: (sum(runs[arm][rep][i].latency_s for i in idx),
                                 sum(len(runs[arm][rep][i].tokens) for i in idx))
        chunks: dict[str, int] = {}
        for rep in runs["auto"]:
            for i in idx:
                for k, n in rep[i].chunks.items():
                    chunks[k] = chunks.get(k, 0) + n
        autos = [rep[i] for rep in runs["auto"] for i in idx]
        tau = sum(len(a.tokens) - 1 for a in autos) / max(1, sum(a.target_forwards for a in autos))
        same = sum(runs["auto"][rep][i].tokens == runs["plain"][rep][i].tokens for rep in range(repeats) for i in idx)
        return compare.report(label, [pair("auto", rep) for rep in range(repeats)],
                              [pair("plain", rep) for rep in range(repeats)], chunks, tau=tau,
                              identical=(same, repeats * len(idx)) if greedy else None)

    if args.json:
        for i, p in enumerate(prompts):
            a = runs["auto"][0][i]
            rep = report(str(p.task), [i])
            print(json.dumps(dict(id=p.id, task=p.task, text=engine.tokenizer.decode(a.tokens, skip_special=True),
                                  tokens=a.tokens, tau=a.tau, chunks=a.chunks, comparison=rep.to_dict(),
                                  identical_to_plain=all(runs["auto"][r][i].tokens == runs["plain"][r][i].tokens
                                                         for r in range(repeats)) if greedy else None,
                                  **a.counters.to_dict()), ensure_ascii=False), flush=True)
        return 0
    for task in dict.fromkeys(str(p.task) for p in prompts):
        idx = [i for i, p in enumerate(prompts) if str(p.task) == task]
        print(report("" if task == "None" else task, idx).text(), file=sys.stderr, flush=True)
    return 0


def _bench_spec(label: str, args, engine=None):
    """The `SpecConfig` of a bench method label; a method with tuned settings (eagle, and eagle-tree
    for its tree) runs the loaded assets' tuning (flags override), so it needs the `engine`."""
    from specjax.methods.config import SpecConfig, parse_tree

    method = registry.base(label)
    rec = registry.RECORDS.get(method)  # None: the plain loop
    if rec is not None and rec.tuned is not None:
        return None if engine is None else tuned_spec(engine, method, args, tree=label != method)
    return SpecConfig.make(method, k=4 if args.k is None else args.k, **_method_options(args, method),
                           tree=parse_tree(args.tree) if rec is not None and "tree" in rec.options else None)


def cmd_bench(args) -> int:
    """`specjax bench` (`specjax.bench.offline`): validates everything, loads the model, runs, prints and writes."""
    from specjax.bench import offline

    if getattr(args, "verify_profile", False):
        from specjax.bench import verify_profile

        verify_profile.main([args.model], repeats=max(args.repeats or 1, 15), json_path=args.json_path)
        return 0
    from specjax.serving.engine import Engine, GenerateOptions
    from specjax.bench.prompts import bench_prompts, check_output_paths

    methods = tuple(dict.fromkeys(["none"] + [m.strip() for m in args.methods.split(",") if m.strip()]))
    bad = [m for m in methods if m not in offline.OFFLINE_METHODS]
    if bad:
        hint = " (auto is a scheduler policy: see `specjax loadbench`)" if "auto" in bad else ""
        raise ValueError(f"unknown method {bad[0]!r}: use one of {', '.join(offline.OFFLINE_METHODS)}{hint}")
    opts = GenerateOptions(max_new_tokens=args.max_new_tokens, stop_ids=None if args.chat else ())
    opts.validate()
    check_output_paths(args.json_path)
    repeats = 1 if args.repeats is None else args.repeats
    if repeats < 1 or args.batch_size < 1:
        raise ValueError(f"--repeats={repeats}, --batch-size={args.batch_size}: must be >= 1")
    used = [registry.base(m) for m in methods if m != "none"]  # the methods behind the labels
    _check_given(args, used, how=INCLUDES_NEEDS_FLAG)
    specs = {m: _bench_spec(m, args) for m in methods}
    prompts = bench_prompts(args.prompts_file, per_task=args.per_task, tasks=args.tasks,
                            default=offline.SYNTHETIC_PROMPT)
    engine = Engine.load(args.model, dtype=args.dtype, draft_model=args.draft_model, mesh=mesh_arg(args))
    _load_assets(engine, args, used)
    specs = {m: spec or _bench_spec(m, args, engine) for m, spec in specs.items()}
    engine.check([p.text for p in prompts], opts, chat=args.chat)
    for spec in specs.values():
        engine.proposer(spec)
    print(f"model {engine.config.name}, {len(prompts)} prompts, {args.max_new_tokens} new tokens, "
          f"methods {', '.join(methods)}, batch {args.batch_size}, greedy", file=sys.stderr)
    rows = offline.run(engine, prompts, specs, opts, chat=args.chat, batch_size=args.batch_size, repeats=repeats)
    records = offline.summarize(rows)
    extra = offline.roofline(engine.model)
    plain = next(r for r in records if r["method"] == "none" and r["task"] == "all")
    extra["fraction_of_roofline"] = plain["tok_s"] / extra["roofline_tok_s"] if args.batch_size == 1 else None
    extra["memory_per_device"] = offline.memory(engine, prompts, specs, opts, chat=args.chat,
                                              batch_size=args.batch_size)
    if args.hf:
        extra.update(offline.hf_baseline(args.model, engine, prompts, opts, rows, chat=args.chat))
    print(offline.markdown(records))
    print()
    print(offline.roofline_markdown(extra))
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(dict(records=records, roofline=extra), f, indent=1, default=str)
    return 0


def cmd_loadbench(args) -> int:
    """`specjax loadbench` (`specjax.bench.load`, or `specjax.bench.http` with --url): validates
    everything, loads the model, runs, prints and writes."""
    if getattr(args, "url", None):  # a running server, over HTTP
        from specjax.bench import http as loadbench_http

        return loadbench_http.main(args)
    import dataclasses
    import pathlib

    from specjax.bench import load as loadbench
    from specjax.bench import surge
    from specjax.bench.offline import SYNTHETIC_PROMPT
    from specjax.methods.config import SpecConfig, parse_tree
    from specjax.serving.controller import ControllerConfig
    from specjax.serving.engine import Engine, GenerateOptions
    from specjax.bench.prompts import bench_prompts, check_output_paths

    methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    auto_ks = loadbench.int_list(args.auto_k, "auto-k")
    phases = surge.parse_phases(args.surge) if args.surge else None
    conc = loadbench.int_list(args.concurrency, "concurrency") if args.concurrency else (
        (16,) if phases else loadbench.DEFAULT_CONCURRENCY)
    sizes = loadbench.int_list(args.batch_sizes, "batch-sizes") if args.batch_sizes else (
        tuple(x for x in (1, 2, 4, 8, 16, 32, 64) if x < conc[0]) if phases else None)
    plan = loadbench.LoadPlan(methods=methods, rate=args.rate, chunk=args.chunk, repeats=args.repeats or 1,
                              concurrency=conc, surge=phases, batch_sizes=sizes,
                              auto=ControllerConfig(ks=(0,) + auto_ks, max_step_cost=args.auto_max_step_cost))
    opts = GenerateOptions(max_new_tokens=args.max_new_tokens, stop_ids=None if args.chat else ())
    opts.validate()
    check_output_paths(args.json_path, args.telemetry, args.runs_json)
    if args.plots:
        check_output_paths(str(pathlib.Path(args.plots) / "plot.png"))
    used = [m for m in plan.methods if m not in ("none", "auto")]
    _check_given(args, used, how=INCLUDES_NEEDS_FLAG)
    k, tree = 4 if args.k is None else args.k, parse_tree(args.tree)
    specs = {m: SpecConfig.make(m, k=k, **_method_options(args, m),
                                tree=tree if "tree" in registry.record(m).options else None)
             for m in used if registry.record(m).tuned is None}
    prompts = bench_prompts(args.prompts_file, per_task=args.per_task, tasks=args.tasks, default=SYNTHETIC_PROMPT)
    engine = Engine.load(args.model, dtype=args.dtype, draft_model=args.draft_model, mesh=mesh_arg(args))
    # a method's assets when it runs or its flag is given; auto also takes the shipped assets that
    # carry their own tuning (an EAGLE head's chain and tree), not those whose options it derives
    _load_assets(engine, args, [m for m in RECORDS if m in used or _given(args, m) or (
        "auto" in plan.methods and RECORDS[m].tuned is not None and RECORDS[m].shipped(engine.name))])
    specs.update({m: engine.tuned(m) for m in used if registry.record(m).tuned is not None})
    auto = loadbench.with_assets(engine, plan.auto, specs)
    plan = dataclasses.replace(plan, auto=auto)
    if not args.file_order:
        prompts = loadbench.interleave(prompts)
    print(f"model {engine.config.name}, {len(prompts)} prompts, {args.max_new_tokens} new tokens, "
          f"methods {', '.join(plan.methods)}, concurrency {plan.concurrency}, "
          f"{'Poisson %.2f req/s' % plan.rate if plan.rate else 'closed loop'}", file=sys.stderr)
    print(f"auto chooses among {', '.join(o.label for o in plan.auto.options)}", file=sys.stderr)
    req_rows, run_rows = loadbench.run(engine, prompts, plan, opts, chat=args.chat, specs=specs)
    records = loadbench.summarize(req_rows, run_rows)
    print(loadbench.markdown(records))
    if phases:
        records = dict(by_task=records, by_phase=surge.summarize(req_rows, run_rows, phases))
        print("\n" + surge.markdown(records["by_phase"]))
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(records, f, indent=1)
    if args.telemetry:
        from specjax import telemetry

        telemetry.write_jsonl(args.telemetry, loadbench.telemetry_rows(req_rows))
    if args.runs_json:
        with open(args.runs_json, "w") as f:
            json.dump(run_rows, f, indent=1)
    if args.plots:
        paths = loadbench.plot(records["by_task"] if phases else records, args.plots)
        if phases:
            paths.append(surge.plot(req_rows, run_rows, phases, args.plots))
        print("plots: " + ", ".join(paths), file=sys.stderr)
    return 0




def cmd_serve(args) -> int:
    """`specjax serve`: the OpenAI-compatible HTTP server (`specjax.serving.server`) until SIGTERM."""
    from specjax.bench import load as loadbench
    from specjax.serving import server as srv
    from specjax.serving.controller import ControllerConfig
    from specjax.serving.engine import Engine
    from specjax.serving.server.metrics import memory_added, memory_now

    for name in ("slots", "max_tokens", "max_prompt_tokens", "chunk"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)}: must be >= 1")
    if args.method not in ("none", "auto"):
        _check_given(args, [args.method], how=NEEDS_FLAG)
    m0 = memory_now()
    engine = Engine.load(args.model, dtype=args.dtype,
                         **({"draft_model": args.draft_model} if args.draft_model else {}))
    m1 = memory_now()
    auto_methods = {m.strip() for m in args.auto_methods.split(",") if m.strip()} if args.method == "auto" else set()
    if auto_methods - set(AUTO_METHODS):
        raise ValueError(f"--auto-methods {args.auto_methods!r}: give some of {','.join(AUTO_METHODS)}")
    # the method's assets; for auto, those of the methods it may use that are given or shipped
    _load_assets(engine, args, [m for m in RECORDS if RECORDS[m].load is not None and (
        args.method == m or m in auto_methods and (_given(args, m) or RECORDS[m].shipped(engine.name)))])
    m2 = memory_now()
    ccfg, spec = None, None
    if args.method == "auto":
        lookups = [m for m in AUTO_METHODS if registry.looks_up(m)]
        if not auto_methods & set(lookups):
            raise ValueError(f"--auto-methods must include {' or '.join(lookups)} (auto's cheapest option)")
        ccfg = loadbench.with_assets(engine, ControllerConfig(max_step_cost=args.auto_max_step_cost))
    elif args.method != "none":
        spec = tuned_spec(engine, args.method, args) if registry.record(args.method).tuned is not None else _spec(args)
    sizes = None
    if args.batch_sizes:
        sizes = tuple(int(x) for x in args.batch_sizes.split(",") if x.strip())
    sched = srv.scheduler_for(engine, method=args.method, spec=spec, slots=args.slots, max_tokens=args.max_tokens,
                              max_prompt_tokens=args.max_prompt_tokens, temperature=args.temperature,
                              chunk=args.chunk, batch_sizes=sizes, controller=ccfg)
    keys = list(args.api_key or [])
    for path in args.api_key_file or []:
        keys += srv.read_key_file(path)
    if args.api_key_file and not keys:
        raise ValueError(f"--api-key-file {' '.join(args.api_key_file)}: no key in it (one key a line)")
    config = srv.ServeConfig(model_name=args.served_model_name or args.model, max_queue=args.max_queue,
                             request_timeout=args.request_timeout, share_ngram_table=args.share_ngram_table,
                             api_keys=tuple(keys), max_body_bytes=(srv.MAX_BODY_BYTES if args.max_body_bytes is None
                                                                   else args.max_body_bytes),
                             metrics_tenants=args.metrics_tenants)
    server = srv.Server(sched, config, startup_memory={"weights": memory_added(m0, m1),
                                                       "draft_weights": memory_added(m1, m2)})
    print(f"specjax serve: {config.model_name} ({', '.join(o.label for o in sched.options)}), "
          f"{args.slots} slots, on http://{args.host}:{args.port}/v1 (GET /health is 200 once compiled; "
          f"{f'{len(keys)} API keys' if keys else 'no API keys: open to anyone who can reach the port'})",
          file=sys.stderr, flush=True)
    return srv.run(server, host=args.host, port=args.port, drain_timeout=args.drain_timeout)


def cmd_tune_eagle(args) -> int:
    import pathlib

    from specjax.train_heads import tune_eagle

    if not (pathlib.Path(args.eagle) / "manifest.json").is_file():
        raise ValueError(f"--eagle {args.eagle}: no manifest.json there; give a train-heads --kind eagle directory")
    if args.prompts < 1 or args.max_new_tokens < 2:
        raise ValueError("--prompts must be >= 1 and --max-new-tokens >= 2")
    tune_eagle.tune(args.eagle, args.model, prompts=args.prompts, max_new_tokens=args.max_new_tokens,
                    log=lambda m: print(m, file=sys.stderr, flush=True))
    return 0


def cmd_tune_heads(args) -> int:
    import pathlib

    from specjax.train_heads import tune

    if not (pathlib.Path(args.heads) / "manifest.json").is_file():
        raise ValueError(f"--heads {args.heads}: no manifest.json there; give a train-heads output directory")
    if args.vocab_size < 1 or not 1 <= args.max_nodes <= 64:
        raise ValueError("--vocab-size must be >= 1 and --max-nodes in [1, 64]")
    tune.tune(args.heads, args.model, vocab_size=args.vocab_size, max_nodes=args.max_nodes)
    return 0


MEDUSA_DEFAULTS = dict(steps=1000, batch_size=256, lr=1e-3, warmup=50, eval_every=200, save_every=100,
                       conversations=1024)
EAGLE_DEFAULTS = dict(steps=400, batch_size=4, lr=1e-3, warmup=20, eval_every=100, save_every=25,
                      conversations=None)


def cmd_train_eagle(args) -> int:
    """Trains an EAGLE head teacher-forced on ShareGPT (`specjax.train_heads.eagle.train_eagle`)."""
    import pathlib

    from specjax.models.eagle import EagleConfig
    from specjax.train_heads.eagle import EagleTrainConfig, train_eagle

    # Everything is checked before the model loads.
    weights = tuple(float(x) for x in args.step_weights.split(",")) if args.step_weights else None
    cfg = EagleTrainConfig(steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
                           warmup=args.warmup, weight_decay=args.weight_decay, unroll=args.unroll,
                           step_weights=weights, b2=args.b2, feature_weight=args.feature_weight,
                           eval_every=args.eval_every, save_every=args.save_every, keep=args.keep, seed=args.seed)
    layers = tuple(int(x) for x in args.feature_layers.split(",")) if args.feature_layers else ()
    eagle = dict(features=args.features, feature_layers=layers, draft_vocab=args.draft_vocab,
                 input_norm=args.input_norm, rest_class=args.rest_class)
    if args.cache is not None and not (pathlib.Path(args.cache) / "index.json").is_file():
        raise ValueError(f"--cache {args.cache}: no feature cache there (index.json missing); build one with "
                         "`specjax train-heads extract --out DIR`")
    if args.vocab == "target" and args.cache is None:
        raise ValueError("--vocab target ranks by the target's argmax, which a feature cache holds: pass --cache")
    if args.features == "final" and layers:
        raise ValueError("--feature-layers is for --features fused")
    if args.conversations is not None and args.conversations < 1 or args.eval_conversations < 1:
        raise ValueError("--conversations and --eval-conversations must be >= 1")
    if args.max_minutes is not None and args.max_minutes <= 0:
        raise ValueError(f"--max-minutes={args.max_minutes}: must be > 0")
    out = pathlib.Path(args.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; give a directory")
    if args.draft_vocab < 1:
        raise ValueError(f"--draft-vocab={args.draft_vocab}: must be >= 1")
    if args.features == "final" or layers:  # fused without layers: 2, L/2 and L-3 of the loaded model
        EagleConfig(dim=1, vocab_size=args.draft_vocab, layer=_tiny_shape(), **eagle)  # features, layers
    if args.init is not None and not (pathlib.Path(args.init) / "manifest.json").is_file():
        raise ValueError(f"--init {args.init}: no EAGLE head there (manifest.json missing)")
    train_eagle(args.model, out, eagle=eagle, cfg=cfg, conversations=args.conversations,
                eval_conversations=args.eval_conversations, max_minutes=args.max_minutes,
                data=args.data, init=args.init, cache=args.cache, vocab=args.vocab,
                log=lambda m: print(m, file=sys.stderr, flush=True))
    return 0


def cmd_coverage(args) -> int:
    """`specjax train-heads coverage`: the draft vocabularies' share of the target's greedy tokens."""
    import json
    import pathlib

    import numpy as np

    from specjax.serving.engine import Engine
    from specjax.bench.prompts import read_prompts
    from specjax.train_heads import cache as feature_cache, coverage
    from specjax.train_heads.eagle import draft_vocabulary

    if args.prompts_file is None or args.cache is None:
        raise ValueError("coverage needs --prompts-file (with task classes) and --cache (to rank from)")
    if args.per_task < 1:
        raise ValueError(f"--per-task={args.per_task}: must be >= 1")
    fc = feature_cache.FeatureCache(args.cache, require_complete=False)
    prompts = read_prompts(args.prompts_file, per_task=args.per_task)
    engine = Engine.load(args.model)
    answers = coverage.greedy_answers(engine, prompts, max_new_tokens=args.max_new_tokens)
    sizes = [4096, 8192, 16384]
    ids = range(len(fc))
    tokens = np.concatenate([fc.sequence(i)["tokens"] for i in ids])[None]
    mask = np.concatenate([fc.sequence(i)["mask"] for i in ids])[None]
    rankings = {"target argmax (cache)": feature_cache.target_vocabulary(fc, ids, max(sizes)),
                "data tokens (cache)": draft_vocabulary(tokens, mask, max(sizes), engine.config.vocab_size)}
    if args.eagle:
        from specjax.models import eagle_io
        rankings[f"head {args.eagle}"] = eagle_io.load_head(args.eagle)[1]
    tables = {k: coverage.coverage(answers, v, [s for s in sizes if s <= len(v)] or [len(v)])
              for k, v in rankings.items()}
    text = coverage.format_table(tables, sizes) if all(len(v) >= max(sizes) for v in rankings.values()) \
        else json.dumps(tables, indent=1)
    print(text)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(prompts=str(args.prompts_file), per_task=args.per_task,
                                   max_new_tokens=args.max_new_tokens, answer_tokens={k: int(sum(map(len, v)))
                                   for k, v in answers.items()}, coverage=tables), indent=1))
    return 0


def cmd_extract(args) -> int:
    """`specjax train-heads extract`: the frozen target's features over a corpus into a feature cache."""
    import pathlib

    from specjax.train_heads.eagle import extract_cache

    conversations = 1024 if args.conversations is None else args.conversations
    if conversations < 1 or args.seq_len < 4 or args.shard_size < 1 or args.forward_batch_size < 1:
        raise ValueError("--conversations, --shard-size and --forward-batch-size must be >= 1, --seq-len >= 4")
    if args.max_minutes is not None and args.max_minutes <= 0:
        raise ValueError(f"--max-minutes={args.max_minutes}: must be > 0")
    out = pathlib.Path(args.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; give a directory")
    layers = tuple(int(x) for x in args.feature_layers.split(",")) if args.feature_layers else ()
    if args.features == "final" and layers:
        raise ValueError("--feature-layers is for --features fused")
    extract_cache(args.model, out, data=args.data, conversations=conversations, seq_len=args.seq_len,
                  features=args.features, feature_layers=layers, dtype=args.dtype, shard_size=args.shard_size,
                  batch_size=args.forward_batch_size, max_minutes=args.max_minutes,
                  log=lambda m: print(m, file=sys.stderr, flush=True))
    return 0


def _tiny_shape():
    from specjax.models import config as model_config
    return model_config.preset("tiny")


def cmd_train_heads(args) -> int:
    """Trains Medusa heads on self-distilled ShareGPT data (`specjax.train_heads.train.train_heads`), or
    an EAGLE head with `--kind eagle` (`TRAIN_KINDS`); `extract` builds a feature cache instead."""
    if args.action == "extract":
        return cmd_extract(args)
    if args.action == "coverage":
        return cmd_coverage(args)
    defaults, train = TRAIN_KINDS[args.kind]
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    return train(args)


def cmd_train_medusa(args) -> int:
    """Trains Medusa heads on self-distilled ShareGPT data (`specjax.train_heads.train.train_heads`)."""
    import pathlib

    from specjax.models.heads import HeadsConfig
    from specjax.train_heads.train import TrainConfig, train_heads

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
    out = pathlib.Path(args.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; give a directory")
    train_heads(args.model, out, heads=heads, config=config, conversations=args.conversations,
                eval_conversations=args.eval_conversations, max_new_tokens=args.max_new_tokens,
                max_prompt_tokens=args.max_prompt_tokens, gen_batch_size=args.gen_batch_size,
                log=lambda m: print(m, file=sys.stderr, flush=True), mesh=mesh_arg(args), cache=args.cache)
    return 0


# the heads `train-heads --kind` trains, for the method of that name: defaults and the command
TRAIN_KINDS = {registry.MEDUSA: (MEDUSA_DEFAULTS, cmd_train_medusa), registry.EAGLE: (EAGLE_DEFAULTS, cmd_train_eagle)}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specjax", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text (streams, or --json records)")
    _add_model_args(g)
    _add_mesh_args(g)
    _add_sampling_args(g)
    _add_spec_args(g)
    g.add_argument("--prompt")
    g.add_argument("--prompts-file", help="JSON lines (Spec-Bench shape) or plain text lines")
    g.add_argument("--per-task", type=int, default=None, help="first N prompts of each task class")
    g.add_argument("--tasks", default=None, help="comma-separated task classes to keep")
    g.add_argument("--chat", action="store_true", help="apply the model's chat template")
    g.add_argument("--batch-size", type=int, default=1)
    g.add_argument("--json", action="store_true", help="one JSON object per prompt, in input order")
    g.add_argument("--demo", action="store_true",
                   help="two built-in prompts instead of --prompt: a configuration request (where "
                        "speculation pays) and an open question (where auto falls back to plain)")
    g.add_argument("--repeats", type=int, default=None,
                   help="auto: runs of auto and of plain, in turns, behind the speedup's spread (default 3)")
    g.add_argument("--auto-methods", default=None,
                   help=f"auto: comma-separated proposers it may choose from ({','.join(AUTO_METHODS)}; "
                        "default: prompt lookup, and the Medusa heads and EAGLE head shipped for the model)")
    g.set_defaults(func=cmd_generate)

    b = sub.add_parser("bench", help="offline: the plain loop and each method side by side on the same "
                                     "prompts, per task class, with the roofline")
    _add_model_args(b)
    _add_mesh_args(b)
    _add_spec_args(b, many=True, default="none,ngram")
    _add_bench_args(b)
    b.add_argument("--batch-size", type=int, default=1, help="prompts per compiled batch")
    b.add_argument("--repeats", type=int, default=1, help="runs over all prompts, interleaved")
    b.add_argument("--hf", action="store_true", help="also time HF transformers' plain loop (oracle extra)")
    b.add_argument("--verify-profile", action="store_true",
                   help="instead: what 1/4/5/9/16-row products and forwards cost per matmul, beside the memory "
                        "and compute floors (random weights of --model's shape; see specjax.bench.verify_profile)")
    b.set_defaults(func=cmd_bench)

    lb = sub.add_parser("loadbench", help="load test: methods x concurrency through the continuous-"
                                          "batching scheduler, per task class")
    _add_model_args(lb)
    _add_spec_args(lb, many=True, default="none,ngram,auto")
    _add_bench_args(lb)
    _add_mesh_args(lb)
    lb.add_argument("--concurrency", default=None,
                    help="comma-separated batch slots (concurrent clients), default 1,4,16")
    lb.add_argument("--rate", type=float, default=None,
                    help="Poisson arrivals per second instead of closed-loop clients")
    lb.add_argument("--chunk", type=int, default=8, help="decode steps between slot refills")
    lb.add_argument("--auto-max-step-cost", type=float, default=None,
                    help="auto never runs an option whose step costs more than this many plain steps at "
                         "the chunk's batch size (a bound on inter-token latency)")
    lb.add_argument("--file-order", action="store_true",
                    help="serve the prompts in file order (default: round-robin over task classes)")
    lb.add_argument("--surge", default=None,
                    help="arrival phases RATE:SECONDS, e.g. 0.5:60,8:60,0.5:60 (Poisson within each), "
                         "reported per phase; one --concurrency (default 16)")
    lb.add_argument("--batch-sizes", default=None,
                    help="smaller batch sizes a chunk may run at, e.g. 1,2,4,8 (default with --surge: "
                         "powers of two below the concurrency)")
    lb.add_argument("--auto-k", default="2,4,8", help="speculation lengths the auto controller may pick "
                                                      "(0 = plain is always one)")
    lb.add_argument("--repeats", type=int, default=None, help="default 1")
    lb.add_argument("--telemetry", default=None,
                    help="write vLLM-shaped speculation counters (JSON lines) to this path")
    lb.add_argument("--runs-json", default=None,
                    help="write per-run details (calibrated step costs, chunks per K) to this path")
    lb.add_argument("--plots", default=None, help="directory for matplotlib plots (the plot extra)")
    lb.add_argument("--url", default=None,
                    help="drive a running `specjax serve` at this URL over HTTP instead (e.g. "
                         "http://127.0.0.1:8000): closed-loop --concurrency, --rate or --surge, latency "
                         "from the moment the client sent")
    lb.add_argument("--goodput", default=None,
                    help="with --url: SLOs in ms a request must meet to count as goodput, e.g. "
                         "ttft:2000,tpot:100,e2el:20000 (default ttft:2000,tpot:100)")
    lb.set_defaults(func=cmd_loadbench)

    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server (chat/completions, SSE, /metrics) over "
                                      "the continuous-batching scheduler")
    _add_model_args(sv)
    _add_spec_args(sv)
    sv.set_defaults(method="auto")
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--slots", type=int, default=8, help="rows of the batch (requests decoded at once)")
    sv.add_argument("--max-tokens", type=int, default=256, help="the most tokens a request may ask for (sizes "
                                                                "the cache)")
    sv.add_argument("--max-prompt-tokens", type=int, default=512, help="longer prompts get 400")
    sv.add_argument("--temperature", type=float, default=0.0,
                    help="requests' default; > 0 compiles the sampled programs (a greedy server refuses "
                         "temperature > 0)")
    sv.add_argument("--chunk", type=int, default=8, help="decode steps between slot refills")
    sv.add_argument("--batch-sizes", default=None, help="smaller batch sizes a chunk may run at, e.g. 1,2,4")
    sv.add_argument("--max-queue", type=int, default=64, help="requests waiting beyond the slots; then 429")
    sv.add_argument("--request-timeout", type=float, default=None,
                    help="seconds from arrival; a request past it ends with finish_reason timeout")
    sv.add_argument("--drain-timeout", type=float, default=30.0,
                    help="on SIGTERM, seconds in-flight requests get to finish before they are cancelled")
    sv.add_argument("--share-ngram-table", action="store_true",
                    help="one cross-request n-gram table for every tenant (default: one scope per API key "
                         "or user: a tenant's text is never proposed to another)")
    sv.add_argument("--api-key", action="append", metavar="KEY",
                    help="a key /v1 requests must send as 'Authorization: Bearer KEY' (repeatable; else 401). "
                         "Each key is a tenant. Without keys the server is open and tenant scopes are advisory")
    sv.add_argument("--api-key-file", action="append", metavar="PATH",
                    help="a file of API keys, one a line (# comments); keeps them out of the process list")
    sv.add_argument("--max-body-bytes", type=int, default=None,
                    help="a longer request body gets 413 before it is parsed (default 2 MiB)")
    sv.add_argument("--metrics-tenants", type=int, default=16,
                    help="tenants with their own series in /metrics (the first to finish a request); "
                         "the rest are counted under 'other'")
    sv.add_argument("--served-model-name", default=None, help="the model id clients send (default: --model)")
    sv.add_argument("--auto-max-step-cost", type=float, default=None,
                    help="auto: run only options whose step costs at most this many plain steps at the chunk's "
                         "batch size (bounds inter-token latency; e.g. 1.5 turns speculation off at full batch here)")
    sv.add_argument("--auto-methods", default=",".join(AUTO_METHODS),
                    help="--method auto: the proposers the controller may use (those the model has assets "
                         "for); each compiles its programs before /health turns 200")
    sv.set_defaults(func=cmd_serve)

    t = sub.add_parser("train-heads", help="train Medusa heads on self-distilled ShareGPT data (`train-heads "
                                           "extract`: build a feature cache to train EAGLE heads from)")
    t.add_argument("action", nargs="?", default="train", choices=["train", "extract", "coverage"],
                   help="train (default); extract: run the target once over the corpus (--data, "
                        "--conversations, --seq-len, --features) and write its features to --out; coverage: "
                        "how much of the target's greedy output on --prompts-file each draft vocabulary "
                        "(ranked from --cache, and --eagle's) holds, per task class, written to --out")
    t.add_argument("--prompts-file", default=None, help="coverage: JSON lines with a task field")
    t.add_argument("--per-task", type=int, default=4, help="coverage: prompts per task class")
    t.add_argument("--eagle", default=None, help="coverage: also an EAGLE head's draft vocabulary")
    t.add_argument("--model", default="smollm2-135m", help="registry name, .gguf file or HF directory")
    t.add_argument("--out", required=True, help="run directory: heads (for --heads), checkpoints, metrics")
    _add_mesh_args(t)
    t.add_argument("--num-heads", type=int, default=4)
    t.add_argument("--num-layers", type=int, default=1, help="residual blocks per head")
    t.add_argument("--own-projection", action="store_true", help="own [D, V] projection per head")
    t.add_argument("--token-input", action="store_true",
                   help="feed the heads the next token's embedding too (EAGLE/Hydra-style input)")
    t.add_argument("--kind", default=registry.MEDUSA, choices=list(TRAIN_KINDS),
                   help="medusa: heads on self-distilled answers; eagle: one-layer feature head, teacher-forced")
    t.add_argument("--steps", type=int, default=None, help="default 1000 (medusa) / 400 (eagle)")
    t.add_argument("--batch-size", type=int, default=None,
                   help="token positions (medusa, default 256) or sequences (eagle, default 4) per step")
    t.add_argument("--lr", type=float, default=None, help="default 1e-3")
    t.add_argument("--warmup", type=int, default=None, help="default 50 (medusa) / 20 (eagle)")
    t.add_argument("--weight-decay", type=float, default=0.0)
    t.add_argument("--head-decay", type=float, default=0.8, help="loss weight w**m of head m")
    t.add_argument("--eval-every", type=int, default=None, help="default 200 (medusa) / 100 (eagle)")
    t.add_argument("--save-every", type=int, default=None, help="default 100 (medusa) / 25 (eagle)")
    t.add_argument("--keep", type=int, default=3, help="training checkpoints kept")
    t.add_argument("--conversations", type=int, default=None,
                   help="ShareGPT prompts to distill (medusa, default 1024) / training conversations "
                        "(eagle, default steps x batch size)")
    t.add_argument("--features", default="final", choices=["final", "fused"],
                   help="eagle: the target's final hidden state (EAGLE-1) or fused low/mid/high layers (EAGLE-3)")
    t.add_argument("--feature-layers", default=None, help="eagle --features fused: target layers whose input the head reads, e.g. 2,15,27 "
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
    t.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="extract: feature dtype")
    t.add_argument("--shard-size", type=int, default=64, help="extract: sequences per shard (unit of resumption)")
    t.add_argument("--forward-batch-size", type=int, default=4, help="extract: sequences per target forward")
    t.add_argument("--max-minutes", type=float, default=None,
                   help="eagle/extract: stop (checkpointed / between shards) after this long; run again to continue")
    t.add_argument("--eval-conversations", type=int, default=64, help="of those, held out")
    t.add_argument("--max-new-tokens", type=int, default=128, help="response length (greedy)")
    t.add_argument("--max-prompt-tokens", type=int, default=256, help="longer prompts are skipped")
    t.add_argument("--gen-batch-size", type=int, default=16)
    t.add_argument("--seed", type=int, default=0)
    t.set_defaults(func=cmd_train_heads)

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
    u.set_defaults(func=lambda a: cmd_tune_eagle(a) if a.eagle else cmd_tune_heads(a))
    return parser


def compile_cache() -> str | None:
    """Turns on JAX's persistent compilation cache in `<specjax cache>/jax-compile` (see
    `specjax.models.catalog.cache_dir`), so a command run again loads its programs instead of
    compiling them. Every program is kept, however small or quick to compile. Left alone when JAX's
    own cache directory is set (JAX_COMPILATION_CACHE_DIR); SPECJAX_COMPILE_CACHE=0 turns it off.
    Returns the directory in use, or None."""
    import os

    import jax

    if jax.config.jax_compilation_cache_dir:
        return jax.config.jax_compilation_cache_dir
    if os.environ.get("SPECJAX_COMPILE_CACHE", "1").strip().lower() in ("0", "off", "false", "no"):
        return None
    from specjax.models import catalog

    path = str(catalog.cache_dir() / "jax-compile")
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    return path


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if getattr(args, "distributed", False):
            import jax

            jax.distributed.initialize()  # before any other JAX call
            _quiet_unless_process_0()
        compile_cache()
        return args.func(args)
    except ValueError as e:  # our validation errors: one line, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
