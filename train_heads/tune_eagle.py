"""After training an EAGLE head: pick its chain length, tree and draft vocabulary on this machine.

Every candidate is measured, not modelled: greedy generation on held-out ShareGPT prompts (the
first human turns of the conversations the head did not train on, under the chat template), its
tok/s against the plain loop in the same run, interleaved so that drift spreads over all of them.
Stage 1 picks the draft vocabulary size (a chain of 3), stage 2 the chain length, stage 3 the tree
(depth, node budget, top-k). The choice is written to `tuning.json` beside the head, which
`Engine.load_asset("eagle", DIR)` reads: `--method eagle` then runs the tuned chain, `eagle-tree` the tuned
tree, and `auto` offers both.
"""

from __future__ import annotations

import json
import pathlib

from specjax.bench import verify_profile
from specjax.methods.config import SpecConfig
from specjax.serving.engine import Engine
from train_heads import data
from train_heads.sequences import messages_of

TUNING = "tuning.json"
VOCABS = (4096, 8192, 16384)
CHAINS = (2, 3, 4, 5, 6)
TREES = ((3, 8, 2), (4, 12, 3), (4, 16, 4), (5, 24, 4))  # (depth, nodes, topk)


def held_out_prompts(head_manifest: dict, n: int) -> list[str]:
    """First human turns of the head's held-out conversations (the first ones of the file)."""
    held = int(head_manifest.get("data", {}).get("eval_conversations", n))
    text = pathlib.Path(data.sharegpt_path()).read_text(encoding="utf-8")
    out = []
    for conv in data.iter_conversations(text):
        msgs = messages_of(conv)
        if msgs is None:
            continue
        if msgs[0]["role"] == "user" and len(msgs[0]["content"]) < 1500:
            out.append(msgs[0]["content"])
        if len(out) >= min(n, held):
            break
    return out


def measure(engine, prompts: list[str], specs: dict, *, max_new_tokens: int, repeats: int = 1) -> dict:
    """tok/s and tau of each spec on `prompts` (plain included as "none"), the specs alternating."""
    specs = {"none": SpecConfig(), **specs}
    for s in specs.values():  # compile outside the timing
        engine.generate(prompts[:1], chat=True, max_new_tokens=max_new_tokens, spec=s)
    # every spec over every prompt, in rounds that alternate the specs' order (the bench's timing)
    runs = verify_profile.alternating(specs, repeats, lambda m: [
        engine.generate([p], chat=True, max_new_tokens=max_new_tokens, spec=specs[m])[0] for p in prompts])
    results = {m: [r for run in rs for r in run] for m, rs in runs.items()}
    toks = {m: sum(r.new_tokens for r in rs) for m, rs in results.items()}
    wall = {m: sum(r.wall_s for r in rs) for m, rs in results.items()}
    fwd = {m: sum(r.target_forwards for r in rs) for m, rs in results.items()}
    base = toks["none"] / wall["none"]
    return {m: dict(tok_s=round(toks[m] / wall[m], 2), speedup=round(toks[m] / wall[m] / base, 3),
                    tau=round((toks[m] - len(prompts) * repeats) / max(fwd[m], 1), 3)) for m in specs}


def tune(eagle_dir: str | pathlib.Path, model: str = "smollm2-135m", *, prompts: int = 6,
         max_new_tokens: int = 96, log=print) -> dict:
    """Measures the candidates and writes `tuning.json` beside the head; returns what it wrote."""
    eagle_dir = pathlib.Path(eagle_dir)
    (eagle_dir / TUNING).unlink(missing_ok=True)
    engine = Engine.load(model, assets={"eagle": str(eagle_dir)})
    texts = held_out_prompts(engine.asset("eagle").manifest, prompts)
    most = len(engine.asset("eagle").ids)
    vocabs = [v for v in VOCABS if v < most] + [most]
    log(f"{len(texts)} held-out prompts, {max_new_tokens} new tokens; vocabularies {vocabs}")
    stage1 = measure(engine, texts, {f"chain3/v{v}": SpecConfig.make("eagle", k=3, draft_vocab=v) for v in vocabs},
                     max_new_tokens=max_new_tokens)
    log(json.dumps(stage1))
    vocab = max(vocabs, key=lambda v: stage1[f"chain3/v{v}"]["tok_s"])
    stage2 = measure(engine, texts, {f"chain{k}": SpecConfig.make("eagle", k=k, draft_vocab=vocab) for k in CHAINS},
                     max_new_tokens=max_new_tokens)
    log(json.dumps(stage2))
    k = max(CHAINS, key=lambda c: stage2[f"chain{c}"]["tok_s"])
    stage3 = measure(engine, texts, {f"tree{d}/{n}/{t}": SpecConfig.make("eagle", k=d, nodes=n, topk=t,
                                                                     draft_vocab=vocab) for d, n, t in TREES},
                     max_new_tokens=max_new_tokens)
    log(json.dumps(stage3))
    d, n, t = max(TREES, key=lambda x: stage3[f"tree{x[0]}/{x[1]}/{x[2]}"]["tok_s"])
    summary = dict(chain=dict(k=k, draft_vocab=vocab), tree=dict(k=d, nodes=n, topk=t, draft_vocab=vocab),
                   prompts=len(texts), max_new_tokens=max_new_tokens,
                   measured=dict(vocab=stage1, chain=stage2, tree=stage3))
    (eagle_dir / TUNING).write_text(json.dumps(summary, indent=1))
    log(f"chosen: chain k={k}, tree depth {d} / {n} nodes / top-{t}, draft vocabulary {vocab}")
    return summary
