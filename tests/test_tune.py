"""Heads tuning: accuracy by rank, the frequent-token subset."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from train_heads.data import TokenData
from specjax.models.heads import HeadsConfig, MedusaHeads
from train_heads.tune import frequent_tokens, rank_accuracy


def test_frequent_tokens_orders_by_count_then_id():
    toks = np.array([5, 3, 5, 7, 3, 5, 9])
    assert frequent_tokens(toks, 3).tolist() == [5, 3, 7]
    assert frequent_tokens(toks, 10).tolist() == [5, 3, 7, 9]


def test_rank_accuracy_matches_a_direct_count(tiny_model):
    cfg = tiny_model.config
    heads = MedusaHeads(HeadsConfig.for_model(cfg, num_heads=2), rngs=nnx.Rngs(0))
    heads.w[...] = jax.random.normal(jax.random.key(1), heads.w.shape) * 0.3
    rng = np.random.default_rng(0)
    hidden = [rng.normal(size=(n, cfg.dim)).astype(np.float16) for n in (7, 5)]
    tokens = [rng.integers(0, cfg.vocab_size, n) for n in (7, 5)]
    data = TokenData.from_sequences(hidden, tokens)
    acc = rank_accuracy(heads, tiny_model, data, ranks=cfg.vocab_size, batch=4)
    assert acc.shape == (2, cfg.vocab_size)
    np.testing.assert_allclose(acc.sum(1), 1.0)  # the label is at exactly one rank
    logits = np.asarray(heads(jnp.asarray(data.hidden, jnp.float32), tiny_model))
    labels = data.labels(2)
    for m in range(2):
        ok = labels[:, m] >= 0
        top1 = logits[ok, m].argmax(-1) == labels[ok, m]
        np.testing.assert_allclose(acc[m, 0], top1.mean())


def test_tune_heads_cli_rejects_a_directory_without_heads(tmp_path, capsys):
    from specjax.cli import commands as cli

    assert cli.main(["tune-heads", "--heads", str(tmp_path)]) == 2
    assert "no manifest.json" in capsys.readouterr().err
