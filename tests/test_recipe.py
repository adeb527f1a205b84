"""The EAGLE recipe's pieces, one test each: normalised inputs (old heads unchanged), the loss on the
train rows only, KL with the rest-of-vocabulary mass, per-step weights, Adam b2, the fused path's
per-tap norm and regression target."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax.models import eagle_io
from specjax.models.eagle import EagleConfig, EagleHead
from specjax.methods.eagle.record import LoadedEagle
from train_heads import eagle as train
from train_heads import sequences


@pytest.fixture(scope="module")
def config(tiny_config):
    return EagleConfig.for_model(tiny_config, draft_vocab=48)


def rms(x):
    return float(jnp.sqrt(jnp.mean(jnp.square(x))))


def test_input_norm_balances_token_and_feature(config):
    head = EagleHead(dataclasses.replace(config, input_norm=True), rngs=nnx.Rngs(0))
    k1, k2 = jax.random.split(jax.random.key(0))
    f = 2.0 * jax.random.normal(k1, (1, 5, config.dim))  # feature rms ~2, embedding ~0.1: as on SmolLM2
    e = 0.1 * jax.random.normal(k2, (1, 5, config.dim))
    x = head._input(f, e)
    # each input reaches fc at rms 1: scaling either one leaves fc's input unchanged
    np.testing.assert_allclose(head._input(10 * f, e), x, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(head._input(f, 3 * e), x, rtol=1e-3, atol=2e-3)  # up to eps
    d = config.dim
    fc = head.fc[...]
    assert rms(head.embed_norm(e) @ fc[d:]) == pytest.approx(rms(head.feature_norm(f) @ fc[:d]), rel=0.3)
    # without the flag the raw concatenation: the token's share is ~5%
    old = EagleHead(config, rngs=nnx.Rngs(0))
    assert rms(e @ old.fc[...][d:]) < 0.1 * rms(f @ old.fc[...][:d])


def test_heads_saved_before_the_flags_load_and_behave_as_before(config, tmp_path):
    """A manifest without input_norm / rest_class (every head shipped so far) loads as a head without
    them: same parameters, same outputs as the head that was saved."""
    head = EagleHead(config, rngs=nnx.Rngs(3))
    ids = np.arange(48, dtype=np.int32)
    eagle_io.save_head(tmp_path, head, ids, dict(model="tiny", weights_id="w"))
    import json
    m = json.loads((tmp_path / "manifest.json").read_text())
    for k in ("input_norm", "rest_class"):
        del m["eagle_config"][k]
    (tmp_path / "manifest.json").write_text(json.dumps(m))
    loaded, _, _ = eagle_io.load_head(tmp_path)
    assert not loaded.config.input_norm and not loaded.config.rest_class
    assert set(nnx.to_pure_dict(nnx.state(loaded, nnx.Param))) == set(nnx.to_pure_dict(nnx.state(head, nnx.Param)))
    f = jax.random.normal(jax.random.key(1), (1, 4, config.dim))
    np.testing.assert_array_equal(loaded.unroll(f, f, 2)[1], head.unroll(f, f, 2)[1])
    shipped = eagle_io.shipped_eagle_dir("smollm2-135m")
    if shipped is not None:
        cfg = EagleConfig.from_dict(json.loads((shipped / "manifest.json").read_text())["eagle_config"])
        assert not cfg.input_norm and not cfg.rest_class


def _batch(config, tiny_model, seed=0, b=2, t=12):
    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(1, 64, size=(b, t)), jnp.int32)
    mask = np.zeros((b, t), bool)
    mask[0, 5:] = mask[1, 8:11] = True
    teach = train.teacher(tiny_model, config, tokens)
    ids = jnp.arange(config.draft_vocab, dtype=jnp.int32)
    return tokens, jnp.asarray(mask), teach, ids


def test_loss_uses_only_the_rows_that_train(config, tiny_model):
    head = EagleHead(config, rngs=nnx.Rngs(1))
    tokens, mask, teach, ids = _batch(config, tiny_model, t=80)  # 78 + 3 rows train of 2 x 78
    embed, w_ids = tiny_model.embed[...], tiny_model.embed[...][:config.draft_vocab]
    cfg = train.EagleTrainConfig(seq_len=80, unroll=2, noise=0.0)
    n = train.num_rows(np.asarray(mask))
    assert n == 128 and n >= int(np.asarray(mask)[:, 2:].sum())
    run = lambda teach, rows: train.losses(head, embed, w_ids, ids, teach, tokens, mask, jax.random.key(0), cfg,
                                           noise=0.0, rows=rows)
    gathered, dense = run(teach, n), run(teach, 2 * 78)
    np.testing.assert_allclose(gathered[0], dense[0], rtol=1e-6)
    for k in ("ce", "acc", "count"):
        np.testing.assert_allclose(gathered[1][k], dense[1][k], rtol=1e-6)
    assert gathered[1]["count"][0] == int(np.asarray(mask)[:, 2:].sum())
    # what the target says where nothing trains does not matter
    feats, hidden, lse, top = teach
    junk = np.asarray(~np.asarray(mask))[..., None]
    hidden2 = jnp.where(np.roll(junk, -1, axis=1), 100.0, hidden)  # position t + 1 of every non-train row
    assert float(run((feats, hidden2, lse, top), n)[0]) == pytest.approx(float(gathered[0]), rel=1e-6)


def test_kl_with_the_rest_of_vocabulary_mass():
    rng = np.random.default_rng(0)
    full = jax.nn.log_softmax(jnp.asarray(rng.normal(size=(3, 10)) * 2))  # the target over 10 tokens
    log_p = full[:, :6]  # a 6-token draft vocabulary; rest mass = p[6:].sum()
    rest = jnp.exp(full[:, 6:]).sum(-1)
    # a head that matches the target over the 6 tokens + "rest" has KL 0
    logits, rest_logit = log_p, jnp.log(rest)
    ce, ent, lq = train.soft_cross_entropy(logits, rest_logit, log_p)
    np.testing.assert_allclose(ce - ent, 0.0, atol=1e-5)
    np.testing.assert_allclose(jnp.exp(lq).sum(-1), 1 - rest, rtol=1e-5)
    # any other head: KL > 0, and the rest class is what it is asked for too
    ce2, ent2, _ = train.soft_cross_entropy(logits, rest_logit - 2.0, log_p)
    assert (ce2 - ent2 > 1e-3).all()
    # without the rest class, the draft tokens' mass alone (unnormalised p): minimised by q = p / sum(p)
    ce3, _, _ = train.soft_cross_entropy(log_p, None, log_p)
    ce4, _, _ = train.soft_cross_entropy(log_p + jnp.arange(6)[None] * 0.1, None, log_p)
    assert (ce3 < ce4).all()


def test_rest_class_head_scores_the_rest(config, tiny_model):
    cfg_r = dataclasses.replace(config, rest_class=True, draft_vocab=8)  # most of the mass is outside
    head = EagleHead(cfg_r, rngs=nnx.Rngs(0))
    tokens, mask, teach, _ = _batch(cfg_r, tiny_model)
    ids = jnp.arange(8, dtype=jnp.int32)
    w_ids = tiny_model.embed[...][:8]
    cfg = train.EagleTrainConfig(seq_len=12, unroll=1, noise=0.0, lr=3e-2, warmup=0, steps=30)
    loss = lambda p: train.losses(nnx.merge(gd, p), tiny_model.embed[...], w_ids, ids, teach, tokens, mask,
                                  jax.random.key(0), cfg, noise=0.0, rows=24)
    gd, params = nnx.split(head, nnx.Param)
    first = loss(params)[1]
    import optax
    tx = optax.adam(3e-2)
    st = tx.init(params)

    @jax.jit  # one program for the 30 steps, not an eager dispatch per operation
    def step(params, st):
        g = jax.grad(lambda p: loss(p)[0])(params)
        u, st = tx.update(g, st)
        return optax.apply_updates(params, u), st

    for _ in range(30):
        params, st = step(params, st)
    after = loss(params)[1]
    assert float(after["kl"][0]) < 0.5 * float(first["kl"][0])
    assert float(jnp.abs(params["rest"]).sum()) > 0  # the rest row learned


def test_step_weights_and_b2(config, tiny_model, tmp_path):
    with pytest.raises(ValueError, match="step_weights"):
        train.EagleTrainConfig(unroll=3, step_weights=(1.0, 0.5))
    cfg = train.EagleTrainConfig(unroll=3, step_weights=[1, 0.5, 0.25])
    assert [cfg.weight(j) for j in range(3)] == [1.0, 0.5, 0.25]
    assert train.EagleTrainConfig().b2 == 0.95
    # the optimiser uses b2: after one step Adam's nu / mu^2 = (1 - b2) / (1 - b1)^2 wherever g != 0
    seqs = sequences.Sequences(np.tile(np.arange(1, 17, dtype=np.int32), (4, 1)), np.ones((4, 16), bool))
    tcfg = train.EagleTrainConfig(steps=3, batch_size=4, seq_len=16, warmup=1, unroll=1, b2=0.9)
    tr = train.EagleTrainer(config, tiny_model, seqs, seqs, np.arange(48), tmp_path, tcfg)
    tr.fit(stop_at=1, progress=False)
    adam = [s for s in jax.tree_util.tree_leaves(tr.opt_state, is_leaf=lambda x: hasattr(x, "nu")) if hasattr(s, "nu")][0]
    mu, nu = np.asarray(adam.mu["fc"]), np.asarray(adam.nu["fc"])
    ok = np.abs(mu) > 1e-6
    np.testing.assert_allclose(nu[ok] / mu[ok] ** 2, 0.1 / 0.01, rtol=1e-3)


def test_fused_per_tap_norm_and_regression_target(tiny_config, tiny_model):
    config = EagleConfig.for_model(tiny_config, features="fused", draft_vocab=48, input_norm=True)
    head = EagleHead(config, rngs=nnx.Rngs(0))
    d = config.dim
    taps = jax.random.normal(jax.random.key(0), (1, 6, 2 * d))
    scaled = taps * jnp.concatenate([jnp.full(d, 30.0), jnp.full(d, 0.2)])[None, None]  # the taps' scales differ 8x+ on SmolLM2
    np.testing.assert_allclose(head.lift(scaled), head.lift(taps), rtol=1e-3, atol=1e-3)  # up to eps
    # the feature loss regresses onto the head's own input at t + 1 (the fused taps), not the final hidden state
    tokens, mask, teach, ids = _batch(config, tiny_model)
    feats = teach[0]
    lifted = head.lift(feats)
    perfect = jnp.pad(lifted[:, 1:], ((0, 0), (0, 1), (0, 0)))  # out[t] = lift(feats)[t + 1]

    class Oracle(EagleHead):
        def unroll(self, feature, emb, steps):
            return [perfect] * steps

    oracle = Oracle(config, rngs=nnx.Rngs(0))
    cfg = train.EagleTrainConfig(seq_len=12, unroll=1, noise=0.0)
    _, m = train.losses(oracle, tiny_model.embed[...], tiny_model.embed[...][:48], ids, teach, tokens, mask,
                        jax.random.key(0), cfg, noise=0.0, rows=20)
    assert float(m["feat"][0]) == pytest.approx(0.0, abs=1e-6)


def test_vocabulary_coverage_per_task_class():
    from train_heads import coverage

    answers = {"math": [np.array([1, 2, 3]), np.array([3, 3])], "qa": [np.array([7, 8])]}
    ranked = np.array([3, 7, 1, 2, 8])
    table = coverage.coverage(answers, ranked, [1, 2, 5])
    assert table["math"] == {1: 3 / 5, 2: 3 / 5, 5: 1.0}
    assert table["qa"] == {1: 0.0, 2: 0.5, 5: 1.0}
    assert table["all"][2] == pytest.approx(4 / 7)
    assert "| target | math | 60.0% | 60.0% | 100.0% |" in coverage.format_table({"target": table}, [1, 2, 5])


@pytest.mark.parametrize("features", ["final", "fused"])
def test_new_recipe_heads_decode_exactly_like_plain(tiny_model, tmp_path, features):
    """A head with normalised inputs and the rest class, trained from a feature cache on the tiny
    target's own continuations: greedy chain and dynamic tree, batch 3, equal plain, drafts accepted."""
    from specjax.methods.config import SpecConfig
    from specjax.serving.engine import Engine
    from train_heads import cache as fc

    eng = Engine(tiny_model)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 64, size=4).tolist() for _ in range(40)]
    seqs = [(np.asarray(p + r.tokens, np.int32), np.arange(len(p) + len(r.tokens)) >= 4)
            for p, r in zip(prompts, eng.generate(prompts, max_new_tokens=28))]
    config = EagleConfig.for_model(tiny_model.config, draft_vocab=64, features=features, input_norm=True,
                                   rest_class=True)
    fc.extract(tiny_model, seqs, tmp_path / "cache", taps=config.feature_layers, shard_size=20, batch_size=8,
               multiple=32, progress=False, log=lambda m: None)
    cache = fc.FeatureCache(tmp_path / "cache")
    ids = fc.target_vocabulary(cache, range(8, 40), 64)
    cfg = train.EagleTrainConfig(steps=120, batch_size=8, seq_len=32, lr=1e-2, warmup=5, unroll=3,
                                 save_every=1000, eval_every=1000, log_every=50)
    tr = train.EagleTrainer(config, tiny_model, fc.CachedSequences(cache, np.arange(8, 40)),
                            fc.CachedSequences(cache, np.arange(8)), ids, tmp_path / "run", cfg)
    assert tr.fit(progress=False)["acc"][0] > 0.3
    tr.ckpts.close()
    eagle_io.save_head(tmp_path / "head", tr.head, ids, dict(model="tiny", weights_id="w"))
    head, got_ids, _ = eagle_io.load_head(tmp_path / "head")
    eng.set_asset("eagle", LoadedEagle(head, got_ids))
    test_prompts = [[5, 9, 12, 5, 9, 12, 5, 9], list(range(1, 31)), [40, 41, 42, 43, 40, 41]]
    ref = [r.tokens for r in eng.generate(test_prompts, max_new_tokens=32)]
    for spec in (SpecConfig(method="eagle", k=3), SpecConfig.make("eagle", k=3, nodes=8, topk=3)):
        out = eng.generate(test_prompts, max_new_tokens=32, spec=spec)
        assert [r.tokens for r in out] == ref
        assert sum(r.counters.num_accepted_tokens for r in out) > 0
