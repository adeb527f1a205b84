"""The feature cache: extraction is exact and resumable; training from it equals training with the
target inside the step; a killed cached run resumes to the same loss curve."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.models.eagle import EagleConfig
from train_heads import cache as fc
from train_heads import eagle as train
from train_heads import sequences


def corpus(n: int, seed: int, lo: int = 5, hi: int = 30):
    """Sequences of random lengths; the second half of each trains (an "answer")."""
    rng = np.random.default_rng(seed)
    items = []
    for _ in range(n):
        t = int(rng.integers(lo, hi))
        motif = rng.integers(1, 64, size=3)
        toks = np.resize(motif, t).astype(np.int32)
        toks[: t // 3] = rng.integers(1, 64, size=t // 3)
        mask = np.arange(t) >= t // 2
        items.append((toks, mask))
    return items


def forward(model, toks, taps=()):
    t = len(toks)
    out = model(jnp.asarray(toks)[None], jnp.arange(t)[None], model.init_cache(1, t), taps=taps)
    logits = out.logits[0].astype(jnp.float32)
    return (np.asarray(out.hidden[0]), [np.asarray(x[0]) for x in out.taps],
            np.asarray(jax.nn.logsumexp(logits, axis=-1)), np.asarray(jnp.argmax(logits, axis=-1)))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cached_features_equal_the_targets_forward(tiny_model, tmp_path, dtype):
    """Every position of every sequence, prompt positions included, against a forward of that sequence
    alone (no padding, batch 1): fp32 to 1e-5; bf16 to its rounding (2^-8 relative)."""
    items = corpus(7, 0)
    index = fc.extract(tiny_model, items, tmp_path, taps=(0, 1), dtype=dtype, shard_size=3, batch_size=2,
                       multiple=8, progress=False, log=lambda m: None)
    assert index["complete"] and index["positions"] == sum(len(t) for t, _ in items)
    cache = fc.FeatureCache(tmp_path)
    assert len(cache) == 7
    rtol, atol = (1e-5, 1e-5) if dtype == "float32" else (2**-8, 1e-6)
    for i, (toks, mask) in enumerate(items):
        seq = cache.sequence(i)
        hidden, taps, lse, top = forward(tiny_model, toks, taps=(0, 1))
        np.testing.assert_array_equal(seq["tokens"], toks)
        np.testing.assert_array_equal(seq["mask"], mask)
        np.testing.assert_allclose(np.asarray(seq["hidden"], np.float32), hidden, rtol=rtol, atol=atol)
        np.testing.assert_allclose(np.asarray(seq["taps"], np.float32), np.concatenate(taps, -1), rtol=rtol,
                                   atol=atol)
        np.testing.assert_allclose(seq["lse"], lse, rtol=1e-5, atol=1e-5)  # float32 in both caches
        np.testing.assert_array_equal(seq["top"], top)


def test_killed_extraction_resumes_without_duplicates_or_gaps(tiny_model, tmp_path):
    items = corpus(10, 1)
    quiet = dict(shard_size=3, batch_size=2, multiple=8, progress=False, log=lambda m: None)
    first = fc.extract(tiny_model, items, tmp_path / "a", max_shards=2, **quiet)  # killed after 2 of 4 shards
    assert not first["complete"] and len(first["shards"]) == 2
    with pytest.raises(ValueError, match="incomplete"):
        fc.FeatureCache(tmp_path / "a")
    # a crash mid-shard leaves only a temporary directory, which a resumed run replaces
    (tmp_path / "a" / ".shard-00002.999.tmp").mkdir()
    before = {p: p.stat().st_mtime_ns for p in (tmp_path / "a" / "shard-00000").iterdir()}
    done = fc.extract(tiny_model, items, tmp_path / "a", **quiet)
    assert done["complete"] and [s["name"] for s in done["shards"]] == [f"shard-{i:05d}" for i in range(4)]
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "a" / "shard-00000").iterdir()} == before  # not redone
    straight = fc.extract(tiny_model, items, tmp_path / "b", **quiet)
    a, b = fc.FeatureCache(tmp_path / "a"), fc.FeatureCache(tmp_path / "b")
    assert len(a) == len(b) == 10 and done["positions"] == straight["positions"]
    for i in range(10):
        for k, v in b.sequence(i).items():
            np.testing.assert_array_equal(a.sequence(i)[k], v, err_msg=f"sequence {i} {k}")
    # another corpus in the same directory is refused
    with pytest.raises(ValueError, match="another corpus"):
        fc.extract(tiny_model, corpus(10, 2), tmp_path / "a", **quiet)


def test_epoch_loader_state_continues_the_same_batches():
    a = fc.EpochLoader(10, 4, seed=3)
    seen = [a.next() for _ in range(7)]
    assert all(len(r) == 4 for r in seen)
    assert sorted(np.concatenate(seen[:2]).tolist()) == sorted(set(np.concatenate(seen[:2]).tolist()))  # no repeats
    b = fc.EpochLoader(10, 4, seed=3)
    for _ in range(3):
        b.next()
    c = fc.EpochLoader(10, 4, seed=3)
    c.restore(json.loads(json.dumps(b.state())))
    assert c.state() == b.state() == c.state_at(3)
    for want in seen[3:]:
        np.testing.assert_array_equal(c.next(), want)
    with pytest.raises(ValueError, match="batches of 4"):
        fc.EpochLoader(10, 2, seed=3).restore(b.state())


def test_target_vocabulary_ranks_the_targets_own_argmax(tiny_model, tmp_path):
    items = corpus(6, 4)
    fc.extract(tiny_model, items, tmp_path, shard_size=4, batch_size=2, multiple=8, progress=False,
               log=lambda m: None)
    cache = fc.FeatureCache(tmp_path)
    counts = np.zeros(64, int)
    for toks, mask in items:
        top = forward(tiny_model, toks)[3]
        for t in range(len(toks) - 1):
            if mask[t + 1]:  # the target's prediction at a position whose next token trains
                counts[top[t]] += 1
    ids = fc.target_vocabulary(cache, range(6), 8)
    assert counts[ids].tolist() == sorted(counts, reverse=True)[:8]
    assert counts[ids[0]] > 0
    # the ranking differs from the data tokens' (what the old draft_vocabulary counted)
    toks = np.concatenate([t for t, _ in items])
    mask = np.concatenate([m for _, m in items])
    assert not np.array_equal(ids, sequences.draft_vocabulary(toks[None], mask[None], 8, 64))


def test_medusa_rows_from_the_cache(tiny_model, tmp_path):
    toks = np.arange(1, 13, dtype=np.int32)
    mask = np.zeros(12, bool)
    mask[3:6] = mask[8:11] = True  # two answer turns
    fc.extract(tiny_model, [(toks, mask)], tmp_path, dtype="float32", shard_size=1, batch_size=1, multiple=4,
               progress=False, log=lambda m: None)
    rows = fc.medusa_rows(fc.FeatureCache(tmp_path), [0])
    hidden = forward(tiny_model, toks)[0]
    assert rows.tokens.tolist() == [4, 5, 6, 9, 10, 11] and rows.starts.tolist() == [0, 3, 6]
    np.testing.assert_allclose(rows.hidden, hidden[[2, 3, 4, 7, 8, 9]], rtol=1e-5, atol=1e-5)
    assert (rows.labels(2)[[2, 5]] == -1).all()  # no label crosses into the next turn


def _losses(path):
    return [(r["step"], r["loss"], r["train"]["acc"]) for r in map(json.loads, (path / "metrics.jsonl")
                                                                      .read_text().splitlines()) if "loss" in r]


@pytest.mark.parametrize("features", ["final", "fused"])
def test_training_from_the_cache_equals_training_with_the_target_in_the_step(tiny_model, tiny_config, tmp_path,
                                                                              features):
    """Same batches, same loss at every step (fp32 cache: to float rounding), same held-out metrics."""
    config = EagleConfig.for_model(tiny_config, draft_vocab=40, features=features, input_norm=True,
                                   rest_class=True)
    cfg = train.EagleTrainConfig(steps=12, batch_size=4, seq_len=20, lr=3e-3, warmup=2, unroll=2, save_every=6,
                                 eval_every=1000, log_every=1)
    items = corpus(24, 5, lo=10, hi=24)
    fc.extract(tiny_model, items, tmp_path / "cache", taps=config.feature_layers, dtype="float32", shard_size=8,
               batch_size=4, multiple=8, progress=False, log=lambda m: None)
    cache = fc.FeatureCache(tmp_path / "cache")
    ids = fc.target_vocabulary(cache, range(4, 24), config.draft_vocab)
    plain = train.EagleTrainer(config, tiny_model, sequences.Sequences.pad(items[4:], cfg.seq_len),
                               sequences.Sequences.pad(items[:4], cfg.seq_len), ids, tmp_path / "plain", cfg)
    cached = train.EagleTrainer(config, tiny_model, fc.CachedSequences(cache, np.arange(4, 24)),
                                fc.CachedSequences(cache, np.arange(4)), ids, tmp_path / "cached", cfg)
    before = cached.evaluate()
    a, b = plain.fit(progress=False), cached.fit(progress=False)
    la, lb = _losses(tmp_path / "plain"), _losses(tmp_path / "cached")
    assert len(la) == len(lb) == 12
    for (sa, xa, acc_a), (sb, xb, acc_b) in zip(la, lb):
        assert sa == sb and xa == pytest.approx(xb, rel=1e-4, abs=1e-4) and acc_a == acc_b, (la, lb)
    assert a["acc"] == b["acc"] and a["ce"] == pytest.approx(b["ce"], rel=1e-4)
    assert lb[-1][1] < lb[0][1] and b["kl"][0] < before["kl"][0]  # and it learns
    assert min(b["kl"]) >= 0  # rest_class: a true KL


def test_killed_cached_run_resumes_to_the_same_loss_curve(tiny_model, tiny_config, tmp_path):
    config = EagleConfig.for_model(tiny_config, draft_vocab=40, input_norm=True)
    cfg = train.EagleTrainConfig(steps=16, batch_size=4, seq_len=20, lr=3e-3, warmup=2, unroll=2, save_every=5,
                                 eval_every=1000, log_every=1)
    items = corpus(14, 6, lo=10, hi=24)  # 10 training sequences: 2 batches an epoch, so epochs turn over
    fc.extract(tiny_model, items, tmp_path / "cache", shard_size=8, batch_size=4, multiple=8, progress=False,
               log=lambda m: None)
    cache = fc.FeatureCache(tmp_path / "cache")
    ids = fc.target_vocabulary(cache, range(4, 14), config.draft_vocab)

    def trainer(name):
        return train.EagleTrainer(config, tiny_model, fc.CachedSequences(cache, np.arange(4, 14)),
                                  fc.CachedSequences(cache, np.arange(4)), ids, tmp_path / name, cfg)

    full = trainer("a")
    full.fit(progress=False)
    part = trainer("b")
    part.fit(stop_at=13, progress=False)  # killed after logging step 13; its last checkpoint is step 10
    part.ckpts.close()
    shutil.rmtree(tmp_path / "b" / "checkpoints" / "13")  # (fit saves at stop_at; the kill came before it)
    resumed = trainer("b")
    assert resumed.resume() == 10
    assert resumed.loader.state() == full.loader.state_at(10) and resumed.loader.state()["epoch"] == 5
    resumed.fit(progress=False)
    assert _losses(tmp_path / "a") == _losses(tmp_path / "b")
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), full.params,
                 resumed.params)


def test_medusa_heads_train_from_the_cache(tiny_model, tmp_path):
    import types

    from specjax.models.heads import HeadsConfig
    from train_heads import checkpoint
    from train_heads.train import TrainConfig, _train_heads_from_cache

    fc.extract(tiny_model, corpus(12, 7, lo=16, hi=30), tmp_path / "cache", meta=dict(model="tiny", weights_id="w"),
               shard_size=6, batch_size=4, multiple=8, progress=False, log=lambda m: None)
    engine = types.SimpleNamespace(name="tiny", weights_id="w", model=tiny_model)
    heads = HeadsConfig.for_model(tiny_model.config, num_heads=2)
    config = TrainConfig(steps=6, batch_size=16, warmup=1, save_every=3, eval_every=3)
    manifest = _train_heads_from_cache(engine, tmp_path / "run", heads, config, tmp_path / "cache", None, 2,
                                       progress=False, log=lambda m: None, mesh=None)
    assert manifest["steps"] == 6 and manifest["data"]["conversations"] == 10
    assert manifest["metrics"]["rows"] == fc.medusa_rows(fc.FeatureCache(tmp_path / "cache"), range(2)).num_rows
    loaded, _ = checkpoint.load_heads(tmp_path / "run", model_name="tiny")
    assert loaded.config.num_heads == 2
    with pytest.raises(ValueError, match="extracted from tiny"):
        _train_heads_from_cache(types.SimpleNamespace(name="other", weights_id="w", model=tiny_model),
                                tmp_path / "run2", heads, config, tmp_path / "cache", None, 2, progress=False,
                                log=lambda m: None, mesh=None)
