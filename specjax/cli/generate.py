"""`specjax generate`: text from prompts (streamed, or --json records); with `--method auto`, auto
and plain decoding in turns on the same prompts (`specjax.bench.auto_vs_plain`)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys

from specjax.bench.prompts import DEMO, SHIPPED, Prompt, read_prompts
from specjax.cli import flags, specs

def add_parser(sub) -> None:
    g = sub.add_parser("generate", help="generate text (streams, or --json records)")
    flags.add_model(g)
    flags.add_mesh(g)
    flags.add_sampling(g)
    flags.add_methods(g)
    g.add_argument("--prompt")
    g.add_argument("--prompts-file", help="JSON lines (Spec-Bench shape) or plain text lines, or a shipped "
                                          f"set: {', '.join(SHIPPED)}")
    flags.add_prompt_selection(g)
    g.add_argument("--prediction", metavar="FILE",
                   help="predicted output (OpenAI's Predicted Outputs): a file whose text the answer is expected "
                        "to restate, e.g. the file the prompt asks to edit; --method predict (or auto) drafts "
                        "from it, and the output reports the prediction tokens the answer used")
    g.add_argument("--json-schema", metavar="FILE",
                   help="constrain every answer to compact JSON valid under the JSON schema in FILE, inside the "
                        "decoding loop (--method forced, or auto with forced among --auto-methods, drafts the "
                        "text the schema fixes)")
    g.add_argument("--regex", help="constrain every answer to match this regular expression, whole")
    g.add_argument("--batch-size", type=int, default=1)
    g.add_argument("--json", action="store_true", help="one JSON object per prompt, in input order")
    g.add_argument("--demo", action="store_true",
                   help="the shipped demo prompts instead of --prompt: a configuration edit with the file as its "
                        "prediction (where prediction and prompt lookup pay), a configuration request under a JSON "
                        "schema (where forced text pays) and an open question (where auto falls back to plain)")
    g.add_argument("--repeats", type=int, default=None,
                   help="auto: runs of auto and of plain, in turns, behind the speedup's spread (default 3)")
    g.add_argument("--auto-methods", default=None,
                   help=f"auto: comma-separated proposers it may choose from ({','.join(specs.auto_methods())}; "
                        "default: prompt lookup, and the Medusa heads and EAGLE head shipped for the model)")
    g.set_defaults(func=run)


def _check(args: argparse.Namespace):
    """Everything checked before the model loads; returns the generation options."""
    from specjax.serving.engine import GenerateOptions

    opts = GenerateOptions(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                           top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    opts.validate()
    specs.spec_of(args, args.method, strict=True)  # a method without tuning: its spec holds
    specs.check_flags(args)
    if args.batch_size < 1:
        raise ValueError(f"--batch-size={args.batch_size}: must be >= 1")
    if args.method not in ("none", "auto"):
        specs.check_given(args, [args.method], how=specs.NEEDS_FLAG)
    if args.method != "auto" and (args.repeats is not None or args.auto_methods is not None):
        raise ValueError("--repeats and --auto-methods are for --method auto")
    if args.json_schema is not None and args.regex is not None:
        raise ValueError("--json-schema and --regex given together: give one constraint")
    _response_format(args)  # the file is read and parsed before the model loads
    return opts


def _response_format(args: argparse.Namespace) -> dict | None:
    """`--json-schema FILE` as OpenAI's response_format (None without it)."""
    if args.json_schema is None:
        return None
    path = pathlib.Path(args.json_schema)
    if not path.is_file():
        raise ValueError(f"--json-schema {args.json_schema!r}: no such file (give a JSON schema file)")
    try:
        schema = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"--json-schema {args.json_schema!r} is not JSON: {e}") from e
    if not isinstance(schema, dict):
        raise ValueError(f"--json-schema {args.json_schema!r}: a JSON schema is an object")
    return {"type": "json_schema", "json_schema": {"name": path.stem, "schema": schema, "strict": True}}


def run(args: argparse.Namespace) -> int:
    opts = _check(args)
    prompts = _with_flags(args, flags.prompts_of(args, tuple(read_prompts(DEMO))))
    b = min(args.batch_size, len(prompts))
    for i in range(0, len(prompts), b):  # a batch outside auto runs one constraint (a pool of one)
        if len({_constraint_key(p) for p in prompts[i:i + b]}) > 1:
            raise ValueError(f"prompts {', '.join(str(p.id) for p in prompts[i:i + b])} share a batch but not a "
                             "constraint (response_format / regex): give --batch-size 1, or --method auto")
    if args.method == "auto":
        return run_auto(args, opts, prompts)
    engine = specs.engine_for(args, [args.method] if args.method != "none" else [])
    spec = specs.spec_of(args, args.method, strict=True, engine=engine)
    texts = [p.text for p in prompts]
    b = engine.rows_for(b)
    engine.check(texts, opts, chat=args.chat)  # all prompts, before anything compiles
    for i in range(0, len(texts), b):
        constraint = engine.constraint_for(response_format=prompts[i].response_format, regex=prompts[i].regex)
        batch = engine.start(texts[i:i + b], opts, chat=args.chat, batch_size=b, spec=spec, row_offset=i,
                             prediction=[p.prediction for p in prompts[i:i + b]], constraint=constraint)
        if args.json:
            for p, res in zip(prompts[i:i + b], batch.run()):
                print(json.dumps({"id": p.id, "task": p.task, **res.to_dict()}, ensure_ascii=False), flush=True)
        elif batch.n_real == 1:
            _stream(engine, batch)
        else:
            for p, res in zip(prompts[i:i + b], batch.run()):
                print(f"--- {p.id} ---\n{res.text}")
    return 0


def _with_flags(args, prompts: list[Prompt]) -> list[Prompt]:
    """The prompts with `--prediction FILE`'s text as every prompt's prediction, and `--json-schema` /
    `--regex` as every prompt's constraint (each as the prompt gives it otherwise)."""
    if args.prediction is not None:
        path = pathlib.Path(args.prediction)
        if not path.is_file():
            raise ValueError(f"--prediction {args.prediction!r}: no such file (give the file the answer should restate)")
        text = path.read_text(encoding="utf-8")
        prompts = [dataclasses.replace(p, prediction=text) for p in prompts]
    if args.json_schema is not None or args.regex is not None:
        fmt = _response_format(args)  # the file read once
        prompts = [dataclasses.replace(p, response_format=fmt, regex=args.regex) for p in prompts]
    return prompts


def _constraint_key(p: Prompt) -> str:
    return json.dumps([p.response_format, p.regex], sort_keys=True)


def _stream(engine, batch) -> None:
    """One prompt's text as it decodes, then its figures on stderr."""
    dec = engine.tokenizer.decode_stream(skip_special=True)
    for new in batch.stream(chunk=4):
        sys.stdout.write(dec.push(new[0]))
        sys.stdout.flush()
    res = batch.results()[0]
    sys.stdout.write(dec.flush() + "\n")
    sys.stdout.flush()
    used = "" if res.prediction is None else f", prediction tokens {res.prediction[0]} accepted / {res.prediction[1]} rejected"
    print(f"[{res.new_tokens} tokens, {res.tok_per_s:.1f} tok/s, tau {res.tau:.2f}, "
          f"ttft {res.ttft_s * 1e3:.0f} ms, compile {res.compile_s:.1f} s{used}]", file=sys.stderr)


def run_auto(args: argparse.Namespace, opts, prompts: list[Prompt]) -> int:
    """`--method auto`: the prompts through the scheduler with the adaptive controller (prompt lookup
    with the cross-request table, and the heads shipped for the model, or the `--auto-methods`
    given), and with speculation off, in turns (`--repeats` pairs, compile excluded); prints auto's
    speedup per task class with its spread, or that auto decoded plain throughout and claims none."""
    from specjax.bench import auto_vs_plain

    chosen = specs.chosen_auto_methods(args.auto_methods)
    repeats = 3 if args.repeats is None else args.repeats
    if repeats < 1:
        raise ValueError(f"--repeats={repeats}: must be >= 1")
    engine = specs.engine_for(args, specs.auto_assets(args, chosen))
    ccfg = specs.auto_controller(engine, chosen)
    show = len(prompts) == 1 and not args.json
    dec = engine.tokenizer.decode_stream(skip_special=True) if show else None
    seen = [0]

    def stream(tokens: list[int]) -> None:
        sys.stdout.write(dec.push(tokens[seen[0]:]))
        sys.stdout.flush()
        seen[0] = len(tokens)

    runs = auto_vs_plain.run(engine, prompts, opts, ccfg, slots=min(args.batch_size, len(prompts)),
                             repeats=repeats, chat=args.chat, stream=stream if show else None, log=flags.log)
    decode = lambda toks: engine.tokenizer.decode(toks, skip_special=True)
    if args.json:
        for rec in auto_vs_plain.records(runs, decode):
            print(json.dumps(rec, ensure_ascii=False), flush=True)
        return 0
    if show:
        sys.stdout.write(dec.flush() + "\n")
    else:
        for p, a in zip(prompts, runs.auto[0]):
            print(f"--- {p.id} ({p.task}) ---\n{decode(a.tokens)}", flush=True)
    for rep in auto_vs_plain.by_task(runs):
        flags.log(rep.text())
    return 0
