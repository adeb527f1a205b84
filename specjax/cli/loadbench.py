"""`specjax loadbench`: methods x concurrency through the continuous-batching scheduler, per task
class (`specjax.bench.load`; `--surge`: phases of arrival rates, `specjax.bench.surge`), or a running
server over HTTP (`--url`, `specjax.bench.http`)."""

from __future__ import annotations

import argparse
import json
import sys

from specjax.cli import flags, specs


def add_parser(sub) -> None:
    lb = sub.add_parser("loadbench", help="load test: methods x concurrency through the continuous-"
                                          "batching scheduler, per task class")
    flags.add_model(lb)
    flags.add_methods(lb, many=True, default="none,ngram,auto")
    flags.add_bench(lb)
    flags.add_mesh(lb)
    _add_load(lb)
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
    lb.set_defaults(func=run)


def _add_load(lb: argparse.ArgumentParser) -> None:
    """The load: concurrency, arrivals, chunks, batch sizes, auto's settings."""
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


def _plan(args: argparse.Namespace):
    """The `LoadPlan` of the flags (validated) and the surge's phases (or None)."""
    from specjax.bench import load, surge
    from specjax.serving.controller import ControllerConfig

    phases = surge.parse_phases(args.surge) if args.surge else None
    conc = load.int_list(args.concurrency, "concurrency") if args.concurrency else (
        (16,) if phases else load.DEFAULT_CONCURRENCY)
    sizes = load.int_list(args.batch_sizes, "batch-sizes") if args.batch_sizes else (
        tuple(x for x in (1, 2, 4, 8, 16, 32, 64) if x < conc[0]) if phases else None)
    auto = ControllerConfig(ks=(0,) + load.int_list(args.auto_k, "auto-k"), max_step_cost=args.auto_max_step_cost)
    plan = load.LoadPlan(methods=flags.names(args.methods), rate=args.rate, chunk=args.chunk,
                         repeats=args.repeats or 1, concurrency=conc, surge=phases, batch_sizes=sizes, auto=auto)
    return plan, phases


def _check(args: argparse.Namespace):
    """Everything checked before the model loads: (plan, phases, options, specs without tuning)."""
    import pathlib

    from specjax.bench.prompts import check_output_paths
    from specjax.methods import registry
    from specjax.serving.engine import GenerateOptions

    plan, phases = _plan(args)
    opts = GenerateOptions(max_new_tokens=args.max_new_tokens, stop_ids=None if args.chat else ())
    opts.validate()
    check_output_paths(args.json_path, args.telemetry, args.runs_json)
    if args.plots:
        check_output_paths(str(pathlib.Path(args.plots) / "plot.png"))
    used = [m for m in plan.methods if m not in ("none", "auto")]
    specs.check_given(args, used, how=specs.INCLUDES_NEEDS_FLAG)
    specs.check_flags(args)
    given = {m: specs.spec_of(args, m) for m in used if registry.record(m).tuned is None}
    return plan, phases, opts, given


def _assets(args, engine, plan) -> list[str]:
    """The methods whose assets load: those that run or whose flag is given; auto also takes the
    shipped assets that carry their own tuning (an EAGLE head's chain and tree), not those whose
    options it derives (Medusa heads' chains)."""
    from specjax.methods.registry import RECORDS

    def shipped_tuned(m: str) -> bool:
        rec = RECORDS[m]
        return rec.tuned is not None and rec.shipped is not None and bool(rec.shipped(engine.name))

    return [m for m in RECORDS
            if m in plan.methods or specs.given(args, m) or ("auto" in plan.methods and shipped_tuned(m))]


def run(args: argparse.Namespace) -> int:
    """Validates everything, loads the model, runs, prints and writes."""
    import dataclasses

    if args.url:  # a running server, over HTTP
        from specjax.bench import http

        return http.main(args)
    from specjax.bench import load
    from specjax.bench.offline import SYNTHETIC_PROMPT
    from specjax.bench.prompts import bench_prompts
    from specjax.methods import registry

    plan, phases, opts, given = _check(args)
    prompts = bench_prompts(args.prompts_file, per_task=args.per_task, tasks=args.tasks, default=SYNTHETIC_PROMPT)
    engine = specs.engine_for(args, lambda engine: _assets(args, engine, plan))
    used = [m for m in plan.methods if m not in ("none", "auto")]
    # a method with tuned settings takes them from the loaded assets, its flags (--k, --tree) overriding
    given.update({m: specs.spec_of(args, m, engine=engine) for m in used if registry.record(m).tuned is not None})
    plan = dataclasses.replace(plan, auto=plan.auto.with_assets(engine.assets, given))
    if not args.file_order:
        prompts = load.interleave(prompts)
    print(f"model {engine.config.name}, {len(prompts)} prompts, {args.max_new_tokens} new tokens, "
          f"methods {', '.join(plan.methods)}, concurrency {plan.concurrency}, "
          f"{'Poisson %.2f req/s' % plan.rate if plan.rate else 'closed loop'}", file=sys.stderr)
    print(f"auto chooses among {', '.join(o.label for o in plan.auto.options)}", file=sys.stderr)
    req_rows, run_rows = load.run(engine, prompts, plan, opts, chat=args.chat, specs=given)
    _write(args, load.summarize(req_rows, run_rows), req_rows, run_rows, phases)
    return 0


def _write(args, records: list[dict], req_rows: list[dict], run_rows: list[dict], phases) -> None:
    """Prints the tables and writes what the output flags ask for."""
    from specjax.bench import load, surge

    print(load.markdown(records))
    out = records
    if phases:
        out = dict(by_task=records, by_phase=surge.summarize(req_rows, run_rows, phases))
        print("\n" + surge.markdown(out["by_phase"]))
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(out, f, indent=1)
    if args.telemetry:
        from specjax import telemetry

        telemetry.write_jsonl(args.telemetry, load.telemetry_rows(req_rows))
    if args.runs_json:
        with open(args.runs_json, "w") as f:
            json.dump(run_rows, f, indent=1)
    if args.plots:
        paths = load.plot(records, args.plots)
        if phases:
            paths.append(surge.plot(req_rows, run_rows, phases, args.plots))
        print("plots: " + ", ".join(paths), file=sys.stderr)
