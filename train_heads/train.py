"""Training Medusa heads on cached hidden states: one jitted, data-parallel step; resumable.

Loss (Medusa-1/2): `sum_m w**m * CE_m`, CE_m the mean cross-entropy of head m over the rows where its
label exists (response positions only; `TokenData.labels` marks the rest -1). AdamW with linear
warmup and cosine decay. The batch is sharded over the `data` axis of a `("data", "model")` mesh (by
default all devices on `data`); parameters and optimiser state are laid out by their logical axes
(`specjax.sharding`): replicated, except what is vocabulary-sized (an own projection, the frozen
base's embedding), which is split over `model`. XLA inserts the gradient all-reduce. Checkpoints are
saved sharded and restored onto whatever mesh the resuming run has.

Resuming is exact: the rows come from an `EpochLoader` (one seeded permutation per epoch) whose
position is saved in each checkpoint with the parameters and the full optimiser state (its step count
drives the schedule), so a run killed after its last checkpoint and restarted continues as the
uninterrupted run would. A non-finite loss stops the run with its step named, before anything is saved.

The rows come from the self-distilled data (`train_heads.data`) or from a feature cache
(`train_heads.cache.medusa_rows`, `train_heads(cache=...)`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxtyping import Array, Float, Int

from specjax import sharding
from specjax.models.heads import HeadsConfig, MedusaHeads
from specjax.serving.engine import Engine
from train_heads import cache as feature_cache, checkpoint, data
from train_heads.data import TokenData, permutation


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Optimisation and bookkeeping of a heads training run.

    Attributes:
      steps: optimiser steps in the whole run (the cosine schedule spans them).
      batch_size: rows (token positions) per step, over all devices; a multiple of the device count.
      lr: peak learning rate, reached after `warmup` steps, then cosine-decayed to `lr * final_lr`.
      warmup: linear warmup steps.
      final_lr: the schedule's end value as a fraction of `lr`.
      weight_decay: AdamW decoupled weight decay.
      head_decay: w in the loss weight w**m of head m.
      clip: global gradient-norm clip.
      eval_every: evaluate on the held-out rows every this many steps (and at the end).
      save_every: checkpoint every this many steps (and at the end).
      keep: checkpoints kept (the newest ones).
      log_every: write a training metrics line every this many steps.
      seed: seeds the data order.
    """

    steps: int = 1000
    batch_size: int = 256
    lr: float = 1e-3
    warmup: int = 50
    final_lr: float = 0.05
    weight_decay: float = 0.0
    head_decay: float = 0.8
    clip: float = 1.0
    eval_every: int = 200
    save_every: int = 100
    keep: int = 3
    log_every: int = 10
    seed: int = 0

    def __post_init__(self):
        for f in ("steps", "batch_size", "eval_every", "save_every", "keep", "log_every"):
            v = getattr(self, f)
            if int(v) != v or v < 1:
                raise ValueError(f"{f}={v}: must be an integer >= 1")
        if int(self.warmup) != self.warmup or not 0 <= self.warmup < self.steps:
            raise ValueError(f"warmup={self.warmup}: must be an integer in [0, steps={self.steps})")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"lr={self.lr}: must be a positive number")
        if not 0 <= self.final_lr <= 1:
            raise ValueError(f"final_lr={self.final_lr}: must be in [0, 1]")
        if not 0 < self.head_decay <= 1:
            raise ValueError(f"head_decay={self.head_decay}: must be in (0, 1]")
        if self.weight_decay < 0 or self.clip <= 0:
            raise ValueError("weight_decay must be >= 0 and clip > 0")


def schedule(config: TrainConfig) -> optax.Schedule:
    """Linear warmup from 0 to `lr`, then cosine decay to `lr * final_lr` at `steps`."""
    return optax.warmup_cosine_decay_schedule(
        0.0, config.lr, config.warmup, config.steps, end_value=config.lr * config.final_lr)


def optimizer(config: TrainConfig) -> optax.GradientTransformation:
    """AdamW on the schedule, after global-norm clipping."""
    return optax.chain(optax.clip_by_global_norm(config.clip),
                       optax.adamw(schedule(config), weight_decay=config.weight_decay))


def head_metrics(logits: Float[Array, "B M V"], labels: Int[Array, "B M"], *, topk: int = 1):
    """Per-head sums over valid rows: (nll, top-1 hits, top-k hits, count), each [M].

    Top-k by rank (how many logits beat the label's), which is a compare and a sum; `lax.top_k`
    over the vocabulary costs more than the projection on CPU.
    """
    mask = labels >= 0
    safe = jnp.maximum(labels, 0)
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, safe[..., None], axis=-1)[..., 0]
    top1 = jnp.argmax(logits, axis=-1) == safe
    label_logit = jnp.take_along_axis(logits, safe[..., None], axis=-1)
    topk_hit = jnp.sum(logits > label_logit, axis=-1) < topk
    f = lambda x: jnp.sum(jnp.where(mask, x, 0), axis=0).astype(jnp.float32)
    return f(nll), f(top1), f(topk_hit), f(jnp.ones_like(nll))


def loss_fn(params, graphdef, base, hidden, labels, head_decay: float, tokens=None):
    heads = nnx.merge(graphdef, params)
    logits = heads(hidden.astype(jnp.float32), base, tokens)
    nll, top1, _, count = head_metrics(logits, labels)
    ce = nll / jnp.maximum(count, 1.0)
    weights = head_decay ** jnp.arange(ce.shape[0], dtype=jnp.float32)
    return jnp.sum(weights * ce), (ce, top1 / jnp.maximum(count, 1.0))


def make_train_step(graphdef, base_graphdef, tx: optax.GradientTransformation, config: TrainConfig,
                    out_shardings=None):
    """The jitted step `(params, opt_state, base_params, hidden, labels, tokens) -> (params, opt_state,
    metrics)`; `tokens` (the token at t + 1 of each row) is read by `token_input` heads only.
    `out_shardings`: (params', opt_state') shardings to keep the state's layout step after step."""
    pin = {} if out_shardings is None else dict(out_shardings=(*out_shardings, None))

    @functools.partial(jax.jit, donate_argnums=(0, 1), **pin)
    def step(params, opt_state, base_params, hidden, labels, tokens):
        base = nnx.merge(base_graphdef, base_params)
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        (loss, (ce, acc)), grads = grad_fn(params, graphdef, base, hidden, labels, config.head_decay,
                                           tokens)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, dict(loss=loss, ce=ce, acc=acc)

    return step


def make_eval_step(graphdef, base_graphdef):
    @jax.jit
    def step(params, base_params, hidden, labels, next_tokens):
        base = nnx.merge(base_graphdef, base_params)
        hidden = hidden.astype(jnp.float32)
        sums = head_metrics(nnx.merge(graphdef, params)(hidden, base, jnp.maximum(next_tokens, 0)),
                            labels, topk=5)
        base_hit = jnp.sum(jnp.argmax(base.logits(hidden), axis=-1) == next_tokens)
        return sums, base_hit

    return step


def _like_params(abstract_opt, param_shardings, replicated):
    """Shardings of an optax state: every subtree shaped like the params (Adam's mu, nu) takes the
    params' shardings; counters and the rest are replicated."""
    structure = jax.tree.structure(param_shardings)
    is_params = lambda x: isinstance(x, dict) and jax.tree.structure(x) == structure
    return jax.tree.map(lambda x: param_shardings if is_params(x) else replicated, abstract_opt,
                        is_leaf=is_params)


def batch_rows(rows: np.ndarray, batch_size: int, seed: int, step: int) -> np.ndarray:
    """The rows of `step`: slice `step % E` of epoch `step // E`'s permutation (E batches an epoch)."""
    per_epoch = len(rows) // batch_size
    epoch, k = divmod(step, per_epoch)
    perm = permutation(len(rows), seed, epoch)
    return rows[perm[k * batch_size:(k + 1) * batch_size]]


class Trainer(checkpoint.ResumableRun):
    """Trains heads against a frozen base model on `TokenData`; writes checkpoints and metrics to `out`.
    `fit` is the run's loop (`checkpoint.ResumableRun.fit`); `stop_at` pauses it there, saved."""

    desc = "train heads"

    def __init__(self, heads_config: HeadsConfig, base: nnx.Module, train_data: TokenData,
                 eval_data: TokenData | None, out: str | pathlib.Path, config: TrainConfig, *, run_info=None,
                 mesh: Mesh | None = None):
        if train_data.hidden.shape[-1] != heads_config.dim:
            raise ValueError(f"data hidden size {train_data.hidden.shape[-1]} != heads dim {heads_config.dim}")
        self.hc, self.config, self.schedule, self.out = heads_config, config, config, pathlib.Path(out)
        self.mesh = sharding.check_mesh(mesh) or sharding.make_mesh(data=-1)  # default: all devices on data
        self.devices = list(self.mesh.devices.flat)
        dp = self.mesh.shape["data"]
        if config.batch_size % dp:
            raise ValueError(f"batch_size={config.batch_size} must be a multiple of the "
                             f"{dp} devices of the data axis")
        self.rows_sharding = NamedSharding(self.mesh, P("data"))
        self.replicated = NamedSharding(self.mesh, P())
        self.data, self.eval_data = train_data, eval_data
        self.labels = train_data.labels(heads_config.num_heads)
        self.rows = np.flatnonzero(self.labels[:, 0] >= 0)  # rows where at least head 0 has a label
        if len(self.rows) < config.batch_size:
            raise ValueError(f"{len(self.rows)} training rows < batch_size={config.batch_size}: more data "
                             "or a smaller batch")
        heads = MedusaHeads(heads_config, base=base, rngs=nnx.Rngs(config.seed))
        self.graphdef = nnx.graphdef(heads)
        self.base_graphdef, base_params = nnx.split(base)
        self.base_params = sharding.place_state(base_params, self.mesh)
        self.tx = optimizer(config)
        specs = sharding.param_specs(nnx.state(heads, nnx.Param), self.mesh)
        shard = lambda s: NamedSharding(self.mesh, s)
        self.param_shardings = jax.tree.map(shard, nnx.to_pure_dict(specs), is_leaf=lambda x: isinstance(x, P))
        self.params = jax.tree.map(sharding.put, checkpoint.params_of(heads), self.param_shardings)
        self.opt_shardings = _like_params(jax.eval_shape(self.tx.init, self.params), self.param_shardings,
                                          self.replicated)
        self.opt_state = jax.jit(self.tx.init, out_shardings=self.opt_shardings)(self.params)
        self.step = 0
        self.train_step = make_train_step(self.graphdef, self.base_graphdef, self.tx, config,
                                          out_shardings=(self.param_shardings, self.opt_shardings))
        self.eval_step = make_eval_step(self.graphdef, self.base_graphdef)
        self.run = dict(heads=dataclasses.asdict(heads_config), train=dataclasses.asdict(config),
                        rows=int(train_data.num_rows), **(run_info or {}))
        self.ckpts = checkpoint.TrainCheckpoints(self.out / "checkpoints", keep=config.keep)
        self.elapsed = 0.0
        self.loader = feature_cache.EpochLoader(len(self.rows), config.batch_size, config.seed)

    @property
    def heads(self) -> MedusaHeads:
        return checkpoint.heads_from_params(self.hc, sharding.host_view(self.params, self.mesh))

    def train_step_once(self) -> tuple[dict, dict, dict]:
        idx = self.rows[self.loader.next()]
        hidden = sharding.put(self.data.hidden[idx], self.rows_sharding)
        labels = sharding.put(self.labels[idx], self.rows_sharding)
        tokens = sharding.put(self.data.tokens[idx], self.rows_sharding)
        params, opt_state, m = self.train_step(self.params, self.opt_state, self.base_params, hidden, labels, tokens)
        return params, opt_state, sharding.host_view(m, self.mesh)

    def record(self, metrics: list[dict], seconds: float) -> tuple[dict, dict]:
        """The last step's loss, per-head cross-entropy and accuracy, and its learning rate."""
        m = metrics[-1]
        line = dict(loss=round(float(m["loss"]), 5), ce=m["ce"].round(4).tolist(), acc=m["acc"].round(4).tolist(),
                    lr=float(schedule(self.config)(self.step - 1)))
        return line, dict(loss=f"{float(m['loss']):.3f}", acc0=f"{float(m['acc'][0]):.3f}")

    @property
    def evaluates(self) -> bool:
        return self.eval_data is not None

    def evaluate(self, data: TokenData | None = None, *, batch_size: int = 512) -> dict:
        """Per-head top-1 / top-5 accuracy and cross-entropy on held-out rows (and the base's top-1)."""
        data = data if data is not None else self.eval_data
        labels = data.labels(self.hc.num_heads)
        dp = self.mesh.shape["data"]
        batch_size = -(-batch_size // dp) * dp
        totals, base_hits = None, 0
        for lo in range(0, data.num_rows, batch_size):
            sl = slice(lo, lo + batch_size)
            n = len(labels[sl])
            pad = lambda x, fill: np.concatenate([x, np.full((batch_size - n,) + x.shape[1:], fill, x.dtype)])
            sums, hit = self.eval_step(
                self.params, self.base_params, sharding.put(pad(data.hidden[sl], 0), self.rows_sharding),
                sharding.put(pad(labels[sl], -1), self.rows_sharding),
                sharding.put(pad(data.tokens[sl], -1), self.rows_sharding))
            sums, hit = sharding.host_view((sums, hit), self.mesh)
            sums = [np.asarray(s, np.float64) for s in sums]
            totals = sums if totals is None else [a + b for a, b in zip(totals, sums)]
            base_hits += int(hit)
        nll, top1, top5, count = totals
        count = np.maximum(count, 1)
        r = lambda x: [round(float(v), 4) for v in x]
        return dict(top1=r(top1 / count), top5=r(top5 / count), ce=r(nll / count), rows=int(data.num_rows),
                    base_top1=round(base_hits / max(data.num_rows, 1), 4))


def train_heads(model: str, out: str | pathlib.Path, *, heads: HeadsConfig | dict | None = None,
                config: TrainConfig = TrainConfig(), conversations: int = 1024, eval_conversations: int = 64,
                max_new_tokens: int = 128, max_prompt_tokens: int = 256, gen_batch_size: int = 16,
                progress: bool = True, log=print, mesh: Mesh | None = None, cache=None) -> dict:
    """The whole recipe: self-distilled ShareGPT data (cached), training (resumable), heads in `out`.

    Args:
      model: registry name or path of the target.
      out: run directory; gets `manifest.json` + `params-*/` (the heads, for `--heads out`),
        `checkpoints/` and `metrics.jsonl`.
      heads: `HeadsConfig` or its fields other than dim / vocab_size (default: 4 heads, 1 block).
      config: optimisation settings.
      conversations: ShareGPT prompts to distill; the last `eval_conversations` are held out.
      max_new_tokens, max_prompt_tokens, gen_batch_size: generation of the responses.
      mesh: the training mesh (`specjax.sharding.make_mesh`); default all devices on `data`.
      cache: a feature cache (`specjax train-heads extract`) to read the rows from instead of the
        self-distilled data: its first `eval_conversations` sequences are held out, the next
        `conversations` train (all of them when None).

    Returns:
      The manifest saved with the heads (its `metrics` hold the held-out accuracies).
    """
    if not 0 < eval_conversations < conversations:
        raise ValueError(f"eval_conversations={eval_conversations}: must be in [1, conversations={conversations})")
    engine = Engine.load(model)
    if not isinstance(heads, HeadsConfig):
        heads = HeadsConfig.for_model(engine.config, **(heads or {}))
    if cache is not None:
        return _train_heads_from_cache(engine, out, heads, config, cache, conversations, eval_conversations,
                                       progress=progress, log=log, mesh=mesh)
    data_dir = data.default_dir(engine.name, engine.weights_id, max_new_tokens=max_new_tokens,
                                max_prompt_tokens=max_prompt_tokens)
    log(f"self-distilled data: {data_dir}")
    data.build(engine, data_dir, conversations=conversations, max_new_tokens=max_new_tokens,
               batch_size=gen_batch_size, max_prompt_tokens=max_prompt_tokens, log=log)
    rows, index = data.load(data_dir)
    split = conversations - eval_conversations
    train_data, eval_data = rows.conversations(0, split), rows.conversations(split, conversations)
    run_info = dict(model=engine.name, weights_id=engine.weights_id, data=index["source_sha256"],
                    conversations=conversations, eval_conversations=eval_conversations)
    trainer, metrics = _fit(heads, engine, train_data, eval_data, out, config, run_info, progress=progress,
                            log=log, mesh=mesh)
    manifest = dict(
        model=engine.name, weights_id=engine.weights_id, num_heads=heads.num_heads,
        data=dict(source=index["source"], conversations=split, eval_conversations=eval_conversations,
                  train_tokens=int(train_data.num_rows), eval_tokens=int(eval_data.num_rows),
                  prompt_tokens=index["prompt_tokens"], max_new_tokens=max_new_tokens,
                  max_prompt_tokens=max_prompt_tokens, responses="target, greedy, chat template"),
        train=dataclasses.asdict(config), steps=trainer.step, train_time_s=round(trainer.elapsed, 1),
        devices=len(trainer.devices), metrics=metrics)
    checkpoint.save_heads(out, trainer.heads, manifest)
    log(f"heads saved to {out}: held-out top-1 {metrics.get('top1')}, top-5 {metrics.get('top5')}")
    return manifest


def _train_heads_from_cache(engine, out, heads: HeadsConfig, config: TrainConfig, cache, conversations,
                            eval_conversations: int, *, progress, log, mesh) -> dict:
    fc = feature_cache.FeatureCache(cache)
    if (fc.meta.get("model"), fc.meta.get("weights_id")) != (engine.name, engine.weights_id):
        raise ValueError(f"the cache {cache} was extracted from {fc.meta.get('model')}, not {engine.name}")
    n_all = len(fc) if conversations is None else min(len(fc), eval_conversations + conversations)
    if n_all <= eval_conversations:
        raise ValueError(f"the cache holds {len(fc)} sequences: fewer than eval_conversations + 1")
    eval_data = feature_cache.medusa_rows(fc, range(eval_conversations))
    train_data = feature_cache.medusa_rows(fc, range(eval_conversations, n_all))
    run_info = dict(model=engine.name, weights_id=engine.weights_id, cache=fc.index["corpus"],
                    conversations=n_all - eval_conversations, eval_conversations=eval_conversations)
    trainer, metrics = _fit(heads, engine, train_data, eval_data, out, config, run_info, progress=progress,
                            log=log, mesh=mesh)
    manifest = dict(
        model=engine.name, weights_id=engine.weights_id, num_heads=heads.num_heads,
        data=dict(source=fc.meta.get("source"), cache=str(cache), conversations=n_all - eval_conversations,
                  eval_conversations=eval_conversations, train_tokens=int(train_data.num_rows),
                  eval_tokens=int(eval_data.num_rows), responses="cached, teacher-forced"),
        train=dataclasses.asdict(config), steps=trainer.step, train_time_s=round(trainer.elapsed, 1),
        devices=len(trainer.devices), metrics=metrics)
    checkpoint.save_heads(out, trainer.heads, manifest)
    log(f"heads saved to {out}: held-out top-1 {metrics.get('top1')}, top-5 {metrics.get('top5')}")
    return manifest


def _fit(heads, engine, train_data, eval_data, out, config, run_info, *, progress, log, mesh):
    """Trains (or resumes, or only evaluates a finished run); returns the trainer and held-out metrics."""
    trainer = Trainer(heads, engine.model, train_data, eval_data, out, config, run_info=run_info, mesh=mesh)
    if trainer.resume():
        log(f"resumed from step {trainer.step}")
    metrics = trainer.fit(progress=progress) if trainer.step < config.steps else trainer.evaluate()
    trainer.ckpts.close()
    return trainer, metrics
