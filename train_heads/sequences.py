"""Conversations as token sequences: what EAGLE heads and the feature cache train on.

ShareGPT conversations rendered with the target's chat template (plain text for a base model), cut to
`seq_len` tokens and masked on the assistant's tokens (`sharegpt_sequences`), or ShareGPT first turns
with the target's own greedy answers (`self_distilled_sequences`, through the Medusa pipeline's
cached self-distillation, `train_heads.data`); `Sequences` pads them into a batch, and
`draft_vocabulary` ranks a draft vocabulary by what trains.
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Iterator, Sequence

import numpy as np

from train_heads import data as distilled

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
         "bard": "assistant", "assistant": "assistant", "system": "system"}


def messages_of(conversation: dict) -> list[dict] | None:
    """ShareGPT turns as chat messages; None when a turn has an unknown role or nothing is said."""
    out = []
    for turn in conversation["conversations"]:
        role = ROLES.get(turn["from"])
        if role is None:
            return None
        if turn["value"].strip():
            out.append(dict(role=role, content=turn["value"]))
    return out if any(m["role"] == "assistant" for m in out) else None


def plain_render(messages: list[dict], add_generation_prompt: bool = False) -> str:
    """A conversation as plain text for a model without a chat template: each message's content
    and a blank line (nothing marks the roles, as in a base model's completion)."""
    return "".join(m["content"] + "\n\n" for m in messages)


def encode_conversation(tokenizer, messages: list[dict], seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, assistant mask) of a conversation under the chat template, cut to `seq_len`.

    Each message is rendered as the template's text added by it (render of messages[:i+1] minus
    the render of messages[:i]) and tokenized on its own; the mask marks the assistant messages. A
    base model without a chat template (Gemma 3 270M) reads the conversation as plain text, each
    message's content followed by a blank line: what it sees in completion mode.
    """
    render = tokenizer.apply_chat_template if tokenizer.chat_template else plain_render
    tokens, mask, prev = [], [], ""
    for i, m in enumerate(messages):
        text = render(messages[: i + 1], add_generation_prompt=False)
        head = render(messages[:i], add_generation_prompt=True) if m["role"] == "assistant" and i else prev
        if not (text.startswith(head) and head.startswith(prev)):  # a template that rewrites the past
            head = prev = ""
            tokens, mask = [], []
        for piece, learn in ((head[len(prev):], False), (text[len(head):], m["role"] == "assistant")):
            if piece:
                ids = tokenizer.encode(piece, add_bos=None if not tokens else False)
                tokens += ids
                mask += [learn] * len(ids)
        prev = text
        if len(tokens) >= seq_len:
            break
    return np.asarray(tokens[:seq_len], np.int32), np.asarray(mask[:seq_len], bool)


def sharegpt_sequences(tokenizer, n: int, seq_len: int, *, path=None) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The first `n` usable ShareGPT conversations (at least 8 assistant tokens), encoded."""
    text = pathlib.Path(path or distilled.sharegpt_path()).read_text(encoding="utf-8")
    count = 0
    for conv in distilled.iter_conversations(text):
        msgs = messages_of(conv)
        if msgs is None:
            continue
        toks, mask = encode_conversation(tokenizer, msgs, seq_len)
        if mask[2:].sum() < 8:
            continue
        yield toks, mask
        count += 1
        if count >= n:
            return


def self_distilled_sequences(engine, n: int, seq_len: int, *, max_new_tokens: int = 128,
                             max_prompt_tokens: int = 256, batch_size: int = 16,
                             log=print) -> list[tuple[np.ndarray, np.ndarray]]:
    """Prompt + the target's own greedy answer for the first `n` ShareGPT prompts (the Medusa
    pipeline's cached self-distillation, `train_heads.data.build`), masked on the answer.

    What the head drafts at inference is the target's own text, which is far more predictable than
    ShareGPT's human-written answers; generating it costs ~20x teacher forcing here.
    """
    out = distilled.default_dir(engine.name, engine.weights_id, max_new_tokens=max_new_tokens,
                           max_prompt_tokens=max_prompt_tokens)
    distilled.build(engine, out, conversations=n, max_new_tokens=max_new_tokens, batch_size=batch_size,
               max_prompt_tokens=max_prompt_tokens, log=log)
    rows, index = distilled.load(out)
    prompts = distilled.select_prompts(engine, n, max_prompt_tokens=max_prompt_tokens)
    items = []
    for c, (_, ids) in enumerate(prompts):
        answer = rows.tokens[rows.starts[c]: rows.starts[c + 1]]
        toks = np.concatenate([np.asarray(ids, np.int32), answer])[:seq_len]
        items.append((toks, np.arange(len(toks)) >= len(ids)))
    return items


@dataclasses.dataclass(frozen=True)
class Sequences:
    """Padded token sequences `[N, T]` and their loss masks (assistant tokens)."""

    tokens: np.ndarray
    mask: np.ndarray

    @classmethod
    def pad(cls, items: Sequence[tuple[np.ndarray, np.ndarray]], seq_len: int) -> "Sequences":
        toks = np.zeros((len(items), seq_len), np.int32)
        mask = np.zeros((len(items), seq_len), bool)
        for i, (t, m) in enumerate(items):  # longer sequences are cut
            toks[i, : len(t)] = t[:seq_len]
            mask[i, : len(m)] = m[:seq_len]
        return cls(toks, mask)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def num_tokens(self) -> int:
        return int(self.mask.sum())


def draft_vocabulary(tokens: np.ndarray, mask: np.ndarray, size: int, vocab_size: int) -> np.ndarray:
    """The `size` most frequent tokens among the masked (assistant) ones, most frequent first;
    ties and unseen tokens by id."""
    counts = np.bincount(tokens[mask].ravel(), minlength=vocab_size)
    order = np.lexsort((np.arange(vocab_size), -counts))
    return order[:size].astype(np.int32)


def corpus(engine, data: str, n: int, seq_len: int, *, log=print) -> list[tuple[np.ndarray, np.ndarray]]:
    """(tokens, train mask) of `n` sequences: complete ShareGPT conversations ("sharegpt") or ShareGPT
    first turns with the target's own greedy answers ("self")."""
    if data not in ("sharegpt", "self"):
        raise ValueError(f"data={data!r}: use 'sharegpt' or 'self'")
    if data == "self":
        return self_distilled_sequences(engine, n, seq_len, log=log)
    return list(sharegpt_sequences(engine.tokenizer, n, seq_len))
