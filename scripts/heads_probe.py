"""How far can a cheap head on SmolLM2-135M's hidden states go? A probe, not part of the library.

Trains one draft head for the token two positions ahead (head 0 of the Medusa heads) on the cached
self-distillation data that `specjax train-heads` builds, and reports its held-out top-1 accuracy
over the shipped heads' 8192-token subset. Two head kinds:

- `mlp`: the shipped head's shape: h_t + E[x_(t+1)] U, one residual SiLU block (zero-initialised);
- `attn`: an EAGLE-style draft layer: [h_t, E[x_(t+1)]] -> D, then one pre-norm decoder layer
  (causal attention over the conversation's earlier rows, SwiGLU MLP), trained on cross-entropy
  plus an L1 regression of h_(t+1), as EAGLE does.

`--fraction` trains on the first part of the training conversations only, for a data-scaling curve.
The held-out set is the last 64 conversations, as in `specjax train-heads`.

Usage: python scripts/heads_probe.py DATA_DIR --kind mlp|attn [--fraction F] [--steps N]
(DATA_DIR: ~/.cache/specjax/heads-data/smollm2-135m-...)
"""

import argparse
import json
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from specjax.models import loader
from specjax.models.config import preset
from specjax.models.layers.rope import inv_freq as rope_inv_freq, rope
from specjax.train_heads import data as hdata
from specjax.models.heads_io import shipped_heads_dir

ROWS = 128  # rows per conversation (the data's max_new_tokens)
HEADS, HEAD_DIM, FFN = 9, 64, 1536
INV_FREQ = rope_inv_freq(preset("smollm2-135m"))  # SmolLM2's RoPE (head_dim 64, theta 1e5)


def pack(td: hdata.TokenData, lo: int, hi: int):
    """Conversations lo..hi-1 as padded [C, ROWS] arrays: hidden, token, mask."""
    d = td.hidden.shape[1]
    h = np.zeros((hi - lo, ROWS, d), np.float16)
    x = np.zeros((hi - lo, ROWS), np.int32)
    m = np.zeros((hi - lo, ROWS), bool)
    for i, c in enumerate(range(lo, hi)):
        a, b = td.starts[c], td.starts[c + 1]
        n = min(b - a, ROWS)
        h[i, :n], x[i, :n], m[i, :n] = td.hidden[a:a + n], td.tokens[a:a + n], True
    return h, x, m


def init(kind: str, d: int, key):
    if kind == "mlp":
        return dict(u=jnp.zeros((d, d)), w=jnp.zeros((d, d)), b=jnp.zeros(d))
    ks = jax.random.split(key, 6)
    n = lambda k, shape: jax.random.normal(k, shape) * 0.02
    hd = HEADS * HEAD_DIM
    return dict(fc=n(ks[0], (2 * d, d)), g1=jnp.ones(d), g2=jnp.ones(d),
                wq=n(ks[1], (d, hd)), wk=n(ks[2], (d, hd)), wv=n(ks[3], (d, hd)), wo=jnp.zeros((hd, d)),
                w1=n(ks[4], (d, FFN)), w3=n(ks[5], (d, FFN)), w2=jnp.zeros((FFN, d)))


def _rms(x, g):
    return x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-5) * g


def features(kind: str, p, h_BTD, e_BTD):
    """What the head feeds to the LM head at each row: its guess of h_(t+1)."""
    if kind == "mlp":
        z = h_BTD + e_BTD @ p["u"]
        return z + jax.nn.silu(z @ p["w"] + p["b"])
    b, t, _ = h_BTD.shape
    z = jnp.concatenate([h_BTD, e_BTD], -1) @ p["fc"]
    a = _rms(z, p["g1"])
    pos_BT = jnp.broadcast_to(jnp.arange(t), (b, t))
    q = rope((a @ p["wq"]).reshape(b, t, HEADS, HEAD_DIM), pos_BT, INV_FREQ)
    k = rope((a @ p["wk"]).reshape(b, t, HEADS, HEAD_DIM), pos_BT, INV_FREQ)
    v = (a @ p["wv"]).reshape(b, t, HEADS, HEAD_DIM)
    s_BNTS = jnp.einsum("BTNH,BSNH->BNTS", q, k) / HEAD_DIM ** 0.5
    s_BNTS = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s_BNTS, -1e9)
    o = jnp.einsum("BNTS,BSNH->BTNH", jax.nn.softmax(s_BNTS, -1), v).reshape(b, t, -1)
    z = z + o @ p["wo"]
    a = _rms(z, p["g2"])
    return z + (jax.nn.silu(a @ p["w1"]) * (a @ p["w3"])) @ p["w2"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("data_dir")
    ap.add_argument("--kind", choices=("mlp", "attn"), default="mlp")
    ap.add_argument("--fraction", type=float, default=1.0)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--batch", type=int, default=16, help="conversations per step")
    args = ap.parse_args()
    if args.steps <= 30 or not 0 < args.fraction <= 1:
        ap.error("--steps must exceed the 30 warmup steps and --fraction lie in (0, 1]")

    embed = np.asarray(loader.load("smollm2-135m").model.embed[...], np.float32)
    subset = np.asarray(json.loads((shipped_heads_dir("smollm2-135m") / "vocab.json").read_text()), np.int32)
    remap = np.full(embed.shape[0], -1, np.int32)
    remap[subset] = np.arange(len(subset))
    head_DS, embed_VD, remap = jnp.asarray(embed[subset].T), jnp.asarray(embed), jnp.asarray(remap)

    td, _ = hdata.load(pathlib.Path(args.data_dir).expanduser())
    c = td.num_conversations
    train = pack(td, 0, int((c - 64) * args.fraction))
    held = pack(td, c - 64, c)
    print(f"kind={args.kind} train conversations {len(train[0])} ({int(train[2].sum())} rows), "
          f"held-out rows {int(held[2].sum())}", flush=True)

    def loss_fn(p, h, x, m):
        h = h.astype(jnp.float32)
        f = features(args.kind, p, h, embed_VD[x])[:, :-1]  # row r predicts token r + 1
        label, mask = remap[x[:, 1:]], m[:, 1:]
        logits = f @ head_DS
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.maximum(label, 0))
        reg = jnp.abs(f - h[:, 1:]).mean(-1) if args.kind == "attn" else 0.0
        loss = ((ce + reg) * mask).sum() / mask.sum()
        hits = ((logits.argmax(-1) == label) & mask).sum()
        return loss, (hits, mask.sum())

    opt = optax.chain(optax.clip_by_global_norm(1.0),
                      optax.adamw(optax.warmup_cosine_decay_schedule(0, 1e-3, 30, args.steps), weight_decay=0.0))
    p = init(args.kind, embed.shape[1], jax.random.key(0))
    state = opt.init(p)

    @jax.jit
    def step(p, state, h, x, m):
        (loss, _), g = jax.value_and_grad(loss_fn, has_aux=True)(p, h, x, m)
        u, state = opt.update(g, state, p)
        return optax.apply_updates(p, u), state, loss

    @jax.jit
    def hits(p, h, x, m):
        return loss_fn(p, h, x, m)[1]

    rng = np.random.default_rng(0)
    t0 = time.time()
    for i in range(args.steps + 1):
        if i % 100 == 0 or i == args.steps:
            n = d = 0
            for j in range(0, 64, 16):
                a, b = hits(p, *(jnp.asarray(v[j:j + 16]) for v in held))
                n, d = n + int(a), d + int(b)
            print(f"step {i}: held-out head-0 top-1 {n / d:.3f} ({time.time() - t0:.0f} s)", flush=True)
        if i < args.steps:
            idx = rng.choice(len(train[0]), args.batch, replace=False)
            p, state, loss = step(p, state, *(jnp.asarray(v[idx]) for v in train))


if __name__ == "__main__":
    main()
