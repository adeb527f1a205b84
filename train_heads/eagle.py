"""Training EAGLE heads on the frozen target's own distributions, teacher-forced over ShareGPT.

Data: complete ShareGPT conversations rendered with the target's chat template, cut to `seq_len`
tokens; the loss is taken where the predicted token is an assistant token. The target's side of
each position (its features, final hidden state, log-sum-exp and argmax) comes either from the
frozen target run inside the jitted step (`Sequences`) or from a feature cache written once by
`train_heads.cache.extract` (`CachedSequences`, many times faster per step); both feed the
same loss. The target's distribution over the draft vocabulary is rebuilt from its final hidden
state at t + 1 by the frozen LM head's rows: p = exp(h W_ids - lse).

Only the positions that train go through the LM head and the loss: their rows are gathered first
(the batch's count is rounded up to a few static sizes, so few shapes compile).

Loss, per unrolled step j (weight `step_weights[j]`, default `step_decay ** j`; `EagleHead.unroll`):
- the cross-entropy of the head's distribution q against the target's p: over the draft vocabulary,
  plus the rest-of-vocabulary mass 1 - sum(p) as one more class for `rest_class` heads (then it is
  KL(p || q) up to p's entropy, reported as `kl`); without it, p is not renormalised and the mass
  outside the draft vocabulary is not asked for;
- `feature_weight` x smooth L1 of the predicted feature against the head's own input at t + 1
  (`lift` of the target's features, held fixed): the final hidden state for "final" heads; for
  "fused" heads the fused taps, the input that the prediction replaces at the next unrolled step.
Input features get uniform noise of amplitude `noise` (EAGLE's recipe). AdamW (b2 `b2`, 0.95 as in
EAGLE) on a warmup-cosine schedule.

A non-finite loss stops the run with its step named, before anything is saved.

Held-out metrics per draft position j + 1: `acc[j]`, how often the head's top token equals the
target's argmax when the context before it is right (a greedy chain's conditional acceptance at
that position), and the chain tau those rates imply.

Resuming a run reproduces the uninterrupted one: the batch of step s and its noise depend only on
the seed and s.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import pathlib
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from specjax.models import eagle as eagle_model
from specjax.models import eagle_io
from specjax.models.eagle import EagleConfig, EagleHead
from specjax.serving.engine import Engine
from train_heads import cache as feature_cache
from train_heads.cache import CachedSequences, EpochLoader
from train_heads.checkpoint import ResumableRun, TrainCheckpoints, run_settings
from train_heads.sequences import Sequences, corpus, draft_vocabulary


@dataclasses.dataclass(frozen=True, kw_only=True)
class EagleTrainConfig:
    """Optimisation and bookkeeping of an EAGLE head run.

    Attributes:
      steps: optimiser steps (the cosine schedule spans them).
      batch_size: sequences per step over all devices (a multiple of the device count).
      seq_len: tokens per sequence (longer conversations are cut, shorter ones padded).
      lr, warmup, final_lr, weight_decay, clip: AdamW on a warmup-cosine schedule after clipping.
      unroll: steps of the training-time test (1 = teacher forcing only).
      step_decay: loss weight of unrolled step j is step_decay ** j (unless `step_weights`).
      step_weights: the loss weight of each unrolled step, one per step (overrides step_decay).
      b2: Adam's second-moment decay.
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
    step_weights: tuple[float, ...] | None = None
    b2: float = 0.95
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
        if self.step_weights is not None:
            object.__setattr__(self, "step_weights", tuple(float(w) for w in self.step_weights))
            if len(self.step_weights) != self.unroll or any(not (w >= 0 and math.isfinite(w)) for w in self.step_weights):
                raise ValueError(f"step_weights={self.step_weights}: give {self.unroll} (unroll) finite weights >= 0")
        if not 0 < self.b2 < 1:
            raise ValueError(f"b2={self.b2}: must be in (0, 1)")

    def weight(self, j: int) -> float:
        return self.step_weights[j] if self.step_weights is not None else self.step_decay**j


# ---- the jitted pieces ----------------------------------------------------------------------------


def teacher(target, config: EagleConfig, tokens):
    """The frozen target over a batch: (features, final hidden, log-sum-exp, argmax) at every position."""
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    out, feats = eagle_model.target_features(target, config, tokens, positions,
                                             target.init_cache(b, t))
    logits = out.logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    top = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.lax.stop_gradient((feats, out.hidden, lse, top))


def cached_teacher(config: EagleConfig, batch: dict):
    """`teacher`'s output read from a feature-cache batch (`CachedSequences`)."""
    hidden = batch["hidden"].astype(jnp.float32)
    feats = hidden if config.features == "final" else batch["taps"].astype(jnp.float32)
    return feats, hidden, batch["lse"], batch["top"]


def num_rows(mask: np.ndarray) -> int:
    """The static row count the loss gathers for a batch with this (host) mask: the positions that
    train (`mask[:, 2:]`) rounded up to a power of two (at least 64), at most all of them. Each
    count is one compiled step, and a compile costs minutes on a loaded CPU; the padding rows cost
    only LM-head rows (the head's layer runs over every position anyway)."""
    b, t = mask.shape
    n = max(int(np.asarray(mask)[:, 2:].sum()), 1)
    return int(min(max(1 << (n - 1).bit_length(), 64), b * (t - 2)))


def soft_cross_entropy(logits, rest_logit, log_p):
    """(cross-entropy, entropy of the target, log q over the draft vocabulary) per row.

    `log_p` [N, Vd]: the target's log-probabilities of the draft tokens (not renormalised); the rest of
    its mass, 1 - sum(p), is one more class when `rest_logit` [N] is given (the head's score for "a
    token outside the draft vocabulary"), so cross-entropy minus entropy is KL over Vd + 1 classes.
    Without it the rest mass is not asked for (p is not renormalised)."""
    p = jnp.exp(log_p)
    ent = -jnp.sum(p * log_p, axis=-1)
    if rest_logit is None:
        lq = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.sum(p * lq, axis=-1), ent, lq
    rest = jnp.clip(1.0 - jnp.sum(p, axis=-1), 0.0, 1.0)
    ent = ent - jnp.where(rest > 0, rest * jnp.log(jnp.where(rest > 0, rest, 1.0)), 0.0)
    lq_all = jax.nn.log_softmax(jnp.concatenate([logits, rest_logit[:, None]], axis=-1), axis=-1)
    return -jnp.sum(p * lq_all[:, :-1], axis=-1) - rest * lq_all[:, -1], ent, lq_all[:, :-1]


def losses(head: EagleHead, embed, w_ids, ids, teach, tokens, mask, key, cfg: EagleTrainConfig,
           *, noise: float, rows: int):
    """(loss, metrics) of a batch; metrics are sums per unrolled step (divide by `count`).

    Position t's head output predicts x_{t+2} (it read f_t and x_{t+1}); it trains where x_{t+2}
    does (`mask[:, 2:]`). Those positions' rows (`rows` of them, static) are gathered before the LM
    head; unrolled step j counts the ones with t >= j.
    """
    feats, hidden, lse, top = teach
    b, t = tokens.shape
    m = t - 2
    f = head.lift(feats)
    target_feat = jax.lax.stop_gradient(f).astype(jnp.float32)  # the head's input at t + 1
    if noise:
        f = f + jax.random.uniform(key, f.shape, f.dtype, -noise, noise)
    nxt = jnp.concatenate([tokens[:, 1:], tokens[:, :1] * 0], axis=1)  # token t + 1 at entry t
    emb = jnp.take(embed, nxt, axis=0)
    outs = head.unroll(f, emb, cfg.unroll)

    valid0 = mask[:, 2:].reshape(b * m)
    idx = jnp.nonzero(valid0, size=rows, fill_value=0)[0]
    live = jnp.arange(rows) < jnp.sum(valid0)
    pos = idx % m

    def at_next(x):  # the entry for position t + 1 of each gathered row
        return x[:, 1: t - 1].reshape((b * m,) + x.shape[2:])[idx]

    h_next = at_next(hidden).astype(jnp.float32)
    log_p = jnp.einsum("BD,VD->BV", h_next, w_ids.astype(jnp.float32)) - at_next(lse)[:, None]
    log_p = jnp.where(live[:, None], log_p, -30.0)  # padding rows (row 0 repeated): finite, and weighed 0
    top_next, feat_next = at_next(top), at_next(target_feat)

    total = 0.0
    ce, kl, acc, feat, count = [], [], [], [], []
    for j, out in enumerate(outs):
        o = out[:, :m].reshape(b * m, -1)[idx]
        rest_logit = head.rest_logit(o).astype(jnp.float32) if head.config.rest_class else None
        c, ent, lq = soft_cross_entropy(head.logits(o, w_ids).astype(jnp.float32), rest_logit, log_p)
        fl = jnp.mean(optax.huber_loss(o.astype(jnp.float32), feat_next), axis=-1)
        hit = (jnp.take(ids, jnp.argmax(lq, axis=-1)) == top_next).astype(jnp.float32)
        valid = (live & (pos >= j)).astype(jnp.float32)
        n = jnp.maximum(valid.sum(), 1.0)
        total = total + cfg.weight(j) * (jnp.sum(c * valid) + cfg.feature_weight * jnp.sum(fl * valid)) / n
        ce.append(jnp.sum(c * valid))
        kl.append(jnp.sum((c - ent) * valid))
        acc.append(jnp.sum(hit * valid))
        feat.append(jnp.sum(fl * valid))
        count.append(valid.sum())
    metrics = dict(ce=jnp.stack(ce), kl=jnp.stack(kl), acc=jnp.stack(acc), feat=jnp.stack(feat),
                   count=jnp.stack(count))
    return total, metrics


def make_steps(head_graphdef, target_graphdef, config: EagleConfig, cfg: EagleTrainConfig, tx, *, cached: bool):
    """(train_step, eval_step). `frozen` is the target's parameters (the target runs inside the step),
    or, for `cached`, dict(embed, w_ids): the embedding and the LM head's draft rows."""

    def run_teacher(frozen, ids, batch):
        if cached:
            return cached_teacher(config, batch), frozen["embed"], frozen["w_ids"]
        target = nnx.merge(target_graphdef, frozen)
        return teacher(target, config, batch["tokens"]), target.embedding(), eagle_model.lm_rows(target, ids)

    @functools.partial(jax.jit, static_argnames=("rows",))
    def train_step(params, opt_state, frozen, ids, batch, key, *, rows):
        teach, embed, w_ids = run_teacher(frozen, ids, batch)

        def loss_fn(p):
            return losses(nnx.merge(head_graphdef, p), embed, w_ids, ids, teach, batch["tokens"], batch["mask"],
                          key, cfg, noise=cfg.noise, rows=rows)

        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, dict(metrics, loss=loss)

    @functools.partial(jax.jit, static_argnames=("rows",))
    def eval_step(params, frozen, ids, batch, *, rows):
        teach, embed, w_ids = run_teacher(frozen, ids, batch)
        _, metrics = losses(nnx.merge(head_graphdef, params), embed, w_ids, ids, teach, batch["tokens"],
                            batch["mask"], jax.random.key(0), cfg, noise=0.0, rows=rows)
        return metrics

    return train_step, eval_step


def summarize(sums: dict) -> dict:
    """Per-position rates from summed metrics, and the greedy chain tau they imply."""
    count = np.maximum(np.asarray(sums["count"]), 1.0)
    acc = np.asarray(sums["acc"]) / count
    tau = 1.0 + float(np.sum(np.cumprod(acc)))
    per = lambda k: [round(float(c), 4) for c in np.asarray(sums[k]) / count]
    return dict(acc=[round(float(a), 4) for a in acc], ce=per("ce"), kl=per("kl"), feat=per("feat"),
                chain_tau=round(tau, 3), tokens=int(count[0]))


# ---- the trainer -----------------------------------------------------------------------------------


class EagleTrainer(ResumableRun):
    """A resumable EAGLE head run: `fit` (`ResumableRun.fit`, the one loop), `evaluate`, `save`;
    checkpoints and metrics in `out`.

    `train` and `held_out` are both `Sequences` (the target runs inside each step) or both
    `CachedSequences` (the target's side read from a feature cache). The data loader's position is
    saved in every checkpoint.
    """

    eval_key, desc = "held_out", "eagle"

    def __init__(self, config: EagleConfig, target, train, held_out, draft_ids,
                 out: str | pathlib.Path, cfg: EagleTrainConfig, *, run_info: dict | None = None,
                 init: EagleHead | None = None):
        self.devices = jax.devices()
        if cfg.batch_size % len(self.devices):
            raise ValueError(f"batch_size={cfg.batch_size} does not divide over {len(self.devices)} devices: "
                             f"use a multiple of {len(self.devices)}")
        self.cached = isinstance(train, CachedSequences)
        if self.cached != isinstance(held_out, CachedSequences):
            raise ValueError("train and held_out must both come from a feature cache, or neither")
        if self.cached:
            if config.features == "fused" and tuple(train.cache.taps) != tuple(config.feature_layers):
                raise ValueError(f"the head reads layers {config.feature_layers}; the cache holds taps "
                                 f"{train.cache.taps or 'none'}: extract with --features fused and these layers")
            if train.cache.index["dim"] != config.dim:
                raise ValueError(f"the cache holds features of size {train.cache.index['dim']}, the head has {config.dim}")
        elif train.tokens.shape[1] != cfg.seq_len or held_out.tokens.shape[1] != cfg.seq_len:
            raise ValueError(f"sequences must be padded to seq_len={cfg.seq_len}")
        if len(train) == 0 or len(held_out) == 0:
            raise ValueError("no training or held-out sequences")
        self.config, self.cfg, self.schedule, self.train, self.held_out = config, cfg, cfg, train, held_out
        self.out = pathlib.Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.mesh = jax.sharding.Mesh(np.asarray(self.devices), ("data",))
        self.rows = NamedSharding(self.mesh, P("data"))
        self.replicated = NamedSharding(self.mesh, P())
        head = init if init is not None else EagleHead(config, rngs=nnx.Rngs(cfg.seed))
        self.head_graphdef, params = nnx.split(head, nnx.Param)
        self.params = jax.device_put(params, self.replicated)
        self.target_graphdef, target_params = nnx.split(target)
        self.ids = jax.device_put(jnp.asarray(draft_ids, jnp.int32), self.replicated)
        if self.cached:  # only what the loss needs of the target: its embedding and LM-head rows
            self.frozen = jax.device_put(dict(embed=target.embedding(), w_ids=eagle_model.lm_rows(target, self.ids)),
                                         self.replicated)
        else:
            self.frozen = jax.device_put(target_params, self.replicated)
        self.draft_ids = np.asarray(draft_ids, np.int32)
        self.tx = optax.chain(optax.clip_by_global_norm(cfg.clip), optax.adamw(
            optax.warmup_cosine_decay_schedule(0.0, cfg.lr, cfg.warmup, cfg.steps, end_value=cfg.lr * cfg.final_lr),
            b2=cfg.b2, weight_decay=cfg.weight_decay))
        self.opt_state = jax.device_put(self.tx.init(self.params), self.replicated)
        self.train_step, self.eval_step = make_steps(self.head_graphdef, self.target_graphdef, config, cfg, self.tx,
                                                     cached=self.cached)
        self.loader = EpochLoader(len(train), cfg.batch_size, cfg.seed)
        self.step = 0
        self.elapsed = 0.0
        train_cfg = run_settings(cfg)
        self.run = json.loads(json.dumps(dict(  # as it reads back from a checkpoint (tuples -> lists)
            run_info or {}, train=train_cfg, eagle=config.to_dict(),
            draft_ids=int((np.asarray(draft_ids, np.int64) * np.arange(1, len(draft_ids) + 1)).sum()))))
        self.ckpts = TrainCheckpoints(self.out / "checkpoints", keep=cfg.keep)

    @property
    def head(self) -> EagleHead:
        return nnx.merge(self.head_graphdef, self.params)

    def _batch(self, data, rows: np.ndarray, valid: np.ndarray | None = None) -> tuple[dict, int]:
        """(the batch of `rows` on the devices, its static loss-row count); `valid` masks rows out."""
        if self.cached:
            host = data.cache.batch(data.ids[rows], self.cfg.seq_len, taps=self.config.features == "fused")
        else:
            host = dict(tokens=data.tokens[rows], mask=data.mask[rows])
        if valid is not None:
            host["mask"] = host["mask"] & valid[:, None]
        return jax.device_put({k: jnp.asarray(v) for k, v in host.items()}, self.rows), num_rows(host["mask"])

    def fit(self, *, stop_at: int | None = None, max_seconds: float | None = None, progress: bool = True) -> dict:
        """`ResumableRun.fit`; a run from `--init` first logs what the starting head does on this data."""
        if self.step == 0 and self.run.get("init"):
            self._log(dict(step=0, held_out=self.evaluate()))
        return super().fit(stop_at=stop_at, max_seconds=max_seconds, progress=progress)

    def train_step_once(self) -> tuple[dict, dict, dict]:
        batch, rows = self._batch(self.train, self.loader.next())
        key = jax.random.fold_in(jax.random.key(self.cfg.seed), self.step)
        params, opt_state, m = self.train_step(self.params, self.opt_state, self.frozen, self.ids, batch, key, rows=rows)
        return params, opt_state, jax.device_get(m)

    def record(self, metrics: list[dict], seconds: float) -> tuple[dict, dict]:
        """The last step's loss; per-position acceptance and cross-entropy summed over the steps since the
        last line, and the positions trained per second."""
        sums = functools.reduce(lambda a, b: jax.tree.map(np.add, a, b), metrics)
        s = summarize(sums)
        rate = float(np.asarray(sums["count"])[0]) / max(seconds, 1e-9)
        loss = float(metrics[-1]["loss"])
        line = dict(loss=round(loss, 4), train=s, elapsed_s=round(self.elapsed, 1), positions_per_s=round(rate, 1))
        return line, dict(loss=f"{loss:.3f}", acc0=s["acc"][0], pos_s=f"{rate:.0f}")

    def evaluate(self, data=None) -> dict:
        """Held-out per-position acceptance (see the module docstring), cross-entropy and tau."""
        data = data or self.held_out
        b = self.cfg.batch_size
        sums = None
        for lo in range(0, len(data), b):
            rows = np.arange(lo, lo + b) % len(data)
            batch, n = self._batch(data, rows, valid=np.arange(lo, lo + b) < len(data))
            m = jax.device_get(self.eval_step(self.params, self.frozen, self.ids, batch, rows=n))
            sums = m if sums is None else jax.tree.map(np.add, sums, m)
        return summarize(sums)


def extract_cache(model: str, out: str | pathlib.Path, *, data: str = "sharegpt", conversations: int = 1024,
                  seq_len: int = 2048, features: str = "final", feature_layers: Sequence[int] = (),
                  dtype: str = "bfloat16", shard_size: int = 64, batch_size: int = 4, multiple: int = 256,
                  max_minutes: float | None = None, progress: bool = True, log=print) -> dict:
    """`specjax train-heads extract`: the corpus's target side into a feature cache at `out`
    (`train_heads.cache`); run again to resume. Returns the index."""
    engine = Engine.load(model)
    taps = ()
    if features == "fused":
        taps = EagleConfig.for_model(engine.config, features="fused", feature_layers=tuple(feature_layers),
                                     draft_vocab=1).feature_layers
    t0 = time.perf_counter()
    items = corpus(engine, data, conversations, seq_len, log=log)
    log(f"{len(items)} sequences, {sum(len(t) for t, _ in items)} positions "
        f"({sum(int(m.sum()) for _, m in items)} that train); encoded in {time.perf_counter() - t0:.0f}s")
    meta = dict(model=engine.name, weights_id=engine.weights_id, data=data, seq_len=seq_len,
                source="ShareGPT V3 (complete conversations, chat template)" if data == "sharegpt"
                else "ShareGPT V3 first human turns + the target's own greedy answers (chat template)")
    per_shard = None
    if max_minutes is not None:  # time box: shards are whole, so stop between them
        deadline = time.perf_counter() + 60 * max_minutes
        index = None
        while time.perf_counter() < deadline:
            index = feature_cache.extract(engine.model, items, out, meta=meta, taps=taps, dtype=dtype,
                                  shard_size=shard_size, batch_size=batch_size, multiple=multiple,
                                  max_shards=per_shard or 1,
                                  progress=progress, log=log)
            per_shard = 1
            if index["complete"]:
                break
        return index
    return feature_cache.extract(engine.model, items, out, meta=meta, taps=taps, dtype=dtype, shard_size=shard_size,
                         batch_size=batch_size, multiple=multiple, progress=progress, log=log)


def _training_data(engine, fc, data: str, cfg: EagleTrainConfig, conversations: int | None,
                   eval_conversations: int, log):
    """(train, held out, source): from the feature cache `fc`, or the corpus `data` read now."""
    if fc is not None:
        n_all = len(fc) if conversations is None else min(len(fc), eval_conversations + conversations)
        if n_all <= eval_conversations:
            raise ValueError(f"the cache holds {len(fc)} sequences: fewer than eval_conversations + 1")
        return (feature_cache.CachedSequences(fc, np.arange(eval_conversations, n_all)),
                feature_cache.CachedSequences(fc, np.arange(eval_conversations)), fc.meta.get("source", "feature cache"))
    n_train = conversations or cfg.steps * cfg.batch_size
    items = corpus(engine, data, eval_conversations + n_train, cfg.seq_len, log=log)
    if len(items) <= eval_conversations:
        raise ValueError(f"only {len(items)} usable conversations: fewer than eval_conversations + 1")
    source = ("ShareGPT V3 (complete conversations, chat template, teacher-forced)" if data == "sharegpt"
              else "ShareGPT V3 first human turns + the target's own greedy answers (128 tokens), teacher-forced")
    return Sequences.pad(items[eval_conversations:], cfg.seq_len), Sequences.pad(items[:eval_conversations],
                                                                                  cfg.seq_len), source


def _manifest(engine, trainer, train, held_out, cfg: EagleTrainConfig, metrics: dict, data_info: dict,
              init) -> dict:
    """What the saved head records of its training."""
    covered = min(trainer.step * cfg.batch_size, len(train))
    return dict(
        model=engine.name, weights_id=engine.weights_id,
        init=None if init is None else str(init),
        data=dict(data_info, conversations=len(train), eval_conversations=len(held_out), seq_len=cfg.seq_len,
                  assistant_tokens=train.num_tokens,
                  trained_tokens=int(trainer.step * cfg.batch_size * train.num_tokens / max(len(train), 1)),
                  conversations_seen=int(trainer.step * cfg.batch_size), distinct_conversations_seen=covered),
        train=dataclasses.asdict(cfg), steps=trainer.step, train_time_s=round(trainer.elapsed, 1),
        devices=len(trainer.devices), metrics=metrics)


def _check_choices(vocab: str, data: str, cache) -> None:
    if vocab not in ("target", "data"):
        raise ValueError(f"vocab={vocab!r}: use 'target' or 'data'")
    if vocab == "target" and cache is None:
        raise ValueError("vocab='target' ranks by the target's argmax, which the feature cache holds: pass cache")
    if data not in ("sharegpt", "self"):
        raise ValueError(f"data={data!r}: use 'sharegpt' or 'self'")


def _open_cache(cache: str | pathlib.Path, log) -> feature_cache.FeatureCache:
    """The feature cache at `cache`; an incomplete one trains on its complete shards (they are whole
    and in order)."""
    fc = feature_cache.FeatureCache(cache, require_complete=False)
    if not fc.index["complete"]:
        log(f"the cache {cache} is incomplete: training on its {len(fc)} sequences in "
            f"{len(fc.index['shards'])} complete shards (a run resumes only on the same number)")
    return fc


def train_eagle(model: str, out: str | pathlib.Path, *, eagle: EagleConfig | dict | None = None,
                cfg: EagleTrainConfig = EagleTrainConfig(), conversations: int | None = None,
                eval_conversations: int = 64, max_minutes: float | None = None, data: str = "sharegpt",
                init: str | pathlib.Path | None = None, cache: str | pathlib.Path | None = None,
                vocab: str | None = None, progress: bool = True, log=print) -> dict:
    """The whole recipe: ShareGPT under the chat template, teacher-forced, a head saved in `out`.

    Args:
      model: registry name or path of the target.
      out: run directory: the head (`manifest.json`, for `--eagle out`), `checkpoints/`, `metrics.jsonl`.
      eagle: `EagleConfig` or its fields other than the target's shape.
      cfg: optimisation settings.
      conversations: training conversations (default: as many as the steps read once; with a cache,
        all of it); `eval_conversations` more, read first, are held out.
      max_minutes: stop training after this long (checkpointed; run again to continue).
      data: "sharegpt" (complete conversations, teacher-forced) or "self" (ShareGPT prompts with
        the target's own greedy answers, generated once and cached); ignored with `cache`.
      init: a head directory to start from (its config and draft vocabulary are kept).
      cache: a feature cache (`extract_cache`) to train from instead of running the target per step.
      vocab: how the draft vocabulary is ranked: "target" (the target's own argmax at the positions
        that train; needs `cache`, its default) or "data" (the training tokens; default without).
    """
    vocab = vocab or ("target" if cache is not None else "data")
    _check_choices(vocab, data, cache)
    fc = None if cache is None else _open_cache(cache, log)  # before the target loads: a bad cache fails first
    engine = Engine.load(model)
    if fc is not None and (fc.meta.get("model"), fc.meta.get("weights_id")) != (engine.name, engine.weights_id):
        raise ValueError(f"the cache {cache} was extracted from {fc.meta.get('model')} ({fc.meta.get('weights_id')}), "
                         f"not {engine.name} ({engine.weights_id})")
    start = None
    if init is not None:
        head, init_ids, _ = eagle_io.load_head(init, model_name=engine.name, weights_id=engine.weights_id)
        start, eagle = head, head.config
    if not isinstance(eagle, EagleConfig):
        eagle = EagleConfig.for_model(engine.config, **(eagle or {}))
    t0 = time.perf_counter()
    train, held_out, source = _training_data(engine, fc, data, cfg, conversations, eval_conversations, log)
    log(f"{len(train)} training conversations ({train.num_tokens} train positions), {len(held_out)} held out; "
        f"read in {time.perf_counter() - t0:.0f}s")
    if start is not None:
        ids = init_ids
    elif vocab == "target":
        ids = feature_cache.target_vocabulary(fc, train.ids, eagle.draft_vocab)
    else:
        ids = draft_vocabulary(train.tokens, train.mask, eagle.draft_vocab, engine.config.vocab_size)
    run_info = dict(model=engine.name, weights_id=engine.weights_id, conversations=len(train),
                    eval_conversations=len(held_out), data=data if fc is None else dict(cache=fc.index["corpus"]),
                    vocab=vocab, init=None if init is None else str(init))
    trainer = EagleTrainer(eagle, engine.model, train, held_out, ids, out, cfg, run_info=run_info, init=start)
    if trainer.resume():
        log(f"resumed from step {trainer.step}")
    metrics = (trainer.fit(max_seconds=None if max_minutes is None else 60 * max_minutes, progress=progress)
               if trainer.step < cfg.steps else trainer.evaluate())
    trainer.ckpts.close()
    data_info = dict(source=source, cache=None if fc is None else str(cache), vocab=vocab)
    manifest = _manifest(engine, trainer, train, held_out, cfg, metrics, data_info, init)
    eagle_io.save_head(out, trainer.head, ids, manifest)
    log(f"EAGLE head saved to {out}: held-out acceptance by position {metrics['acc']}, chain tau {metrics['chain_tau']}")
    return manifest
