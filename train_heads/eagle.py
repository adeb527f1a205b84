"""Training EAGLE heads on the frozen target's own distributions, teacher-forced over ShareGPT.

Data: complete ShareGPT conversations rendered with the target's chat template, cut to `seq_len`
tokens; the loss is taken where the predicted token is an assistant token. Each step runs the
frozen target over the batch inside the jitted step (no feature files): its features, its
distribution at every position over the draft vocabulary, and its argmax. At every position that
is the exact label an EAGLE head needs: what the target itself says next given the context.

Loss, per unrolled step j (weight `step_decay ** j`, see `EagleHead.unroll`):
- the cross-entropy of the head's draft-vocabulary distribution q against the target's p, summed
  over the draft vocabulary (p is not renormalised: the mass p puts outside it cannot be accepted
  and is not asked for); this is KL(p || q) up to a constant;
- `feature_weight` x smooth L1 of the predicted feature against the target's final hidden state.
Input features get uniform noise of amplitude `noise` (EAGLE's recipe).

Held-out metrics per draft position j + 1: `acc[j]`, how often the head's top token equals the
target's argmax when the context before it is right (a greedy chain's conditional acceptance at
that position), and the chain tau those rates imply.

Resuming a run reproduces the uninterrupted one: the batch of step s and its noise depend only on
the seed and s.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import time
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from specjax.models import eagle as eagle_model
from specjax.models import eagle_io
from specjax.models.eagle import EagleConfig, EagleHead
from specjax.models.kv_cache import KVCache
from specjax.train_heads.checkpoint import ResumableRun, TrainCheckpoints

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
         "bard": "assistant", "assistant": "assistant", "system": "system"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class EagleTrainConfig:
    """Optimisation and bookkeeping of an EAGLE head run.

    Attributes:
      steps: optimiser steps (the cosine schedule spans them).
      batch_size: sequences per step over all devices (a multiple of the device count).
      seq_len: tokens per sequence (longer conversations are cut, shorter ones padded).
      lr, warmup, final_lr, weight_decay, clip: AdamW on a warmup-cosine schedule after clipping.
      unroll: steps of the training-time test (1 = teacher forcing only).
      step_decay: loss weight of unrolled step j is step_decay ** j.
      feature_weight: weight of the feature regression.
      noise: amplitude of the uniform noise added to the input features.
      eval_every, save_every, keep, log_every: bookkeeping (may change on resume).
      seed: data order and noise.
    """

    steps: int = 400
    batch_size: int = 4
    seq_len: int = 512
    lr: float = 1e-3
    warmup: int = 20
    final_lr: float = 0.1
    weight_decay: float = 0.0
    clip: float = 0.5
    unroll: int = 3
    step_decay: float = 0.8
    feature_weight: float = 0.1
    noise: float = 0.1
    eval_every: int = 100
    save_every: int = 25
    keep: int = 2
    log_every: int = 5
    seed: int = 0

    def __post_init__(self):
        for f in ("steps", "batch_size", "seq_len", "unroll", "eval_every", "save_every", "keep", "log_every"):
            v = getattr(self, f)
            if int(v) != v or v < 1:
                raise ValueError(f"{f}={v}: must be an integer >= 1")
        if self.seq_len < 4:
            raise ValueError(f"seq_len={self.seq_len}: must be >= 4")
        if not 0 <= self.warmup < self.steps:
            raise ValueError(f"warmup={self.warmup}: must be in [0, steps={self.steps})")
        if not (self.lr > 0 and math.isfinite(self.lr)) or not 0 <= self.final_lr <= 1:
            raise ValueError("lr must be positive and final_lr in [0, 1]")
        if not 0 < self.step_decay <= 1 or self.feature_weight < 0 or self.noise < 0 or self.clip <= 0:
            raise ValueError("step_decay in (0, 1], feature_weight >= 0, noise >= 0, clip > 0")


_BOOKKEEPING = ("eval_every", "save_every", "keep", "log_every")


# ---- data ------------------------------------------------------------------------------------------


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


def encode_conversation(tokenizer, messages: list[dict], seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, assistant mask) of a conversation under the chat template, cut to `seq_len`.

    Each message is rendered as the template's text added by it (render of messages[:i+1] minus
    the render of messages[:i]) and tokenized on its own; the mask marks the assistant messages.
    """
    render = tokenizer.apply_chat_template
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
    from specjax.train_heads import data

    text = pathlib.Path(path or data.sharegpt_path()).read_text(encoding="utf-8")
    count = 0
    for conv in data.iter_conversations(text):
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
    pipeline's cached self-distillation, `specjax.train_heads.data.build`), masked on the answer.

    What the head drafts at inference is the target's own text, which is far more predictable than
    ShareGPT's human-written answers; generating it costs ~20x teacher forcing here.
    """
    from specjax.train_heads import data

    out = data.default_dir(engine.name, engine.weights_id, max_new_tokens=max_new_tokens,
                           max_prompt_tokens=max_prompt_tokens)
    data.build(engine, out, conversations=n, max_new_tokens=max_new_tokens, batch_size=batch_size,
               max_prompt_tokens=max_prompt_tokens, log=log)
    rows, index = data.load(out)
    prompts = data.select_prompts(engine, n, max_prompt_tokens=max_prompt_tokens)
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
        for i, (t, m) in enumerate(items):
            toks[i, : len(t)] = t
            mask[i, : len(m)] = m
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


def batch_indices(n: int, batch_size: int, seed: int, step: int) -> np.ndarray:
    """Rows of step `step`: epochs of a seeded permutation, so a resumed run sees the same batches."""
    per_epoch = max(n // batch_size, 1)
    epoch, i = divmod(step, per_epoch)
    perm = np.random.default_rng([seed, epoch]).permutation(n)
    return np.resize(perm[i * batch_size:(i + 1) * batch_size], batch_size)


# ---- the jitted pieces ----------------------------------------------------------------------------


def teacher(target, config: EagleConfig, tokens, ids):
    """The frozen target over a batch: features, final hidden, p over the draft vocabulary, argmax."""
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    out, feats = eagle_model.target_features(target, config, tokens, positions,
                                             KVCache.zeros(target.config, b, t))
    logits = out.logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
    p_ids = jnp.exp(jnp.take(logits, ids, axis=-1) - lse)
    top = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.lax.stop_gradient((feats, out.hidden, p_ids, top))


def losses(head: EagleHead, embed, w_ids, ids, teach, tokens, mask, key, cfg: EagleTrainConfig,
           *, noise: float):
    """(loss, metrics) of a batch; metrics are sums per unrolled step (divide by `count`)."""
    feats, hidden, p_ids, top = teach
    f = head.lift(feats)
    if noise:
        f = f + jax.random.uniform(key, f.shape, f.dtype, -noise, noise)
    nxt = jnp.concatenate([tokens[:, 1:], tokens[:, :1] * 0], axis=1)  # token t + 1 at entry t
    emb = jnp.take(embed, nxt, axis=0)
    outs = head.unroll(f, emb, cfg.unroll)
    t = tokens.shape[1]
    pos = jnp.arange(t - 2)
    total = 0.0
    ce, acc, feat, count = [], [], [], []
    for j, out in enumerate(outs):
        o = out[:, : t - 2]
        lq = jax.nn.log_softmax(head.logits(o, w_ids).astype(jnp.float32), axis=-1)
        valid = (mask[:, 2:] & (pos >= j)[None]).astype(jnp.float32)  # x_{t+2} is an assistant token
        n = jnp.maximum(valid.sum(), 1.0)
        c = -jnp.sum(p_ids[:, 1: t - 1] * lq, axis=-1)
        fl = jnp.mean(optax.huber_loss(o, hidden[:, 1: t - 1].astype(o.dtype)), axis=-1)
        hit = (jnp.take(ids, jnp.argmax(lq, axis=-1)) == top[:, 1: t - 1]).astype(jnp.float32)
        total = total + cfg.step_decay**j * (jnp.sum(c * valid) + cfg.feature_weight * jnp.sum(fl * valid)) / n
        ce.append(jnp.sum(c * valid))
        acc.append(jnp.sum(hit * valid))
        feat.append(jnp.sum(fl * valid))
        count.append(valid.sum())
    metrics = dict(ce=jnp.stack(ce), acc=jnp.stack(acc), feat=jnp.stack(feat), count=jnp.stack(count))
    return total, metrics


def make_steps(head_graphdef, target_graphdef, config: EagleConfig, cfg: EagleTrainConfig, tx):
    def run_teacher(target_params, tokens, ids):
        target = nnx.merge(target_graphdef, target_params)
        embed = target.embed[...]
        return teacher(target, config, tokens, ids), embed, eagle_model.lm_rows(target, ids)

    @jax.jit
    def train_step(params, opt_state, target_params, ids, tokens, mask, key):
        teach, embed, w_ids = run_teacher(target_params, tokens, ids)

        def loss_fn(p):
            return losses(nnx.merge(head_graphdef, p), embed, w_ids, ids, teach, tokens, mask, key, cfg,
                          noise=cfg.noise)

        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, dict(metrics, loss=loss)

    @jax.jit
    def eval_step(params, target_params, ids, tokens, mask):
        teach, embed, w_ids = run_teacher(target_params, tokens, ids)
        _, metrics = losses(nnx.merge(head_graphdef, params), embed, w_ids, ids, teach, tokens, mask,
                            jax.random.key(0), cfg, noise=0.0)
        return metrics

    return train_step, eval_step


def summarize(sums: dict) -> dict:
    """Per-position rates from summed metrics, and the greedy chain tau they imply."""
    count = np.maximum(np.asarray(sums["count"]), 1.0)
    acc = np.asarray(sums["acc"]) / count
    tau = 1.0 + float(np.sum(np.cumprod(acc)))
    return dict(acc=[round(float(a), 4) for a in acc], ce=[round(float(c), 4) for c in np.asarray(sums["ce"]) / count],
                feat=[round(float(c), 4) for c in np.asarray(sums["feat"]) / count],
                chain_tau=round(tau, 3), tokens=int(count[0]))


# ---- the trainer -----------------------------------------------------------------------------------


class EagleTrainer(ResumableRun):
    """A resumable EAGLE head run: `fit`, `evaluate`, `save`; checkpoints and metrics in `out`."""

    def __init__(self, config: EagleConfig, target, train: Sequences, held_out: Sequences, draft_ids,
                 out: str | pathlib.Path, cfg: EagleTrainConfig, *, run_info: dict | None = None,
                 init: EagleHead | None = None):
        self.devices = jax.devices()
        if cfg.batch_size % len(self.devices):
            raise ValueError(f"batch_size={cfg.batch_size} does not divide over {len(self.devices)} devices: "
                             f"use a multiple of {len(self.devices)}")
        if train.tokens.shape[1] != cfg.seq_len or held_out.tokens.shape[1] != cfg.seq_len:
            raise ValueError(f"sequences must be padded to seq_len={cfg.seq_len}")
        if len(train) == 0 or len(held_out) == 0:
            raise ValueError("no training or held-out sequences")
        self.config, self.cfg, self.train, self.held_out = config, cfg, train, held_out
        self.out = pathlib.Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.mesh = jax.sharding.Mesh(np.asarray(self.devices), ("data",))
        self.rows = NamedSharding(self.mesh, P("data"))
        self.replicated = NamedSharding(self.mesh, P())
        head = init if init is not None else EagleHead(config, rngs=nnx.Rngs(cfg.seed))
        self.head_graphdef, params = nnx.split(head, nnx.Param)
        self.params = jax.device_put(params, self.replicated)
        self.target_graphdef, target_params = nnx.split(target)
        self.target_params = jax.device_put(target_params, self.replicated)
        self.ids = jax.device_put(jnp.asarray(draft_ids, jnp.int32), self.replicated)
        self.draft_ids = np.asarray(draft_ids, np.int32)
        self.tx = optax.chain(optax.clip_by_global_norm(cfg.clip), optax.adamw(
            optax.warmup_cosine_decay_schedule(0.0, cfg.lr, cfg.warmup, cfg.steps, end_value=cfg.lr * cfg.final_lr),
            weight_decay=cfg.weight_decay))
        self.opt_state = jax.device_put(self.tx.init(self.params), self.replicated)
        self.train_step, self.eval_step = make_steps(self.head_graphdef, self.target_graphdef, config, cfg, self.tx)
        self.step = 0
        self.elapsed = 0.0
        train_cfg = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in _BOOKKEEPING}
        self.run = json.loads(json.dumps(dict(  # as it reads back from a checkpoint (tuples -> lists)
            run_info or {}, train=train_cfg, eagle=config.to_dict(),
            draft_ids=int((np.asarray(draft_ids, np.int64) * np.arange(1, len(draft_ids) + 1)).sum()))))
        self.ckpts = TrainCheckpoints(self.out / "checkpoints", keep=cfg.keep)

    @property
    def head(self) -> EagleHead:
        return nnx.merge(self.head_graphdef, self.params)

    def _batch(self, data: Sequences, rows: np.ndarray):
        return (jax.device_put(jnp.asarray(data.tokens[rows]), self.rows),
                jax.device_put(jnp.asarray(data.mask[rows]), self.rows))

    def fit(self, *, stop_at: int | None = None, max_seconds: float | None = None, progress: bool = True) -> dict:
        """Trains to `stop_at` (default: all steps) or until `max_seconds` pass; returns held-out metrics."""
        from tqdm import tqdm

        cfg = self.cfg
        end = min(cfg.steps, stop_at or cfg.steps)
        t_start = time.perf_counter()
        if self.step == 0 and self.run.get("init"):  # what the starting head does on this data
            self._log(dict(step=0, held_out=self.evaluate()))
        bar = tqdm(total=end, initial=self.step, disable=not progress, desc="eagle", unit="step")
        sums = None
        while self.step < end:
            t0 = time.perf_counter()
            rows = batch_indices(len(self.train), cfg.batch_size, cfg.seed, self.step)
            tokens, mask = self._batch(self.train, rows)
            key = jax.random.fold_in(jax.random.key(cfg.seed), self.step)
            self.params, self.opt_state, m = self.train_step(self.params, self.opt_state, self.target_params,
                                                             self.ids, tokens, mask, key)
            self.step += 1
            m = jax.device_get(m)
            sums = m if sums is None else jax.tree.map(np.add, sums, m)
            self.elapsed += time.perf_counter() - t0
            bar.update(1)
            if self.step % cfg.log_every == 0 or self.step == end:
                s = summarize(sums)
                bar.set_postfix(loss=f"{float(m['loss']):.3f}", acc0=s["acc"][0])
                self._log(dict(step=self.step, loss=round(float(m["loss"]), 4), train=s,
                               elapsed_s=round(self.elapsed, 1)))
                sums = None
            if self.step % cfg.save_every == 0 or self.step == end:
                self.save()
            if self.step % cfg.eval_every == 0 and self.step < end:
                self._log(dict(step=self.step, held_out=self.evaluate()))
            if max_seconds is not None and time.perf_counter() - t_start > max_seconds:
                self.save()
                break
        bar.close()
        metrics = self.evaluate()
        self._log(dict(step=self.step, held_out=metrics))
        return metrics

    def evaluate(self, data: Sequences | None = None) -> dict:
        """Held-out per-position acceptance (see the module docstring), cross-entropy and tau."""
        data = data or self.held_out
        b = self.cfg.batch_size
        sums = None
        for lo in range(0, len(data), b):
            rows = np.arange(lo, lo + b) % len(data)
            tokens, mask = self._batch(data, rows)
            valid = np.arange(lo, lo + b) < len(data)
            mask = mask & jax.device_put(jnp.asarray(valid)[:, None], self.rows)
            m = jax.device_get(self.eval_step(self.params, self.target_params, self.ids, tokens, mask))
            sums = m if sums is None else jax.tree.map(np.add, sums, m)
        return summarize(sums)


def train_eagle(model: str, out: str | pathlib.Path, *, eagle: EagleConfig | dict | None = None,
                cfg: EagleTrainConfig = EagleTrainConfig(), conversations: int | None = None,
                eval_conversations: int = 64, max_minutes: float | None = None, data: str = "sharegpt",
                init: str | pathlib.Path | None = None, progress: bool = True, log=print) -> dict:
    """The whole recipe: ShareGPT under the chat template, teacher-forced, a head saved in `out`.

    Args:
      model: registry name or path of the target.
      out: run directory: the head (`manifest.json`, for `--eagle out`), `checkpoints/`, `metrics.jsonl`.
      eagle: `EagleConfig` or its fields other than the target's shape.
      cfg: optimisation settings.
      conversations: training conversations (default: as many as the steps read once);
        `eval_conversations` more, read first from the file, are held out.
      max_minutes: stop training after this long (checkpointed; run again to continue).
      data: "sharegpt" (complete conversations, teacher-forced) or "self" (ShareGPT prompts with
        the target's own greedy answers, generated once and cached).
      init: a head directory to start from (its config and draft vocabulary are kept).
    """
    from specjax.engine import Engine

    if data not in ("sharegpt", "self"):
        raise ValueError(f"data={data!r}: use 'sharegpt' or 'self'")
    engine = Engine.load(model)
    start = None
    if init is not None:
        head, init_ids, _ = eagle_io.load_head(init, model_name=engine.name, weights_id=engine.weights_id)
        start, eagle = head, head.config
    if not isinstance(eagle, EagleConfig):
        eagle = EagleConfig.for_model(engine.config, **(eagle or {}))
    n_train = conversations or cfg.steps * cfg.batch_size
    t0 = time.perf_counter()
    if data == "self":
        items = self_distilled_sequences(engine, eval_conversations + n_train, cfg.seq_len, log=log)
    else:
        items = list(sharegpt_sequences(engine.tokenizer, eval_conversations + n_train, cfg.seq_len))
    if len(items) <= eval_conversations:
        raise ValueError(f"only {len(items)} usable conversations: fewer than eval_conversations + 1")
    held_out = Sequences.pad(items[:eval_conversations], cfg.seq_len)
    train = Sequences.pad(items[eval_conversations:], cfg.seq_len)
    log(f"{len(train)} training conversations ({train.num_tokens} assistant tokens), {len(held_out)} held out; "
        f"encoded in {time.perf_counter() - t0:.0f}s")
    ids = (init_ids if start is not None else
           draft_vocabulary(train.tokens, train.mask, eagle.draft_vocab, engine.config.vocab_size))
    run_info = dict(model=engine.name, weights_id=engine.weights_id, conversations=len(train),
                    eval_conversations=len(held_out), data=data, init=None if init is None else str(init))
    trainer = EagleTrainer(eagle, engine.model, train, held_out, ids, out, cfg, run_info=run_info, init=start)
    if trainer.resume():
        log(f"resumed from step {trainer.step}")
    if trainer.step < cfg.steps:
        metrics = trainer.fit(max_seconds=None if max_minutes is None else 60 * max_minutes, progress=progress)
    else:
        metrics = trainer.evaluate()
    trainer.ckpts.close()
    covered = min(trainer.step * cfg.batch_size, len(train))
    manifest = dict(
        model=engine.name, weights_id=engine.weights_id,
        init=None if init is None else str(init),
        data=dict(source="ShareGPT V3 (complete conversations, chat template, teacher-forced)" if data == "sharegpt"
                  else "ShareGPT V3 first human turns + the target's own greedy answers (128 tokens), teacher-forced",
                  conversations=len(train), eval_conversations=len(held_out), seq_len=cfg.seq_len,
                  assistant_tokens=train.num_tokens,
                  trained_tokens=int(trainer.step * cfg.batch_size * train.num_tokens / max(len(train), 1)),
                  conversations_seen=int(trainer.step * cfg.batch_size), distinct_conversations_seen=covered),
        train=dataclasses.asdict(cfg), steps=trainer.step, train_time_s=round(trainer.elapsed, 1),
        devices=len(trainer.devices), metrics=metrics)
    eagle_io.save_head(out, trainer.head, ids, manifest)
    log(f"EAGLE head saved to {out}: held-out acceptance by position {metrics['acc']}, chain tau {metrics['chain_tau']}")
    return manifest
