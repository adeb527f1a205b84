"""`specjax serve`: the OpenAI-compatible HTTP server (`specjax.serving.server`) until SIGTERM."""

from __future__ import annotations

import argparse
import sys

from specjax.cli import flags, specs
from specjax.serving.constraints import ConstraintLimits


def add_parser(sub) -> None:
    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server (chat/completions, SSE, /metrics) over "
                                      "the continuous-batching scheduler")
    flags.add_model(sv)
    flags.add_methods(sv)
    sv.set_defaults(method="auto")
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=int, default=8000)
    _add_batch(sv)
    _add_limits(sv)
    sv.add_argument("--served-model-name", default=None, help="the model id clients send (default: --model)")
    sv.add_argument("--auto-max-step-cost", type=float, default=None,
                    help="auto: run only options whose step costs at most this many plain steps at the chunk's "
                         "batch size (bounds inter-token latency; e.g. 1.5 turns speculation off at full batch here)")
    sv.add_argument("--auto-methods", default=None,
                    help=f"--method auto: the proposers the controller may use ({','.join(specs.auto_methods())}; "
                         "default: those the model has assets for); each compiles its programs before /health "
                         "turns 200")
    sv.set_defaults(func=run)


def _add_batch(sv: argparse.ArgumentParser) -> None:
    """The batch the scheduler runs: its slots, cache, chunks and sampling default."""
    sv.add_argument("--slots", type=int, default=8, help="rows of the batch (requests decoded at once)")
    sv.add_argument("--max-tokens", type=int, default=256, help="the most tokens a request may ask for (sizes "
                                                                "the cache)")
    sv.add_argument("--max-prompt-tokens", type=int, default=512, help="longer prompts get 400")
    sv.add_argument("--temperature", type=float, default=0.0,
                    help="requests' default; > 0 compiles the sampled programs (a greedy server refuses "
                         "temperature > 0)")
    sv.add_argument("--chunk", type=int, default=8, help="decode steps between slot refills")
    sv.add_argument("--batch-sizes", default=None, help="smaller batch sizes a chunk may run at, e.g. 1,2,4")
    sv.add_argument("--constraint-states", type=int, default=ConstraintLimits.states,
                    help="structured answers (response_format, regex, choice): the most automaton states of one "
                         "request's constraint (a pool of one per slot, compiled in; ~4.4 MB a slot at the defaults "
                         "on SmolLM2; a 15-key config schema needs ~270, json_object ~1500); 0: no pool, "
                         "constrained requests get 400")
    sv.add_argument("--constraint-classes", type=int, default=ConstraintLimits.classes,
                    help="the most token classes of one request's constraint (~210 for a 15-key config schema "
                         "on SmolLM2); 0: no pool")
    sv.add_argument("--logit-bias", type=int, default=300,
                    help="the most logit_bias entries a request may bring (each row carries that many, added "
                         "to the target's logits at every position); 0: none, logit_bias gets 400")
    sv.add_argument("--logprobs", type=_top_or_off, default=20, metavar="N|off",
                    help="the most alternatives per token a request may ask for with logprobs (0..20; every "
                         "row records its tokens' log-probabilities, ~1%% of a step); off: none, logprobs get 400")


def _top_or_off(value: str) -> int | None:
    from specjax.core.logprobs import check_top

    if value == "off":
        return None
    try:
        return check_top(int(value))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{value!r}: give an integer in [0, 20], or off ({e})") from None


def _add_limits(sv: argparse.ArgumentParser) -> None:
    """The server's limits, keys and tenants."""
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


def _check(args: argparse.Namespace) -> tuple[tuple[str, ...] | None, tuple[int, ...] | None]:
    """Everything checked before the model loads; returns the auto methods chosen (None: all) and
    the batch sizes (None: the slots alone)."""
    from specjax.bench.load import int_list
    from specjax.methods import registry

    for name in ("slots", "max_tokens", "max_prompt_tokens", "chunk"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)}: must be >= 1")
    for name in ("constraint_states", "constraint_classes", "logit_bias"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)}: must be >= 0 (0: none)")
    sizes = int_list(args.batch_sizes, "batch-sizes") if args.batch_sizes else None
    specs.spec_of(args, args.method, strict=True)
    specs.check_flags(args)
    if args.method not in ("none", "auto"):
        specs.check_given(args, [args.method], how=specs.NEEDS_FLAG)
    chosen = specs.chosen_auto_methods(args.auto_methods) if args.method == "auto" else None
    lookups = [m for m in specs.auto_methods() if registry.looks_up(m)]
    if chosen is not None and not set(chosen) & set(lookups):
        raise ValueError(f"--auto-methods must include {' or '.join(lookups)} (auto's cheapest option)")
    return chosen, sizes


def _keys(args: argparse.Namespace) -> tuple[str, ...]:
    from specjax.serving import server as srv

    keys = list(args.api_key or [])
    for path in args.api_key_file or []:
        keys += srv.read_key_file(path)
    if args.api_key_file and not keys:
        raise ValueError(f"--api-key-file {' '.join(args.api_key_file)}: no key in it (one key a line)")
    return tuple(keys)


def _scheduler(args: argparse.Namespace, engine, chosen, sizes):
    """The scheduler the server runs: auto's controller over the loaded assets, or the method's spec."""
    from specjax.serving import server as srv

    ccfg, spec = None, None
    if args.method == "auto":
        ccfg = specs.auto_controller(engine, chosen, max_step_cost=args.auto_max_step_cost)
    elif args.method != "none":
        spec = specs.spec_of(args, args.method, strict=True, engine=engine)
    return srv.scheduler_for(engine, method=args.method, spec=spec, slots=args.slots, max_tokens=args.max_tokens,
                             max_prompt_tokens=args.max_prompt_tokens, temperature=args.temperature,
                             chunk=args.chunk, batch_sizes=sizes, controller=ccfg,
                             constraint_pool=constraint_pool(args), logit_bias=args.logit_bias,
                             logprobs=args.logprobs)


def constraint_pool(args: argparse.Namespace) -> ConstraintLimits | None:
    """The server's constraint pool from --constraint-states / --constraint-classes (either 0: none)."""
    if not (args.constraint_states and args.constraint_classes):
        return None
    return ConstraintLimits(states=args.constraint_states, classes=args.constraint_classes)


def run(args: argparse.Namespace) -> int:
    from specjax.serving import server as srv
    from specjax.serving.server.metrics import memory_added, memory_now

    chosen, sizes = _check(args)
    keys = _keys(args)
    marks = [memory_now()]  # before the model, after it, after the assets
    methods = specs.auto_assets(args, chosen) if args.method == "auto" else [args.method] if args.method != "none" else []
    engine = specs.engine_for(args, methods, loaded=lambda: marks.append(memory_now()))
    m0, m1, m2 = *marks, memory_now()
    sched = _scheduler(args, engine, chosen, sizes)
    config = srv.ServeConfig(model_name=args.served_model_name or args.model, max_queue=args.max_queue,
                             request_timeout=args.request_timeout, share_ngram_table=args.share_ngram_table,
                             api_keys=keys, max_body_bytes=(srv.MAX_BODY_BYTES if args.max_body_bytes is None
                                                            else args.max_body_bytes),
                             metrics_tenants=args.metrics_tenants)
    server = srv.Server(sched, config, startup_memory={"weights": memory_added(m0, m1),
                                                       "draft_weights": memory_added(m1, m2)})
    print(f"specjax serve: {config.model_name} ({', '.join(o.label for o in sched.options)}), "
          f"{args.slots} slots, on http://{args.host}:{args.port}/v1 (GET /health is 200 once compiled; "
          f"{f'{len(keys)} API keys' if keys else 'no API keys: open to anyone who can reach the port'})",
          file=sys.stderr, flush=True)
    return srv.run(server, host=args.host, port=args.port, drain_timeout=args.drain_timeout)
