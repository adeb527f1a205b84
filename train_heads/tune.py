"""After training: fit the heads' decoding setup to the data and to this machine.

Writes two optional files beside the heads, which `Engine.load_heads` picks up:
- `vocab.json`: the tokens the heads may propose, the most frequent ones in the self-distilled
  responses. Projecting onto them instead of the whole vocabulary makes a proposal several times
  cheaper; a token outside the subset is simply never drafted (acceptance stays exact).
- `tree.json`: the candidate tree with the best expected speed, from the heads' held-out accuracy
  by rank and the verify cost by window size measured here (`specjax.methods.tree_search`).
"""

from __future__ import annotations

import json
import pathlib
import statistics

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.bench import offline, verify_profile
from specjax.methods import tree_search
from specjax.methods.config import SpecConfig
from specjax.serving.engine import Engine
from specjax.methods.medusa.record import LoadedHeads
from train_heads import data
from train_heads.data import TokenData


def rank_accuracy(heads, base, data: TokenData, *, ranks: int = 8, batch: int = 512) -> np.ndarray:
    """acc[m, r]: how often head m's rank-r token is the right one on `data` ([M, R])."""
    m = heads.config.num_heads
    labels = data.labels(m)
    hits = np.zeros((m, ranks))
    count = np.zeros((m,))
    graphdef, params = nnx.split(heads)
    base_graphdef, base_params = nnx.split(base)

    @jax.jit
    def top(params, base_params, hidden, tokens):
        h = nnx.merge(graphdef, params)
        logits = h(hidden.astype(jnp.float32), nnx.merge(base_graphdef, base_params), tokens)
        return jax.lax.top_k(logits, ranks)[1]

    for i in range(0, data.num_rows, batch):
        hid, lab, tok = data.hidden[i:i + batch], labels[i:i + batch], data.tokens[i:i + batch]
        n = len(hid)
        if n < batch:  # one compiled shape
            hid = np.concatenate([hid, np.zeros((batch - n,) + hid.shape[1:], hid.dtype)])
            tok = np.concatenate([tok, np.zeros((batch - n,), tok.dtype)])
        idx = np.asarray(top(params, base_params, jnp.asarray(hid), jnp.asarray(tok)))[:n]  # [n, M, R]
        valid = lab >= 0
        hits += ((idx == lab[..., None]) & valid[..., None]).sum(0)
        count += valid.sum(0)
    return hits / np.maximum(count, 1)[:, None]


def frequent_tokens(tokens: np.ndarray, size: int) -> np.ndarray:
    """The `size` most frequent token ids of `tokens` (fewer if fewer occur), most frequent first."""
    ids, counts = np.unique(tokens, return_counts=True)
    order = np.lexsort((ids, -counts))
    return ids[order][:size]


def step_costs(engine, windows=(1, 2, 3, 5, 9, 17, 33), *, vocab: np.ndarray | None = None) -> dict:
    """Cost of a verify step by window size, a plain step (window 1) being 1.

    A Medusa step is one target forward over the window plus the heads' projection; the latter is
    measured once and added to every window above 1.
    """
    fwd = offline.window_costs(engine.model, windows=windows)
    prop, params = engine.proposer(SpecConfig(method="medusa", k=engine.asset("medusa").module.config.num_heads))
    hidden = jnp.zeros((1, engine.config.dim), jnp.float32)
    tokens = jnp.zeros((1,), jnp.int32)
    project = jax.jit(prop.head_logits)
    jax.block_until_ready(project(params, hidden, tokens))  # compiled and warm before it is timed
    samples = verify_profile.interleaved({"heads": (project, (params, hidden, tokens))}, 15)["heads"]
    heads_ms = statistics.median(samples) * 1e3
    return {w: (fwd[w] + (heads_ms if w > 1 else 0.0)) / fwd[1] for w in windows}


def tune(heads_dir: str | pathlib.Path, model: str = "smollm2-135m", *, vocab_size: int = 8192,
         max_nodes: int = 32, ranks: int = 8, log=print) -> dict:
    """Measures the heads on their held-out data, writes `vocab.json` and `tree.json` beside them.

    Returns a summary (accuracy by rank, subset coverage, costs, the tree and its expected speed).
    """
    heads_dir = pathlib.Path(heads_dir)
    for f in ("vocab.json", "tree.json"):  # tune the heads themselves, not an earlier tuning
        (heads_dir / f).unlink(missing_ok=True)
    engine = Engine.load(model, assets={"medusa": str(heads_dir)})
    loaded = engine.asset("medusa")
    man = loaded.manifest["data"]
    rows, _ = data.load(data.default_dir(engine.name, engine.weights_id, max_new_tokens=man["max_new_tokens"],
                                         max_prompt_tokens=man["max_prompt_tokens"]))
    split = man["conversations"]
    held_end = min(split + man["eval_conversations"], rows.num_conversations)
    train, held = rows.conversations(0, split), rows.conversations(split, held_end)
    heads = loaded.module
    vocab = frequent_tokens(train.tokens, vocab_size)
    coverage = float(np.isin(held.tokens, vocab).mean())
    log(f"vocab subset: {len(vocab)} tokens cover {coverage:.1%} of held-out response tokens")
    acc = rank_accuracy(heads, engine.model, held, ranks=ranks)
    log("held-out accuracy by rank (rows: heads):\n" + np.array2string(acc, precision=3))
    engine.set_asset("medusa", LoadedHeads(heads, vocab=vocab, manifest=loaded.manifest))
    costs = step_costs(engine)
    log("step cost by window (plain = 1): " + ", ".join(f"{w}: {c:.2f}" for w, c in costs.items()))
    tree, speed = tree_search.choose_tree(acc, costs, max_nodes=max_nodes)
    chain = tuple((0,) * d for d in range(1, heads.config.num_heads + 1))
    summary = dict(vocab_size=len(vocab), vocab_coverage=round(coverage, 4), accuracy=acc.round(4).tolist(),
                   costs={str(w): round(c, 3) for w, c in costs.items()}, tree=[list(p) for p in tree],
                   tree_expected_tau=round(tree_search.expected_tau(tree, acc), 3),
                   tree_expected_speedup=round(speed, 3),
                   chain_expected_tau=round(tree_search.expected_tau(chain, acc), 3))
    log(f"tree of {len(tree)} nodes: expected tau {summary['tree_expected_tau']}, expected speedup "
        f"{speed:.2f}x (chain of {len(chain)}: expected tau {summary['chain_expected_tau']})")
    (heads_dir / "vocab.json").write_text(json.dumps([int(t) for t in vocab]))
    (heads_dir / "tree.json").write_text(json.dumps(summary["tree"]))
    (heads_dir / "tuning.json").write_text(json.dumps(summary, indent=1))
    return summary
