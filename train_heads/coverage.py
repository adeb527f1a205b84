"""How much of the target's own greedy output a draft vocabulary holds, per task class.

A draft can only propose tokens in its draft vocabulary, so the share of the target's greedy tokens
inside it caps first-position acceptance. `coverage` counts it over answers the target generated
itself (greedy, chat template) for a prompt file with a `task` field (e.g. the Spec-Bench dev
prompts: measure on them, never train on them).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np


def greedy_answers(engine, prompts, *, max_new_tokens: int = 128, batch_size: int = 8) -> dict[str, list[np.ndarray]]:
    """The target's greedy answers (token ids) to `prompts` (`specjax.bench.prompts.Prompt`), by task class."""
    out: dict[str, list[np.ndarray]] = {}
    results = engine.generate([p.text for p in prompts], chat=True, batch_size=min(batch_size, len(prompts)),
                              max_new_tokens=max_new_tokens)
    for p, r in zip(prompts, results):
        out.setdefault(p.task or "all", []).append(np.asarray(r.tokens, np.int64))
    return out


def coverage(answers: Mapping[str, Sequence[np.ndarray]], ranked_ids: np.ndarray,
             sizes: Sequence[int]) -> dict[str, dict[int, float]]:
    """Per task class (and "all"), the share of answer tokens inside the first `size` of `ranked_ids`."""
    rank = np.full(int(max(max((a.max(initial=0) for v in answers.values() for a in v), default=0),
                           ranked_ids.max(initial=0))) + 1, np.iinfo(np.int64).max)
    rank[np.asarray(ranked_ids)] = np.arange(len(ranked_ids))
    table = {}
    every = []
    for task, seqs in answers.items():
        toks = np.concatenate(list(seqs)) if seqs else np.zeros(0, np.int64)
        every.append(toks)
        table[task] = {s: float(np.mean(rank[toks] < s)) if len(toks) else float("nan") for s in sizes}
    toks = np.concatenate(every) if every else np.zeros(0, np.int64)
    table["all"] = {s: float(np.mean(rank[toks] < s)) if len(toks) else float("nan") for s in sizes}
    return table


def format_table(tables: Mapping[str, dict[str, dict[int, float]]], sizes: Sequence[int]) -> str:
    """Markdown: one row per (ranking, task class), one column per vocabulary size."""
    lines = ["| ranking | task | " + " | ".join(str(s) for s in sizes) + " |",
             "|---|---|" + "---|" * len(sizes)]
    for name, table in tables.items():
        for task, row in table.items():
            lines.append(f"| {name} | {task} | " + " | ".join(f"{100 * row[s]:.1f}%" for s in sizes) + " |")
    return "\n".join(lines)
