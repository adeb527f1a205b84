"""Token recycling's asset: the warm start (a matrix and second-order table written from the target's
own answers) and the templates tuned for a machine, saved in one directory beside the heads.

A directory holds `manifest.json` (what it belongs to: the model's name, `weights_id` and vocabulary,
k, the second-order table's size, what it was warmed on), `recycle.npz` (the written rows only:
`first_rows`, `first_vals`, `second_slots`, `second_keys`, `second_vals`) and optionally
`tuning.json` (`specjax tune-recycle`: the chain and tree chosen from measured per-node acceptance and
this machine's window costs). `load` refuses a directory it does not fully understand: another
format, model or vocabulary, unknown arrays, or token ids outside the vocabulary.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib

import jax.numpy as jnp
import numpy as np

from specjax.methods.recycle.matrix import RecycleParams, pair_slot

FORMAT = "specjax-recycle/1"
MANIFEST, ARRAYS, TUNING = "manifest.json", "recycle.npz", "tuning.json"
KEYS = ("first_rows", "first_vals", "second_slots", "second_keys", "second_vals")


def shipped_dir(model_name: str | None) -> pathlib.Path | None:
    """The warm start shipped for `model_name` (`specjax.models`' `shipped/<name>-recycle/`), or None."""
    from specjax.models.heads_io import SHIPPED

    path = SHIPPED / f"{model_name}-recycle"
    return path if model_name and (path / MANIFEST).is_file() else None


def save(directory, *, first: np.ndarray, written: np.ndarray, keys: np.ndarray, second: np.ndarray,
         manifest: dict, tuning: dict | None = None) -> pathlib.Path:
    """Writes a warm start: `first [V, K]` with `written [V]` (rows to keep), and the second-order
    table `keys [Z, 2]` (-1: empty), `second [Z, K]`. The manifest is written last (the commit point)."""
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    filled = np.flatnonzero((keys >= 0).all(axis=1))
    rows = np.flatnonzero(written)
    tmp = directory / (ARRAYS + ".tmp.npz")
    np.savez_compressed(tmp, first_rows=rows.astype(np.int32), first_vals=first[rows].astype(np.int32),
                        second_slots=filled.astype(np.int32), second_keys=keys[filled].astype(np.int32),
                        second_vals=second[filled].astype(np.int32))
    os.replace(tmp, directory / ARRAYS)
    if tuning is not None:
        (directory / TUNING).write_text(json.dumps(tuning, indent=1) + "\n")
    man = dict(manifest, format=FORMAT, vocab_size=int(first.shape[0]), k=int(first.shape[1]),
               table=int(keys.shape[0]), first_rows=int(len(rows)), second_entries=int(len(filled)))
    tmp = directory / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(man, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, directory / MANIFEST)
    return directory


def _refuse(path, why: str) -> ValueError:
    return ValueError(f"recycling warm start {path}: {why}; warm one for this model with `specjax warm-recycle`")


@functools.lru_cache(maxsize=8)
def _read(path: str, mtime: float) -> tuple[dict, dict, dict | None]:
    d = pathlib.Path(path)
    man = json.loads((d / MANIFEST).read_text())
    with np.load(d / ARRAYS, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    tuning = json.loads((d / TUNING).read_text()) if (d / TUNING).is_file() else None
    return man, arrays, tuning


def read(path) -> tuple[dict, dict, dict | None]:
    """(manifest, arrays, tuning) of a warm-start directory (cached until its manifest changes)."""
    d = pathlib.Path(path)
    if not (d / MANIFEST).is_file() or not (d / ARRAYS).is_file():
        raise _refuse(path, f"no {MANIFEST} and {ARRAYS} there")
    return _read(str(d.resolve()), (d / MANIFEST).stat().st_mtime)


def load(path, *, vocab: int, k: int, name: str | None = None, weights_id: str | None = None) -> RecycleParams:
    """The warm start at `path` as the proposer's params, checked against the target (its
    vocabulary `vocab`, catalog `name` and `weights_id` when known) and the `k` candidates wanted."""
    man, a, _ = read(path)
    if man.get("format") != FORMAT:
        raise _refuse(path, f"format {man.get('format')!r}, this specjax reads {FORMAT!r}")
    if int(man["vocab_size"]) != vocab:
        raise _refuse(path, f"written for a vocabulary of {man['vocab_size']}, the model has {vocab}")
    for field, mine in (("model", name), ("weights_id", weights_id)):
        if mine is not None and man.get(field) not in (None, mine):
            raise _refuse(path, f"written for {field} {man.get(field)!r}, this is {mine!r}")
    if int(man["k"]) < k:
        raise _refuse(path, f"it keeps {man['k']} candidates per token; recycle_k={k} needs at least {k}")
    if set(a) != set(KEYS):
        raise _refuse(path, f"arrays {sorted(a)}, expected {list(KEYS)}")
    z, kk = int(man["table"]), int(man["k"])
    rows, vals = a["first_rows"], a["first_vals"]
    slots, keys, second = a["second_slots"], a["second_keys"], a["second_vals"]
    shapes_ok = (vals.shape == (len(rows), kk) and keys.shape == (len(slots), 2) and second.shape == (len(slots), kk))
    ids_ok = all(x.size == 0 or (x.min() >= 0 and x.max() < vocab) for x in (rows, vals, keys, second))
    if not shapes_ok or not ids_ok or (slots.size and (slots.min() < 0 or slots.max() >= z)):
        raise _refuse(path, "arrays of the wrong shape, or token ids outside the vocabulary")
    if slots.size and not np.array_equal(np.asarray(pair_slot(jnp.asarray(keys[:, 0]), jnp.asarray(keys[:, 1]),
                                                              jnp.zeros(len(slots), jnp.int32), z)), slots):
        raise _refuse(path, "second-order entries stored at slots their keys do not hash to")
    first = np.broadcast_to(np.arange(k, dtype=np.int32), (vocab, k)).copy()
    first[rows] = vals[:, :k]
    table_keys = np.full((z, 2), -1, np.int32)
    table_vals = np.zeros((z, k), np.int32)
    table_keys[slots], table_vals[slots] = keys, second[:, :k]
    return RecycleParams(first=jnp.asarray(first), keys=jnp.asarray(table_keys), second=jnp.asarray(table_vals))


def tuning(path) -> dict | None:
    """The tuning saved beside a warm start (`tuning.json`), or None."""
    return read(path)[2]
