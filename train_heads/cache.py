"""A feature cache: the frozen target run once, teacher-forced, over a corpus; heads train from it.

Training an EAGLE head with the target inside every step spends most of each step on the target's
forward. `extract` runs that forward once per sequence and stores, for **every** position (prompt
positions too: the head attends to them):

- `tokens` int32 [N] and `mask` bool [N] (the position's token is one that trains: an answer token);
- `hidden` [N, D]: the target's final-normed hidden state (what its LM head reads), bfloat16 by
  default or float32 (`dtype`);
- `taps` [N, F * D] when asked: the residual stream entering the target layers `taps` (EAGLE-3's
  fused features), same dtype;
- `lse` float32 [N]: the log-sum-exp of the target's logits, and `top` int32 [N]: their argmax.

No logits are stored: training rebuilds the target's distribution over the draft vocabulary as
`exp(hidden . W_ids - lse)` from the frozen LM head's rows (the mass outside it is one minus its sum).
With a bfloat16 `hidden` those logits carry an error of about 0.01-0.02 (rounding 2^-9 relative per
element over D = 576 products), so p is right to about 2% relative; a float32 cache is exact.

Format: a directory with `index.json` and one sub-directory per shard (`shard-00000/`), each holding
one `.npy` file per array (memory-mapped at read time) plus `starts.npy` (offset of each sequence,
[C + 1]) and `shard.json`. Why `.npy` over grain + array_record: the rows are fixed-width arrays, so a
memory map reads a batch as slices with no per-record decode and no extra dependency, and the loader's
position is a two-integer state that goes into the orbax checkpoint (`EpochLoader`).

Resuming: shard s always holds sequences `s * shard_size .. (s + 1) * shard_size - 1` of the corpus.
A shard is written into a temporary directory and renamed into place when complete, so after a kill
every shard on disk is whole and a rerun computes exactly the missing ones: no duplicates, no gaps.
The index names the corpus (a hash of its tokens and masks) and the settings; another corpus or other
settings in the same directory are refused.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import pathlib
import shutil
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from tqdm import tqdm

from train_heads.data import TokenData, atomic_write, permutation

FORMAT = "specjax-feature-cache/1"
INDEX = "index.json"
DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32}


def corpus_hash(items: Sequence[tuple[np.ndarray, np.ndarray]]) -> str:
    h = hashlib.sha256()
    for toks, mask in items:
        h.update(np.asarray(toks, np.int32).tobytes())
        h.update(np.asarray(mask, bool).tobytes())
        h.update(b"|")
    return h.hexdigest()[:16]


@functools.partial(jax.jit, static_argnames=("graphdef", "taps", "dtype"))
def _forward(graphdef, params, tokens, *, taps: tuple[int, ...], dtype):
    model = nnx.merge(graphdef, params)
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    out = model(tokens, positions, model.init_cache(b, t), taps=taps)
    logits = out.logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    top = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    tapped = jnp.concatenate(out.taps, axis=-1).astype(dtype) if taps else None
    return out.hidden.astype(dtype), tapped, lse, top


def _shard_name(s: int) -> str:
    return f"shard-{s:05d}"


def _atomic_json(path: pathlib.Path, obj) -> None:
    atomic_write(path, lambda p: p.write_text(json.dumps(obj, indent=1)))


def _identity(model: nnx.Module, items, out: pathlib.Path, *, meta: dict | None, taps: tuple[int, ...], dtype: str,
              shard_size: int) -> dict:
    """What a cache in `out` is (`extract`'s arguments checked; `out` created): refused when `out` holds
    the cache of another corpus or settings."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: use one of {sorted(DTYPES)}")
    if not items:
        raise ValueError("no sequences to extract")
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} is a file; give a directory for the cache")
    out.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    ident = dict(format=FORMAT, meta=meta or {}, dim=cfg.dim, vocab_size=cfg.vocab_size, taps=list(taps),
                 dtype=dtype, shard_size=shard_size, sequences=len(items), corpus=corpus_hash(items))
    old = json.loads((out / INDEX).read_text()) if (out / INDEX).is_file() else None
    if old is not None and {k: old.get(k) for k in ident} != json.loads(json.dumps(ident)):
        diff = {k: (old.get(k), v) for k, v in json.loads(json.dumps(ident)).items() if old.get(k) != v}
        raise ValueError(f"{out} holds a cache of another corpus or settings ({diff} as (there, here)); "
                         "use another directory")
    return ident


def extract(model: nnx.Module, items: Sequence[tuple[np.ndarray, np.ndarray]], out: str | os.PathLike, *,
            meta: dict | None = None, taps: Sequence[int] = (), dtype: str = "bfloat16", shard_size: int = 64,
            batch_size: int = 4, multiple: int = 64, max_shards: int | None = None, progress: bool = True,
            log=print) -> dict:
    """Writes (or completes) the cache of `items` ((tokens, train mask) per sequence) in `out`.

    Args:
      model: the frozen target.
      meta: what the corpus is (model name, weights id, source...): stored in the index and checked
        on resume.
      taps: target layers whose input is also stored (for `features="fused"` heads).
      dtype: "bfloat16" (default) or "float32" for `hidden` and `taps`.
      shard_size: sequences per shard (the unit of resumption).
      batch_size, multiple: sequences per forward and the length rounding (few compiled shapes).
      max_shards: stop after computing this many new shards (as if killed; for tests and time boxes).

    Returns the index. Prints the throughput (positions per second of target forward).
    """
    if shard_size < 1 or batch_size < 1 or multiple < 1:
        raise ValueError("shard_size, batch_size and multiple must be >= 1")
    out, taps = pathlib.Path(out), tuple(int(i) for i in taps)
    ident = _identity(model, items, out, meta=meta, taps=taps, dtype=dtype, shard_size=shard_size)
    n_shards = -(-len(items) // shard_size)
    total = sum(len(t) for t, _ in items)
    done = [(out / _shard_name(s) / "shard.json").is_file() for s in range(n_shards)]
    done_pos = sum(len(items[i][0]) for s in range(n_shards) if done[s]
                   for i in range(s * shard_size, min((s + 1) * shard_size, len(items))))
    graphdef, params = nnx.split(model)
    np_dtype = DTYPES[dtype]
    jdtype = jnp.bfloat16 if dtype == "bfloat16" else jnp.float32
    bar = tqdm(total=total, initial=done_pos, disable=not progress, desc="extract", unit="pos", smoothing=0.1)
    t0, new_pos, new_shards = time.perf_counter(), 0, 0
    for s in range(n_shards):
        if done[s]:
            continue
        if max_shards is not None and new_shards >= max_shards:
            break
        part = items[s * shard_size:(s + 1) * shard_size]
        arrays = _extract_shard(graphdef, params, part, taps=taps, dtype=jdtype, np_dtype=np_dtype,
                                batch_size=batch_size, multiple=multiple, bar=bar)
        _write_shard(out, s, arrays, dtype)
        new_shards += 1
        new_pos += int(sum(len(t) for t, _ in part))
        done[s] = True
        _atomic_json(out / INDEX, _index(out, ident, done))
    bar.close()
    dt = time.perf_counter() - t0
    index = _index(out, ident, done)
    _atomic_json(out / INDEX, index)
    log(f"extracted {new_pos} positions in {new_shards} shards in {dt:.1f}s "
        f"({new_pos / max(dt, 1e-9):.0f} positions/s); cache holds {index['positions']} positions "
        f"({index['train_positions']} that train) in {sum(done)}/{n_shards} shards"
        + ("" if index["complete"] else "; run again to complete it"))
    return index


def _index(out: pathlib.Path, ident: dict, done: list[bool]) -> dict:
    shards = []
    for s, ok in enumerate(done):
        if ok:
            shards.append(dict(name=_shard_name(s), **json.loads((out / _shard_name(s) / "shard.json").read_text())))
    return dict(ident, shards=shards, complete=all(done), positions=sum(x["positions"] for x in shards),
                train_positions=sum(x["train_positions"] for x in shards))


def _extract_shard(graphdef, params, part, *, taps, dtype, np_dtype, batch_size, multiple, bar) -> dict:
    order = sorted(range(len(part)), key=lambda i: len(part[i][0]))  # similar lengths share a batch
    per = [None] * len(part)
    for lo in range(0, len(order), batch_size):
        rows = order[lo:lo + batch_size]
        t = -(-max(len(part[i][0]) for i in rows) // multiple) * multiple
        batch = np.zeros((batch_size, t), np.int32)
        for j, i in enumerate(rows):
            batch[j, :len(part[i][0])] = part[i][0]
        hidden, tapped, lse, top = jax.device_get(_forward(graphdef, params, jnp.asarray(batch), taps=taps,
                                                           dtype=dtype))
        for j, i in enumerate(rows):  # padding sits after every real token: the causal mask keeps it out
            n = len(part[i][0])
            per[i] = (hidden[j, :n], None if tapped is None else tapped[j, :n], lse[j, :n], top[j, :n])
            bar.update(n)
    lengths = [len(t) for t, _ in part]
    arrays = dict(tokens=np.concatenate([np.asarray(t, np.int32) for t, _ in part]),
                  mask=np.concatenate([np.asarray(m, bool) for _, m in part]),
                  starts=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
                  hidden=np.concatenate([p[0] for p in per]).astype(np_dtype),
                  lse=np.concatenate([p[2] for p in per]).astype(np.float32),
                  top=np.concatenate([p[3] for p in per]).astype(np.int32))
    if taps:
        arrays["taps"] = np.concatenate([p[1] for p in per]).astype(np_dtype)
    return arrays


def _write_shard(out: pathlib.Path, s: int, arrays: dict, dtype: str) -> None:
    final = out / _shard_name(s)
    tmp = out / f".{_shard_name(s)}.{os.getpid()}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    for name, a in arrays.items():
        if a.dtype == ml_dtypes.bfloat16:
            a = a.view(np.uint16)  # .npy has no bfloat16; the index's dtype says how to view it
        np.save(tmp / f"{name}.npy", a)
    info = dict(sequences=len(arrays["starts"]) - 1, positions=int(len(arrays["tokens"])),
                train_positions=int(arrays["mask"].sum()))
    (tmp / "shard.json").write_text(json.dumps(info))
    if final.exists():  # a shard directory without shard.json: left by a crash before this format's rename
        shutil.rmtree(final)
    os.replace(tmp, final)


# ---- reading -----------------------------------------------------------------------------------


class FeatureCache:
    """A cache written by `extract`, memory-mapped: `sequence(i)` and `batch(ids, seq_len)`."""

    def __init__(self, path: str | os.PathLike, *, require_complete: bool = True):
        self.path = pathlib.Path(path)
        f = self.path / INDEX
        if not f.is_file():
            raise ValueError(f"{self.path} holds no feature cache ({INDEX} missing): build one with "
                             "`specjax train-heads extract --out DIR`")
        self.index = json.loads(f.read_text())
        if self.index.get("format") != FORMAT:
            raise ValueError(f"{self.path} is not a feature cache (format {self.index.get('format')!r})")
        if require_complete and not self.index["complete"]:
            raise ValueError(f"the feature cache {self.path} is incomplete ({len(self.index['shards'])} shards "
                             "done): run `specjax train-heads extract` again with the same settings to finish it")
        self.dtype = DTYPES[self.index["dtype"]]
        self.taps = tuple(self.index["taps"])
        self._shards = []
        counts = []
        for sh in self.index["shards"]:
            d = self.path / sh["name"]
            arrs = {}
            for name in ("tokens", "mask", "starts", "hidden", "lse", "top") + (("taps",) if self.taps else ()):
                a = np.load(d / f"{name}.npy", mmap_mode="r")
                if name in ("hidden", "taps"):
                    a = a.view(self.dtype)
                arrs[name] = a
            self._shards.append(arrs)
            counts.append(len(arrs["starts"]) - 1)
        self._first = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)

    @property
    def meta(self) -> dict:
        return self.index["meta"]

    def __len__(self) -> int:
        return int(self._first[-1])

    def _locate(self, i: int):
        s = int(np.searchsorted(self._first, i, side="right") - 1)
        arrs = self._shards[s]
        j = i - int(self._first[s])
        return arrs, int(arrs["starts"][j]), int(arrs["starts"][j + 1])

    def sequence(self, i: int) -> dict[str, np.ndarray]:
        """Every array of sequence `i` (views into the memory map)."""
        if not 0 <= i < len(self):
            raise IndexError(f"sequence {i} of {len(self)}")
        arrs, a, b = self._locate(i)
        return {k: v[a:b] for k, v in arrs.items() if k != "starts"}

    def length(self, i: int) -> int:
        _, a, b = self._locate(i)
        return b - a

    def batch(self, ids: Sequence[int], seq_len: int, *, taps: bool = False) -> dict[str, np.ndarray]:
        """Sequences `ids` cut or padded to `seq_len` (padding: token 0, mask False, zero features)."""
        b, d = len(ids), self.index["dim"]
        out = dict(tokens=np.zeros((b, seq_len), np.int32), mask=np.zeros((b, seq_len), bool),
                   hidden=np.zeros((b, seq_len, d), self.dtype), lse=np.zeros((b, seq_len), np.float32),
                   top=np.zeros((b, seq_len), np.int32))
        if taps:
            if not self.taps:
                raise ValueError(f"the cache {self.path} holds no fused taps: extract with --features fused")
            out["taps"] = np.zeros((b, seq_len, d * len(self.taps)), self.dtype)
        for r, i in enumerate(ids):
            seq = self.sequence(int(i))
            n = min(len(seq["tokens"]), seq_len)
            for k in out:
                out[k][r, :n] = seq[k][:n]
        return out

    def train_positions(self, ids: Sequence[int], seq_len: int | None = None) -> int:
        return int(sum(self.sequence(int(i))["mask"][:seq_len].sum() for i in ids))


@dataclasses.dataclass(frozen=True)
class CachedSequences:
    """Sequences `ids` of a `FeatureCache`, read `seq_len` tokens at a time (the trainer's data)."""

    cache: FeatureCache
    ids: np.ndarray

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def num_tokens(self) -> int:
        return self.cache.train_positions(self.ids)


class EpochLoader:
    """Batches of row indices: epoch e is a permutation seeded by (seed, e), cut into `n // batch_size`
    batches (at least one; a short last batch wraps). Its position (epoch, batch) is `state()`, saved in
    the training checkpoint; `restore` continues from it, so a killed run resumes with the same batches.
    """

    def __init__(self, n: int, batch_size: int, seed: int):
        if n < 1 or batch_size < 1:
            raise ValueError(f"n={n}, batch_size={batch_size}: both must be >= 1")
        self.n, self.batch_size, self.seed = n, batch_size, seed
        self.per_epoch = max(n // batch_size, 1)
        self.epoch = self.cursor = 0

    def next(self) -> np.ndarray:
        perm = permutation(self.n, self.seed, self.epoch)
        rows = np.resize(perm[self.cursor * self.batch_size:(self.cursor + 1) * self.batch_size], self.batch_size)
        self.cursor += 1
        if self.cursor == self.per_epoch:
            self.epoch, self.cursor = self.epoch + 1, 0
        return rows

    def state(self) -> dict:
        return dict(epoch=self.epoch, cursor=self.cursor, n=self.n, batch_size=self.batch_size, seed=self.seed)

    def state_at(self, step: int) -> dict:
        """The state after `step` batches (checkpoints written before the state was saved)."""
        e, c = divmod(step, self.per_epoch)
        return dict(self.state(), epoch=e, cursor=c)

    def restore(self, state: dict) -> None:
        mine = (self.n, self.batch_size, self.seed)
        if (state.get("n"), state.get("batch_size"), state.get("seed")) != mine:
            raise ValueError(f"the checkpoint's data loader read {state.get('n')} rows in batches of "
                             f"{state.get('batch_size')} (seed {state.get('seed')}); this run has {mine}")
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])


# ---- what the cache gives the recipe -----------------------------------------------------------


def target_vocabulary(cache: FeatureCache, ids: Sequence[int], size: int) -> np.ndarray:
    """The `size` tokens the target itself predicts most often (its argmax `top`) at the positions
    whose next token trains, over sequences `ids`; most frequent first, ties by id."""
    vocab = cache.index["vocab_size"]
    counts = np.zeros(vocab, np.int64)
    for i in ids:
        seq = cache.sequence(int(i))
        counts += np.bincount(seq["top"][:-1][seq["mask"][1:]], minlength=vocab)
    order = np.lexsort((np.arange(vocab), -counts))
    return order[:size].astype(np.int32)


def medusa_rows(cache: FeatureCache, ids: Sequence[int]):
    """Medusa's `TokenData` from the cache: for each contiguous run of train positions a..b-1 of a
    sequence, rows hold the hidden state at a-1..b-2 and the tokens a..b-1 (what the base LM head
    predicts there); each run is its own conversation, so no label crosses into another turn."""
    hidden, tokens = [], []
    for i in ids:
        seq = cache.sequence(int(i))
        m = np.asarray(seq["mask"], bool).copy()
        m[0] = False  # position 0 has no hidden state before it
        edges = np.flatnonzero(np.diff(np.concatenate([[0], m.astype(np.int8), [0]])))
        for a, b in zip(edges[::2], edges[1::2]):
            hidden.append(np.asarray(seq["hidden"][a - 1:b - 1]))
            tokens.append(np.asarray(seq["tokens"][a:b]))
    if not tokens:
        raise ValueError("no train positions in these cached sequences")
    return TokenData.from_sequences(hidden, tokens)
