"""The accelerator route for the draft heads (issue 17): build the feature cache and train an EAGLE head
on a lent GPU or TPU in under 10 minutes, carrying at most 64 MiB per call.

What travels is token ids, never features: the ShareGPT conversations (teacher-forced) and the
ShareGPT prompts whose answers the target writes itself on the device (self-distillation, in large
batches), both under the chat template and tokenized here; the model file in two halves; and the
pure-Python packages the device may lack (gguf, jaxtyping, tqdm). On the device the target is loaded
without a tokenizer, the answers are generated, the cache is built and the head trained from it, with
a head saved at each budget, so one run is also a learning curve.

Here (CPU), once:

    .venv/bin/python tools/accelerator_heads.py pack --stage .device --conversations 3000 --self 2000

writes .device/a and .device/b (each checked to be under 60 MiB). Then two calls to the device
machine, the second within its warm window (files outside $OUT stay there between calls):

    run(carry=[".device/a"], command="mkdir -p /tmp/heads && cp -r .device/a/. /tmp/heads/")
    run(carry=[".device/b"], command="cp -r .device/b/. /tmp/heads/ && "
        "python tools/accelerator_heads.py train --stage /tmp/heads --out $OUT/heads --minutes 8")

The heads come back under <files_at>/heads/head-<updates> (each loadable with `--eagle`), with
metrics.jsonl and report.json (the time of each stage). Their acceptance counts in the live loop:

    .venv/bin/python -m train_heads.learning_curve bench curve.json \\
        ../shared/data/specbench-dev.jsonl <files_at>/heads/head-1000,<files_at>/heads/head-3000

`train` runs anywhere (tests run it on CPU with a tiny budget); it never needs a tokenizer.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import pathlib
import shutil
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
LIMIT = 60 << 20  # bytes per carried directory (the tool's limit is 64 MiB)
DEPS = ("gguf", "jaxtyping", "wadler_lindig", "tqdm")  # pure Python; the device may not have them
MODEL_PARTS = 2


def _importable_specjax() -> None:
    """Makes `specjax` importable from this working tree when it is not installed (the device machine
    gets a copy of the repository, not an install): pyproject maps `specjax.models` to `models/`, so a
    package of links is built in a temporary directory, with `train_heads/` linked beside it."""
    try:
        import specjax.models  # noqa: F401
        import train_heads  # noqa: F401
        return
    except ImportError:
        pass
    import importlib.util
    import tempfile

    spec = importlib.util.spec_from_file_location("compare_commits", ROOT / "tools" / "compare_commits.py")
    compare_commits = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(compare_commits)  # its package tree is the one mapping of the layout
    tree = pathlib.Path(tempfile.mkdtemp(prefix="specjax-tree-"))
    compare_commits._package_tree(ROOT, tree)
    for name in [m for m in sys.modules if m.split(".")[0] in ("specjax", "train_heads")]:
        del sys.modules[name]
    sys.path.insert(0, str(tree))


def _flat(items) -> dict[str, np.ndarray]:
    lengths = np.array([len(t) for t, _ in items], np.int64)
    return dict(tokens=np.concatenate([np.asarray(t, np.int32) for t, _ in items]),
                mask=np.concatenate([np.asarray(m, bool) for _, m in items]), lengths=lengths)


def _unflat(tokens, mask, lengths):
    ends = np.cumsum(lengths)
    return [(tokens[e - n:e], mask[e - n:e]) for n, e in zip(lengths, ends)]


def _size(path: pathlib.Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def pack(stage, *, model="smollm2-135m", conversations=3000, self_prompts=2000, seq_len=1024,
         max_prompt_tokens=256, log=print) -> dict:
    """Writes `stage/a` (packages, the model's first half) and `stage/b` (its second half, the ids)."""
    import importlib

    from specjax.serving.engine import Engine
    from specjax.models import catalog
    from train_heads import data, sequences

    stage = pathlib.Path(stage)
    if stage.exists():
        shutil.rmtree(stage)
    a, b = stage / "a", stage / "b"
    (a / "deps").mkdir(parents=True)
    b.mkdir(parents=True)
    engine = Engine.load(model)
    path = catalog.resolve(model)
    t0 = time.perf_counter()
    items = sequences.corpus(engine, "sharegpt", conversations, seq_len, log=log)
    prompts = data.select_prompts(engine, self_prompts, max_prompt_tokens=max_prompt_tokens) if self_prompts else []
    arrays = _flat(items)
    if prompts:
        flat = _flat([(ids, np.ones(len(ids), bool)) for _, ids in prompts])
        arrays.update(prompt_tokens=flat["tokens"], prompt_lengths=flat["lengths"])
    np.savez_compressed(b / "ids.npz", **arrays)
    blob = path.read_bytes()
    cut = -(-len(blob) // MODEL_PARTS)
    for i, part in enumerate((a, b)):
        (part / f"model.gguf.part{i}").write_bytes(blob[i * cut:(i + 1) * cut])
    for dep in DEPS:
        src = pathlib.Path(importlib.import_module(dep).__file__).parent
        shutil.copytree(src, a / "deps" / dep, ignore=shutil.ignore_patterns("__pycache__"))
    manifest = dict(model=engine.name, file=path.name, sha256=hashlib.sha256(blob).hexdigest(),
                    weights_id=engine.weights_id, stop_ids=list(engine.tokenizer.stop_ids), seq_len=seq_len,
                    conversations=len(items), positions=int(sum(len(t) for t, _ in items)),
                    self_prompts=len(prompts), source="ShareGPT V3 (chat template)")
    (b / "manifest.json").write_text(json.dumps(manifest, indent=1))
    for part in (a, b):
        if _size(part) > LIMIT:
            raise ValueError(f"{part} holds {_size(part) >> 20} MiB, over the {LIMIT >> 20} MiB a call carries: "
                             f"pack fewer --conversations or --self prompts")
    log(f"packed {len(items)} conversations ({manifest['positions']} positions) and {len(prompts)} prompts "
        f"in {time.perf_counter() - t0:.0f}s: {a} {_size(a) >> 20} MiB, {b} {_size(b) >> 20} MiB")
    return manifest


@dataclasses.dataclass(frozen=True)
class Target:
    """What training needs of the target, loaded without a tokenizer."""

    model: object
    config: object
    name: str
    weights_id: str


def load_target(stage: pathlib.Path, manifest: dict) -> Target:
    from specjax.models import gguf_loader, linear, loader

    path = stage / manifest["file"]
    if not path.is_file():
        path.write_bytes(b"".join((stage / f"model.gguf.part{i}").read_bytes() for i in range(MODEL_PARTS)))
    if hashlib.sha256(path.read_bytes()).hexdigest() != manifest["sha256"]:
        raise ValueError(f"{path} does not hash to the packed model's sha256: the halves come from different packs")
    reader = gguf_loader.open_reader(path)
    config = gguf_loader.config_from_gguf(reader, name=manifest["model"], dtype="float32", param_dtype="float32",
                                          weight_layout=linear.preferred_layout(dtype="float32"))
    model = loader.model_from_weights(config, gguf_loader.weights_from_gguf(reader, config))
    wid = loader.weights_id(path)
    if wid != manifest["weights_id"]:
        raise ValueError(f"weights id {wid} != packed {manifest['weights_id']}")
    return Target(model, config, manifest["model"], wid)


def self_answers(target: Target, prompts, stop_ids, *, max_new_tokens: int, seq_len: int, batch_size: int,
                 log=print):
    """The target's own greedy answers to `prompts` (token ids), generated in batches: (ids, answer mask)."""
    from specjax.serving.engine import Engine

    engine = Engine(target.model, name=target.name, weights_id=target.weights_id)
    items = []
    for s in range(0, len(prompts), batch_size):
        part = [list(map(int, p)) for p in prompts[s:s + batch_size]]
        results = engine.generate(part, batch_size=batch_size, max_new_tokens=max_new_tokens, stop_ids=stop_ids)
        for ids, r in zip(part, results):
            toks = np.asarray(ids + list(r.tokens), np.int32)[:seq_len]
            items.append((toks, np.arange(len(toks)) >= len(ids)))
        log(f"self-distilled {len(items)}/{len(prompts)}")
    return items


def train(stage, out, *, minutes=8.0, budgets=(500, 1500, 3000), batch_size=16, seq_len=1024, unroll=3,
          draft_vocab=4096, lr=1e-3, max_new_tokens=256, gen_batch_size=128, forward_batch_size=32,
          n_eval=16, log=print) -> dict:
    """On the device: the target's answers, the feature cache, then a head at each budget in `out`."""
    stage, out = pathlib.Path(stage), pathlib.Path(out)
    if (stage / "deps").is_dir():
        sys.path.append(str(stage / "deps"))  # after the device's own packages
    _importable_specjax()
    import jax

    from train_heads import cache, learning_curve

    t_start = time.perf_counter()
    missing = [n for n in ("manifest.json", "ids.npz", *(f"model.gguf.part{i}" for i in range(MODEL_PARTS)))
               if not (stage / n).is_file()]
    if missing:
        raise FileNotFoundError(f"{stage} lacks {missing}: copy both carried halves (a and b) there first")
    manifest = json.loads((stage / "manifest.json").read_text())
    ids = np.load(stage / "ids.npz")
    report = dict(devices=[str(d) for d in jax.devices()], manifest=manifest, seconds={})

    def timed(name, f):
        t0 = time.perf_counter()
        r = f()
        report["seconds"][name] = round(time.perf_counter() - t0, 1)
        log(f"{name}: {report['seconds'][name]}s")
        return r

    target = timed("load", lambda: load_target(stage, manifest))
    items = _unflat(ids["tokens"], ids["mask"], ids["lengths"])
    if "prompt_tokens" in ids:
        prompts = _unflat(ids["prompt_tokens"], np.ones(len(ids["prompt_tokens"]), bool), ids["prompt_lengths"])
        items += timed("self_distill", lambda: self_answers(
            target, [p for p, _ in prompts], tuple(manifest["stop_ids"]), max_new_tokens=max_new_tokens,
            seq_len=seq_len, batch_size=gen_batch_size, log=log))
    rng = np.random.default_rng(0)  # held-out rows from both sources, not only the first ones
    items = [items[i] for i in rng.permutation(len(items))]
    report.update(sequences=len(items), positions=int(sum(len(t) for t, _ in items)),
                  train_positions=int(sum(int(m.sum()) for _, m in items)))
    cache_dir = stage / "cache"
    timed("extract", lambda: cache.extract(
        target.model, items, cache_dir, meta=dict(model=target.name, weights_id=target.weights_id,
                                                  data="sharegpt+self", seq_len=seq_len,
                                                  source=manifest["source"]),
        shard_size=256, batch_size=forward_batch_size, multiple=256, progress=False, log=log))
    left = 60 * minutes - (time.perf_counter() - t_start)
    log(f"{left:.0f}s left for training")
    records = timed("train", lambda: learning_curve.train(
        cache_dir, out, budgets, draft_vocab=draft_vocab, batch_size=batch_size, seq_len=seq_len,
        unroll=unroll, lr=lr, n_eval=n_eval, model=target, deadline=time.perf_counter() + left, log=log))
    report["budgets"] = records
    shutil.rmtree(out / "checkpoints", ignore_errors=True)  # the heads travel back, not the optimiser
    (out / "report.json").write_text(json.dumps(report, indent=1))
    return report


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    k = sub.add_parser("pack", help="here: token ids, the model in halves and packages into STAGE/a, STAGE/b")
    k.add_argument("--stage", required=True)
    k.add_argument("--model", default="smollm2-135m")
    k.add_argument("--conversations", type=int, default=3000)
    k.add_argument("--self", dest="self_prompts", type=int, default=2000)
    k.add_argument("--seq-len", type=int, default=1024)
    t = sub.add_parser("train", help="on the device: answers, cache and heads from STAGE into OUT")
    t.add_argument("--stage", required=True)
    t.add_argument("--out", required=True)
    t.add_argument("--minutes", type=float, default=8.0)
    t.add_argument("--budgets", default="500,1500,3000")
    t.add_argument("--batch-size", type=int, default=16)
    t.add_argument("--seq-len", type=int, default=1024)
    t.add_argument("--unroll", type=int, default=3)
    t.add_argument("--max-new-tokens", type=int, default=256)
    t.add_argument("--gen-batch-size", type=int, default=128)
    t.add_argument("--eval", type=int, default=16)
    a = p.parse_args(argv)
    if a.cmd == "pack":
        pack(a.stage, model=a.model, conversations=a.conversations, self_prompts=a.self_prompts, seq_len=a.seq_len)
    else:
        budgets = tuple(sorted(int(x) for x in a.budgets.split(",")))
        train(a.stage, a.out, minutes=a.minutes, budgets=budgets, batch_size=a.batch_size, seq_len=a.seq_len,
              unroll=a.unroll, max_new_tokens=a.max_new_tokens, gen_batch_size=a.gen_batch_size, n_eval=a.eval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
