"""EAGLE heads: the training unroll equals the drafting path; training learns and resumes exactly."""

import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax.models import eagle_io
from specjax.models.eagle import EagleConfig, EagleHead
from train_heads import eagle as train
from train_heads import sequences


@pytest.fixture(scope="module")
def config(tiny_config):
    return EagleConfig.for_model(tiny_config, draft_vocab=48)


def test_unroll_equals_drafting_with_the_cache(config):
    """Step j of the unroll at position t = the head drafting at depth j + 1 from the real entries
    up to t - j, written into its cache one entry at a time."""
    head = EagleHead(config, rngs=nnx.Rngs(1))
    t, d = 9, config.dim
    k1, k2 = jax.random.split(jax.random.key(0))
    feat = jax.random.normal(k1, (1, t, d))
    emb = jax.random.normal(k2, (1, t, d))
    outs = head.unroll(feat, emb, 3)
    cache = head.cache(1, t)
    pos = jnp.arange(t)[None]
    real, cache = head(feat, emb, pos, jnp.zeros(1, jnp.int32), cache)
    np.testing.assert_allclose(outs[0], real, atol=1e-5)
    for j in (1, 2):
        for tt in range(j, t):
            c, g = cache, real[:, tt - j]  # the prediction for position tt - j + 1 from the real entry
            for i in range(1, j + 1):  # draft entries at positions tt - j + i
                p = tt - j + i
                start = jnp.array([p], jnp.int32)
                g, c = head(g[:, None], emb[:, p:p + 1], jnp.array([[p]]), start, c)
                g = g[:, 0]
            np.testing.assert_allclose(outs[j][:, tt], g, atol=1e-5, err_msg=f"step {j} position {tt}")


def test_fused_features_read_the_residual_stream(tiny_model, tiny_config):
    cfg = EagleConfig.for_model(tiny_config, features="fused", draft_vocab=32)
    assert cfg.feature_layers == (0, 1)  # the default for tiny's 2 layers
    thirty = dataclasses.replace(tiny_config, num_layers=30)
    assert EagleConfig.for_model(thirty, features="fused", draft_vocab=32).feature_layers == (2, 15, 27)
    for bad in ((0, 2), (1, 1), (-1, 0)):  # tiny has layers 0 and 1
        with pytest.raises(ValueError, match="distinct layers of the target's 2"):
            EagleConfig.for_model(tiny_config, features="fused", feature_layers=bad, draft_vocab=32)
    cfg = EagleConfig.for_model(tiny_config, features="fused", feature_layers=(0, 1), draft_vocab=32)
    from specjax.models import eagle
    toks = jnp.arange(6)[None] % 64
    out, f = eagle.target_features(tiny_model, cfg, toks, jnp.arange(6)[None], tiny_model.init_cache(1, 6))
    assert f.shape == (1, 6, 2 * tiny_config.dim)
    emb = jnp.take(tiny_model.embed[...], toks, axis=0)
    np.testing.assert_allclose(f[..., : tiny_config.dim], emb, atol=1e-6)  # layer 0's input is the embedding
    head = EagleHead(cfg, rngs=nnx.Rngs(0))
    assert head.lift(f).shape == (1, 6, tiny_config.dim)


def test_bad_configs(tiny_config):
    with pytest.raises(ValueError, match="features"):
        EagleConfig.for_model(tiny_config, features="middle")
    with pytest.raises(ValueError, match="draft_vocab"):
        EagleConfig.for_model(tiny_config, draft_vocab=10**6)
    with pytest.raises(ValueError, match="seq_len"):
        train.EagleTrainConfig(seq_len=2)


def copy_task(n: int, t: int, seed: int) -> sequences.Sequences:
    """Sequences that repeat a random 4-token motif: learnable from the context."""
    rng = np.random.default_rng(seed)
    motifs = rng.integers(1, 64, size=(n, 4))
    toks = np.tile(motifs, (1, t // 4 + 1))[:, :t].astype(np.int32)
    mask = np.ones_like(toks, bool)
    mask[:, :4] = False
    return sequences.Sequences(toks, mask)


def small_cfg(**kw):
    base = dict(steps=40, batch_size=4, seq_len=16, lr=3e-3, warmup=2, unroll=2, save_every=10,
                eval_every=1000, log_every=5)
    return train.EagleTrainConfig(**{**base, **kw})


def test_training_learns_a_copy_task_and_resumes_exactly(tiny_model, config, tmp_path):
    data, held = copy_task(64, 16, 0), copy_task(8, 16, 1)
    ids = sequences.draft_vocabulary(data.tokens, data.mask, config.draft_vocab, 64)
    cfg = small_cfg(steps=100, lr=1e-2, save_every=25)
    full = train.EagleTrainer(config, tiny_model, data, held, ids, tmp_path / "a", cfg)
    before = full.evaluate()
    after = full.fit(progress=False)
    # the labels are the random target's own (near-flat) distributions: its argmax is learned
    assert after["acc"][0] > before["acc"][0] + 0.2 and after["feat"][0] < 0.6 * before["feat"][0], (before, after)
    # interrupted at step 60 (last checkpoint 50), resumed in a new trainer: the same parameters as the uninterrupted run
    part = train.EagleTrainer(config, tiny_model, data, held, ids, tmp_path / "b", cfg)
    part.fit(stop_at=60, progress=False)
    part.ckpts.close()
    shutil.rmtree(tmp_path / "b" / "checkpoints" / "60")  # killed after logging step 60, before saving it
    resumed = train.EagleTrainer(config, tiny_model, data, held, ids, tmp_path / "b", cfg)
    assert resumed.resume() == 50
    resumed.fit(progress=False)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), full.params,
                 resumed.params)
    # and the same training log: what the interrupted run logged past its checkpoint is not repeated
    losses = lambda run: [(r["step"], r["loss"]) for r in map(json.loads, (tmp_path / run / "metrics.jsonl")
                                                               .read_text().splitlines()) if "loss" in r]
    assert losses("b") == losses("a") and losses("a")
    # another run's settings are refused
    other = train.EagleTrainer(config, tiny_model, data, held, ids, tmp_path / "b", small_cfg(steps=100, lr=1e-3))
    with pytest.raises(ValueError, match="another run"):
        other.resume()
    # the saved head loads back with its vocabulary
    eagle_io.save_head(tmp_path / "head", full.head, ids, dict(model="tiny", weights_id="w"))
    head, got_ids, manifest = eagle_io.load_head(tmp_path / "head", model_name="tiny")
    np.testing.assert_array_equal(got_ids, ids)
    assert manifest["format"] == eagle_io.FORMAT
    with pytest.raises(ValueError, match="trained for"):
        eagle_io.load_head(tmp_path / "head", model_name="smollm2-135m")


def test_data_parallel_over_two_devices(tiny_model, config, tmp_path):
    assert len(jax.devices()) == 2  # conftest's fake CPU devices
    data, held = copy_task(16, 16, 0), copy_task(4, 16, 1)
    ids = sequences.draft_vocabulary(data.tokens, data.mask, config.draft_vocab, 64)
    tr = train.EagleTrainer(config, tiny_model, data, held, ids, tmp_path, small_cfg(steps=3))
    batch, _ = tr._batch(data, np.arange(4))
    assert len(batch["tokens"].sharding.device_set) == 2
    tr.fit(progress=False)
    with pytest.raises(ValueError, match="divide"):
        train.EagleTrainer(config, tiny_model, data, held, ids, tmp_path / "x", small_cfg(batch_size=3))


def test_conversation_encoding_masks_assistant_text(smollm2):
    tok = smollm2.tokenizer
    msgs = [dict(role="user", content="Hi there"), dict(role="assistant", content="Hello! How can I help?")]
    toks, mask = sequences.encode_conversation(tok, msgs, 256)
    full = tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=False))
    assert toks.tolist() == full  # the pieces tokenize as the whole
    learned = tok.decode(toks[mask].tolist())
    assert learned.startswith("Hello! How can I help?") and "user" not in learned


def test_conversation_without_a_chat_template_is_plain_text(smollm2):
    """A base model (no chat template, as Gemma 3 270M) learns from the conversation as plain text:
    the contents and blank lines, the assistant's part masked in."""
    import copy

    tok = copy.copy(smollm2.tokenizer)
    tok.chat_template = None
    msgs = [dict(role="user", content="Hi there"), dict(role="assistant", content="Hello! How can I help?")]
    toks, mask = sequences.encode_conversation(tok, msgs, 256)
    assert tok.decode(toks.tolist()) == tok.decode(tok.encode("Hi there\n\nHello! How can I help?\n\n"))
    assert tok.decode(toks[mask].tolist()) == "Hello! How can I help?\n\n"


@pytest.mark.parametrize("argv,message", [
    (["--features", "final", "--feature-layers", "1,2"], "feature-layers"),
    (["--max-minutes", "0"], "max-minutes"),
    (["--draft-vocab", "0"], "draft-vocab"),
    (["--unroll", "0"], "unroll"),
    (["--batch-size", "0"], "batch_size"),
    (["--cache", "/nonexistent"], "no feature cache there"),
    (["--vocab", "target"], "pass --cache"),
    (["--step-weights", "1,0.5"], "step_weights"),
    (["--b2", "1.5"], "b2"),
])
def test_cli_rejects_bad_eagle_input_before_work(tmp_path, capsys, monkeypatch, argv, message):
    from specjax.cli import commands as cli
    from specjax.serving.engine import Engine

    monkeypatch.setattr(Engine, "load", lambda *a, **k: pytest.fail("loaded the model before checking"))
    assert cli.main(["train-heads", "--kind", "eagle", "--out", str(tmp_path), *argv]) == 2
    assert message in capsys.readouterr().err


def test_self_distilled_sequences_join_prompt_and_answer(monkeypatch, tiny_model):
    """Prompt ids + the cached greedy answer, masked on the answer, cut to seq_len."""
    from train_heads import data

    answers = [np.array([7, 8, 9], np.int32), np.array([4, 5], np.int32)]
    rows = data.TokenData(np.zeros((5, 4), np.float16), np.concatenate(answers), np.array([0, 3, 5]))
    monkeypatch.setattr(data, "build", lambda *a, **k: None)
    monkeypatch.setattr(data, "load", lambda d: (rows, {}))
    monkeypatch.setattr(data, "select_prompts", lambda e, n, **k: [("a", [1, 2]), ("b", [3, 3, 3])][:n])
    eng = type("E", (), dict(name="tiny", weights_id="w"))()
    items = sequences.self_distilled_sequences(eng, 2, 4)
    assert [t.tolist() for t, _ in items] == [[1, 2, 7, 8], [3, 3, 3, 4]]
    assert [m.tolist() for _, m in items] == [[False, False, True, True], [False, False, False, True]]


def test_cli_fused_features_default_their_layers_from_the_model(tmp_path, monkeypatch):
    """Without --feature-layers, `--features fused` passes the checks and takes 2, L/2, L-3 of the
    loaded model (EagleConfig.for_model), so the run reaches the model load."""
    from specjax.cli import commands as cli
    from specjax.serving.engine import Engine

    class Loaded(Exception):
        pass

    def load(*a, **k):
        raise Loaded

    monkeypatch.setattr(Engine, "load", load)
    with pytest.raises(Loaded):
        cli.main(["train-heads", "--kind", "eagle", "--features", "fused", "--out", str(tmp_path)])


def test_eagle_resume_into_another_runs_directory_and_a_nan_loss(tiny_model, tiny_config, config, tmp_path):
    data, held = copy_task(8, 16, 0), copy_task(4, 16, 1)
    ids = sequences.draft_vocabulary(data.tokens, data.mask, config.draft_vocab, 64)
    cfg = small_cfg(steps=6, save_every=2, log_every=1)
    run = train.EagleTrainer(config, tiny_model, data, held, ids, tmp_path, cfg)
    run.fit(stop_at=3, progress=False)
    files = lambda: {str(f): f.read_bytes() for f in sorted((tmp_path / "checkpoints").rglob("*")) if f.is_file()}
    before = files()
    # a head with normalised inputs has parameters the saved run lacks
    other = train.EagleTrainer(dataclasses.replace(config, input_norm=True), tiny_model, data, held, ids, tmp_path, cfg)
    with pytest.raises(ValueError, match=r"other shapes \(params/embed_norm/scale: \(32,\) here, absent in the "
                                         r"checkpoint.*choose another --out or pass --init"):
        other.resume()
    other.ckpts.close()
    assert files() == before
    # the target's embedding turned NaN from step 4 on: the run stops there, saving nothing
    run.frozen = jax.tree.map(lambda x: x * jnp.nan if jnp.issubdtype(x.dtype, jnp.floating) else x, run.frozen)
    with pytest.raises(ValueError, match=r"loss is nan at step 4.*last good checkpoint, step 3"):  # fit saved at stop_at
        run.fit(progress=False)
    run.ckpts.close()
    assert files() == before and run.step == 3
