"""llama.cpp beside specjax on the same GGUF and the same prompts, interleaved in one run.

`python -m specjax.bench.peer` builds llama.cpp natively from the tree vendored in the
`llama-cpp-python` sdist on PyPI (`LLAMA_CPP_SDIST`; pip downloads it, cmake and the machine's C++
compiler build `llama-bench` and `llama-server` with `GGML_NATIVE=ON`; nothing is fetched from
anywhere but the package index), caches the build under `~/.cache/specjax/peer/`, then measures:
- `llama-bench -p 0 -n N`: llama.cpp's plain token generation on an empty context (its headline
  figure);
- `llama-server` plain and with n-gram speculation (`--spec-type ngram-simple`, K drafts), and
  specjax plain and with prompt lookup (K drafts) and `auto`, on the same prompts given as the same
  token ids (specjax's tokenizer and chat template), greedy, EOS stopping on, one request at a time.
  Each repeat runs every arm on every prompt, prompt by prompt, so drift on a busy machine spreads
  over all arms.

It prints a table of tok/s side by side (a request's new tokens over its wall time, the prompt's
processing included, summed over the prompts; llama-server's own decode-only rate beside it) and,
per prompt, how many leading tokens each arm shares with specjax's plain output: llama.cpp rounds
activations to 8 bits (not HF's arithmetic), so its greedy text drifts from ours after a while.
`--weights-arith exact,q8` adds arms in specjax's q8 arithmetic (llama.cpp's; `weights_arith`).
`--assets eagle,recycle` loads the model's shipped assets, so auto chooses among their options too
(as `specjax loadbench --assets`); `--raw` sends the prompt text as it is (a base model without a
chat template: Gemma 3 270M). Below the table, each arm's tok/s per task class against llama.cpp's
plain on the same class.

Example:
  python -m specjax.bench.peer --model smollm2-135m --prompts-file tasks --per-task 1 \\
      --max-new-tokens 128 --repeats 2
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import pathlib
import shutil
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request

LLAMA_CPP_SDIST = ("llama-cpp-python", "0.3.36")  # its vendor/llama.cpp is ggml-org/llama.cpp@0c1e570
TARGETS = ("llama-bench", "llama-server")


def _cache_root() -> pathlib.Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "specjax" / "peer"


def build(root: pathlib.Path | None = None, *, jobs: int | None = None, amx: bool = True, log=print) -> pathlib.Path:
    """llama.cpp's `bin/` folder, built once per sdist version under `root` (the cache by default),
    for this machine (`GGML_NATIVE`); `amx=False` compiles ggml's AMX products out (`runs_batched`).

    Raises:
      RuntimeError: pip, cmake or the compiler is missing or failed (its output's tail included).
    """
    name, version = LLAMA_CPP_SDIST
    root = pathlib.Path(root or _cache_root()) / f"{name}-{version}"
    build_dir = root / ("build" if amx else "build-noamx")
    bin_dir = build_dir / "bin"
    if all((bin_dir / t).is_file() for t in TARGETS):
        return bin_dir
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise RuntimeError(f"building llama.cpp needs {tool!r} on PATH (e.g. apt-get install cmake g++)")
    root.mkdir(parents=True, exist_ok=True)
    src = root / "src"
    if not (src / "CMakeLists.txt").is_file():
        with tempfile.TemporaryDirectory(dir=root) as tmp:
            log(f"[peer] pip download {name}=={version} (sdist) ...")
            _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", name, "-d", tmp,
                  f"{name}=={version}"])
            archive = next(pathlib.Path(tmp).glob("*.tar.gz"))
            with tarfile.open(archive) as tar:
                tar.extractall(tmp, filter="data")
            vendored = next(pathlib.Path(tmp).glob("*/vendor/llama.cpp"))
            shutil.rmtree(src, ignore_errors=True)
            shutil.move(str(vendored), src)
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    log(f"[peer] building {', '.join(TARGETS)} natively (about 15 minutes on 2 cores) ...")
    no_amx = [] if amx else ["-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16",
                             "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"]
    _run(["cmake", "-S", str(src), "-B", str(build_dir), *generator, "-DCMAKE_BUILD_TYPE=Release",
          "-DGGML_NATIVE=ON", *no_amx, "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
          "-DLLAMA_BUILD_EXAMPLES=OFF"])
    _run(["cmake", "--build", str(build_dir), "--target", *TARGETS, "-j", str(jobs or os.cpu_count() or 2)])
    return bin_dir


def runs_batched(bin_dir: pathlib.Path, gguf: str) -> bool:
    """Whether the build survives a batched product (`llama-bench -p 32 -n 0`). A virtual machine can
    list AMX among the CPU's flags and fault on its tile instructions; `-march=native` then compiles
    ggml's AMX products in, and llama.cpp dies of an illegal instruction at its first prompt."""
    cmd = [str(bin_dir / "llama-bench"), "-m", gguf, "-p", "32", "-n", "0", "-r", "1"]
    return subprocess.run(cmd, capture_output=True, timeout=600).returncode == 0


def _run(cmd: list[str]) -> str:
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed ({res.returncode}):\n{(res.stdout + res.stderr)[-3000:]}")
    return res.stdout


def llama_bench(bin_dir: pathlib.Path, gguf: str, *, threads: int, tokens: int, repeats: int = 3) -> float:
    """llama-bench's token-generation rate (tok/s, mean of `repeats`) on an empty context."""
    out = _run([str(bin_dir / "llama-bench"), "-m", gguf, "-t", str(threads), "-p", "0", "-n", str(tokens),
                "-r", str(repeats), "-o", "json"])
    rows = json.loads(out)
    return float(next(r["avg_ts"] for r in rows if r.get("n_gen") == tokens))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def llama_server(bin_dir: pathlib.Path, gguf: str, *, threads: int, ctx: int, spec_k: int = 0):
    """A `llama-server` on a free loopback port, one slot (plain, or n-gram drafts of `spec_k`); yields
    its base URL and stops it on exit."""
    port = _free_port()
    cmd = [str(bin_dir / "llama-server"), "-m", gguf, "-t", str(threads), "-tb", str(threads), "-c", str(ctx),
           "-np", "1", "--host", "127.0.0.1", "--port", str(port), "--no-webui"]
    if spec_k:
        cmd += ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-m", str(spec_k),
                "--spec-draft-n-max", str(spec_k)]
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"llama-server exited ({proc.returncode}):\n{log.read().decode()[-3000:]}")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            if time.monotonic() > deadline:
                raise RuntimeError("llama-server did not become healthy within 120 s")
            time.sleep(0.25)
        yield url
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)
        if proc.poll() is None:
            proc.kill()
        log.close()


@dataclasses.dataclass
class Run:
    """One request of one arm: the new tokens and the seconds they took."""

    tokens: list[int]
    seconds: float  # wall time of the request, prompt processing included
    decode_tps: float | None = None  # the engine's own decode-only rate, where it reports one


def complete(url: str, ids: list[int], max_new: int, stop_ids: tuple[int, ...]) -> Run:
    """One greedy completion of token ids through llama-server's `/completion`."""
    body = dict(prompt=ids, n_predict=max_new, temperature=0.0, top_k=1, cache_prompt=False,
                return_tokens=True, stream=False, samplers=["top_k"])
    req = urllib.request.Request(url + "/completion", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        out = json.loads(r.read())
    seconds = time.perf_counter() - t0
    tokens = list(out.get("tokens") or [])
    if out.get("stop_type") == "eos" and stop_ids and (not tokens or tokens[-1] not in stop_ids):
        tokens.append(stop_ids[0])  # ours keep the stop token in the output; count it alike
    return Run(tokens, seconds, float(out.get("timings", {}).get("predicted_per_second") or 0) or None)


def _shared_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _specjax(model: str, k: int, arith: str = "exact", assets: tuple[str, ...] = ()):
    """specjax's arms in `arith` (`weights_arith`; " q8" ends their names): plain and prompt lookup
    through `Engine.generate`, one request at a time; `assets`: the shipped assets auto may use."""
    from specjax import Engine, SpecConfig

    engine = Engine.load(model, weights_arith=arith, assets={m: "default" for m in assets})
    stop = tuple(engine.tokenizer.stop_ids)
    tag = "" if arith == "exact" else f" {arith}"

    def arm(spec):
        def go(ids: list[int], max_new: int) -> Run:
            res = engine.generate([ids], max_new_tokens=max_new, spec=spec)[0]
            return Run(res.tokens, res.wall_s, (res.new_tokens - 1) / max(1e-9, res.wall_s - res.ttft_s))
        return go

    return engine, stop, {f"specjax plain{tag}": arm(SpecConfig()),
                          f"specjax ngram k={k}{tag}": arm(SpecConfig(method="ngram", k=k))}


def _auto(engine, prompts, max_new: int, chat: bool = True) -> tuple[list[Run], list[Run]]:
    """Auto and plain through the scheduler (`specjax generate --method auto`'s comparison), one
    request at a time: (auto's runs, plain's runs)."""
    from specjax.bench import auto_vs_plain
    from specjax.serving.controller import ControllerConfig
    from specjax.serving.engine import GenerateOptions

    ccfg = ControllerConfig().with_assets(engine.assets)
    runs = auto_vs_plain.run(engine, prompts, GenerateOptions(max_new_tokens=max_new), ccfg, slots=1, repeats=1,
                             chat=chat)
    as_runs = lambda reqs: [Run(list(r.tokens), r.latency_s) for r in reqs]
    return as_runs(runs.auto[0]), as_runs(runs.plain[0])


def measure(args) -> dict:
    """Every arm on every prompt, `args.repeats` times; returns the records."""
    from specjax.bench.prompts import read_prompts
    from specjax.models import catalog

    gguf = str(catalog.resolve(args.model))
    bin_dir = pathlib.Path(args.llama_bin) if args.llama_bin else build(jobs=args.jobs)
    if not runs_batched(bin_dir, gguf):
        if args.llama_bin:
            raise RuntimeError(f"{bin_dir}/llama-bench dies on a batched product (a CPU flag the machine does "
                               "not honour, e.g. AMX in a virtual machine): leave out --llama-bin to build one "
                               "without AMX")
        print("[peer] this build dies on a batched product (AMX listed but not usable here): building without AMX")
        bin_dir = build(jobs=args.jobs, amx=False)
    prompts = read_prompts(args.prompts_file, per_task=args.per_task)
    ours, engines = {}, {}
    assets = tuple(a for a in (args.assets or "").split(",") if a)
    for arith in args.weights_arith.split(","):
        engines[arith], stop, arms = _specjax(args.model, args.k, arith, assets)
        ours.update(arms)
    engine = next(iter(engines.values()))
    tok = engine.tokenizer
    ids = [tok.encode(p.text) if args.raw else
           tok.encode(tok.apply_chat_template([{"role": "user", "content": p.text}]), add_bos=False) for p in prompts]
    ctx = max(map(len, ids)) + args.max_new_tokens + 64
    runs: dict[str, list[list[Run]]] = {}
    bench: list[float] = []
    with llama_server(bin_dir, gguf, threads=args.threads, ctx=ctx) as plain_url, \
            llama_server(bin_dir, gguf, threads=args.threads, ctx=ctx, spec_k=args.k) as spec_url:
        theirs = {"llama.cpp plain": lambda x, n: complete(plain_url, x, n, stop),
                  f"llama.cpp ngram k={args.k}": lambda x, n: complete(spec_url, x, n, stop)}
        arms = {**theirs, **ours}
        for go in arms.values():  # warm-up: compiles ours, loads theirs
            go(ids[0], 8)
        for rep in range(args.repeats):
            bench.append(llama_bench(bin_dir, gguf, threads=args.threads, tokens=args.max_new_tokens, repeats=1))
            for i, x in enumerate(ids):
                order = list(arms) if (rep + i) % 2 == 0 else list(arms)[::-1]
                for name in order:
                    runs.setdefault(name, [[None] * len(ids) for _ in range(args.repeats)])[rep][i] = \
                        arms[name](x, args.max_new_tokens)
            for arith, eng in ([] if args.no_auto else engines.items()):
                auto, splain = _auto(eng, prompts, args.max_new_tokens, chat=not args.raw)
                tag = "" if arith == "exact" else f" {arith}"
                runs.setdefault(f"specjax auto{tag}", []).append(auto)
                runs.setdefault(f"specjax plain (scheduler){tag}", []).append(splain)
    return dict(prompts=prompts, runs=runs, llama_bench=bench, gguf=gguf)


def report(rec: dict, out=sys.stdout) -> dict:
    """The side-by-side table (median over repeats of each arm's summed tok/s) and where outputs differ."""
    runs, prompts = rec["runs"], rec["prompts"]
    plains = [name for name in runs if name.startswith("specjax plain") and "scheduler" not in name]
    rows = {}
    for name, reps in runs.items():
        # a specjax arm against the plain loop of its own arithmetic (" q8" arms against "specjax plain q8")
        own = next((p for p in plains[::-1] if name.startswith("specjax") and name.endswith(p[len("specjax plain"):])),
                   plains[0])
        base = runs[own][0]
        rates = [sum(len(r.tokens) for r in rep) / sum(r.seconds for r in rep) for rep in reps]
        dec = [r.decode_tps for rep in reps for r in rep if r.decode_tps]
        same = [_shared_prefix(r.tokens, b.tokens) for r, b in zip(reps[0], base)]
        rows[name] = dict(tok_s=statistics.median(rates), decode_tok_s=statistics.median(dec) if dec else None,
                          identical=sum(r.tokens == b.tokens for r, b in zip(reps[0], base)), prompts=len(base),
                          shared_prefix=same)
    ref = rows["llama.cpp plain"]["tok_s"]
    bench = statistics.median(rec["llama_bench"])
    print(f"llama-bench tg (empty context): {bench:.1f} tok/s on {pathlib.Path(rec['gguf']).name}", file=out)
    print(f"{'arm':30s} {'tok/s':>8s} {'x llama.cpp plain':>18s} {'decode tok/s':>13s} {'= its plain':>12s}",
          file=out)
    for name, r in rows.items():
        dec = f"{r['decode_tok_s']:.1f}" if r["decode_tok_s"] else "-"
        print(f"{name:30s} {r['tok_s']:8.1f} {r['tok_s'] / ref:17.2f}x {dec:>13s} {r['identical']:>9d}/{r['prompts']}",
              file=out)
    print("leading tokens shared with its plain loop (llama.cpp's: specjax plain), per prompt:", file=out)
    for name, r in rows.items():
        print(f"  {name:28s} " + " ".join(f"{n:4d}" for n in r["shared_prefix"]), file=out)
    print("  (prompt classes: " + ", ".join(str(p.task) for p in prompts) + ")", file=out)
    classes = _per_class(runs, prompts)
    if len({str(p.task) for p in prompts}) > 1:
        print("tok/s per task class (x llama.cpp plain on that class):", file=out)
        for name, by in classes.items():
            ref_by = classes["llama.cpp plain"]
            print(f"  {name:28s} " + "  ".join(f"{t} {v:.1f} ({v / ref_by[t]:.2f}x)" for t, v in by.items()), file=out)
    return dict(llama_bench=bench, arms={n: dict(r, per_class=classes[n]) for n, r in rows.items()})


def _per_class(runs: dict, prompts) -> dict[str, dict[str, float]]:
    """Each arm's tok/s per task class: the median over repeats of the class's new tokens over its
    requests' summed seconds."""
    tasks = list(dict.fromkeys(str(p.task) for p in prompts))
    out = {}
    for name, reps in runs.items():
        out[name] = {t: statistics.median(
            sum(len(r.tokens) for r, p in zip(rep, prompts) if str(p.task) == t)
            / sum(r.seconds for r, p in zip(rep, prompts) if str(p.task) == t) for rep in reps) for t in tasks}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m specjax.bench.peer", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="a registry name or a .gguf path")
    p.add_argument("--prompts-file", default="tasks")
    p.add_argument("--per-task", type=int, default=1)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--k", type=int, default=4, help="draft length of both n-gram arms")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--jobs", type=int, default=None, help="parallel compile jobs for the llama.cpp build")
    p.add_argument("--llama-bin", default=None, help="a built llama.cpp bin/ folder (skips the build)")
    p.add_argument("--no-auto", action="store_true", help="skip specjax's auto arm (scheduler)")
    p.add_argument("--weights-arith", default="exact",
                   help="specjax's arithmetic, or several comma-separated, each its own arms: exact (HF's "
                        "numbers), q8 (llama.cpp's; the arms' names end in q8)")
    p.add_argument("--assets", default="",
                   help="comma-separated shipped assets to load (eagle, recycle), among auto's options")
    p.add_argument("--raw", action="store_true",
                   help="send each prompt's text as it is, without the chat template (a base model)")
    p.add_argument("--json", default=None, help="also write the table as JSON here")
    args = p.parse_args(argv)
    table = report(measure(args))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(table, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
