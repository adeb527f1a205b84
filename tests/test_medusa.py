"""Medusa proposer, chain and tree: greedy identity with the plain loop, the tree mask, the
path compaction, losslessness of the tree walk, and bad input."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax.core import acceptance
from specjax.core import tree as tree_lib
from specjax.methods.config import TREES, SpecConfig
from specjax.serving.engine import Engine
from specjax.models import config as model_config
from specjax.models import loader
from specjax.core.proposer import Stateless
from specjax.core.sampling import Greedy, SamplingParams
from specjax.models.heads import HeadsConfig, MedusaHeads
from specjax.methods.medusa.record import LoadedHeads

PROMPTS = [[5, 9, 12, 5, 9, 12, 5, 9], list(range(1, 31)), [40, 41, 42, 43, 40, 41]]
M = 17
REF_NEW = 32


def random_heads(model, seed=0, scale=0.5, num_heads=4, own_projection=False, token_input=False):
    """Heads with random (not zero) blocks, so they propose varied, mostly wrong tokens."""
    heads = MedusaHeads(HeadsConfig.for_model(model.config, num_heads=num_heads,
                                              own_projection=own_projection, token_input=token_input),
                        base=model, rngs=nnx.Rngs(seed))
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    d = model.config.dim
    heads.w[...] = jax.random.normal(k1, heads.w.shape) * scale * d**-0.5
    heads.b[...] = jax.random.normal(k2, heads.b.shape) * scale
    if token_input:
        heads.u[...] = jax.random.normal(k3, heads.u.shape) * scale * d**-0.5
    return heads


def assert_accepted(results):
    """Identity alone would also hold for a proposer that never proposes anything useful."""
    assert sum(r.counters.num_accepted_tokens for r in results) > 0, "no draft was ever accepted"


@pytest.fixture(scope="module")
def eng(tiny_model):
    return Engine(tiny_model, assets={"medusa": LoadedHeads(random_heads(tiny_model))})


@pytest.fixture(scope="module")
def ref(eng):
    return [r.tokens for r in eng.generate(PROMPTS, max_new_tokens=REF_NEW)]


# ---- greedy identity ---------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2, 4])
def test_chain_equals_plain(eng, ref, k):
    res = eng.generate(PROMPTS, max_new_tokens=M, spec=SpecConfig(method="medusa", k=k))
    assert [r.tokens for r in res] == [t[:M] for t in ref]
    assert_accepted(res)
    assert all(r.k == k for r in res)


@pytest.mark.parametrize("tree", ["chain4", "small", "medium", ((0,), (1,), (1, 0), (1, 1), (1, 1, 0))])
def test_tree_equals_plain(eng, ref, tree):
    res = eng.generate(PROMPTS, max_new_tokens=M, spec=SpecConfig.make("medusa", tree=tree))
    assert [r.tokens for r in res] == [t[:M] for t in ref]
    assert_accepted(res)


def test_zero_init_heads_equal_plain(tiny_model, ref):
    """Untrained zero-init heads propose the base LM head's own guess; output is unchanged."""
    heads = MedusaHeads(HeadsConfig.for_model(tiny_model.config), rngs=nnx.Rngs(0))
    e = Engine(tiny_model, assets={"medusa": LoadedHeads(heads)})
    res = e.generate(PROMPTS, max_new_tokens=M, spec=SpecConfig.make("medusa", tree="small"))
    assert [r.tokens for r in res] == [t[:M] for t in ref]
    assert_accepted(res)


def test_own_projection_heads_equal_plain(tiny_model, ref):
    e = Engine(tiny_model, assets={"medusa": LoadedHeads(random_heads(tiny_model, seed=3, own_projection=True))})
    res = e.generate(PROMPTS, max_new_tokens=M, spec=SpecConfig(method="medusa", k=3))
    assert [r.tokens for r in res] == [t[:M] for t in ref]
    assert_accepted(res)


# ---- table-driven tree: a known branch is right, so compaction is exercised --------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class TableTreeProposer(Stateless):
    """Puts the true greedy tokens on the nodes of `right` (a root-to-leaf path of the tree) and
    distinct wrong tokens everywhere else, so each step accepts exactly that path."""

    k: int
    tree: tuple
    right: tuple
    vocab: int

    @property
    def paths(self):
        return self.tree

    def init(self, params, state, inputs, hidden):
        return None

    def propose(self, params, pstate, state, sampling_config, keys):
        toks = []
        for path in self.tree:
            d = len(path)
            cols = jnp.minimum(state.lengths - 1 + d, params.shape[1] - 1)
            true = jnp.take_along_axis(params, cols[:, None], axis=1)[:, 0]
            on = path == self.right[:d]
            toks.append(true if on else (true + 1 + path[-1]) % self.vocab)
        return jnp.stack(toks, axis=1), None, pstate

    def reconcile(self, params, pstate, state, verify, accepted):
        return pstate


@pytest.mark.parametrize("right", [(1,), (1, 0), (0, 1, 0), (0, 0, 0, 1)])
def test_tree_accepts_the_right_branch_and_compacts(eng, ref, right, monkeypatch):
    tree = TREES["medium"]
    depth = len(right)
    m = 1 + 4 * (depth + 1)  # budget aligned to (depth + 1) tokens per step
    table = np.zeros((len(PROMPTS), 32 + REF_NEW + 16), np.int32)
    for r, (p, t) in enumerate(zip(PROMPTS, ref)):
        table[r, : len(p) + len(t)] = p + t
    prop = TableTreeProposer(k=4, tree=tree, right=right, vocab=eng.config.vocab_size)
    monkeypatch.setattr(eng, "proposer", lambda spec: (prop, jnp.asarray(table)))
    res = eng.generate(PROMPTS, max_new_tokens=m, spec=SpecConfig.make("medusa", tree=tree))
    for r, want in zip(res, ref):
        assert r.tokens == want[:m]  # wrong K/V moved into place would change later tokens
        assert r.tau == depth + 1
        assert r.counters.accept_hist[depth] == r.target_forwards


# ---- the tree mask -----------------------------------------------------------------------------


def test_tree_node_logits_equal_a_chain_over_its_path(tiny_model, key):
    """Each node sees the prefix and its own ancestors only: its logits equal those of a causal
    forward over prefix + path, and its K/V land where compaction expects them."""
    tree = TREES["medium"]
    topo = tree_lib.topology(tree)
    cfg, b, p, s = tiny_model.config, 2, 6, 48
    prompts = jax.random.randint(key, (b, p), 0, cfg.vocab_size)
    nodes = jax.random.randint(jax.random.key(1), (b, len(tree)), 0, cfg.vocab_size)
    pos = jnp.broadcast_to(jnp.arange(p), (b, p))
    _, cache = tiny_model.hidden_states(prompts[:, :-1], pos[:, :-1], tiny_model.init_cache(b, s))
    window = jnp.concatenate([prompts[:, -1:], nodes], axis=1)
    start = jnp.full((b,), p - 1)
    mask = jnp.broadcast_to(jnp.asarray(topo.ancestors), (b,) + topo.ancestors.shape)
    out = tiny_model(window, start[:, None] + jnp.asarray(topo.depth)[None], cache, start=start,
                     window_mask=mask)
    # jitted: one program per path length, not an eager dispatch per operation
    forward = jax.jit(lambda toks: tiny_model(toks, jnp.broadcast_to(jnp.arange(toks.shape[1]), toks.shape),
                                              tiny_model.init_cache(b, s)))
    compact = jax.jit(lambda cache, start, path: cache.compact(start, path))
    for w in range(1, len(topo.depth)):
        path = [v for v in range(w + 1) if topo.ancestors[w, v]]
        toks = jnp.concatenate([prompts, window[:, path[1:]]], axis=1)
        n = toks.shape[1]
        full = forward(toks)
        np.testing.assert_allclose(out.logits[:, w], full.logits[:, -1], atol=1e-5)
        # compaction moves this path's K/V to consecutive slots, equal to the chain's
        slots = jnp.broadcast_to(jnp.asarray(path + [0] * (topo.max_depth + 1 - len(path))), (b, topo.max_depth + 1))
        moved = compact(out.cache, start, slots)
        np.testing.assert_allclose(moved.k[-1][:, p - 1: n], full.cache.k[-1][:, p - 1: n], atol=1e-5)


def test_tree_accept_walk():
    """Hand-made logits: the walk follows the child the target picks, at any rank."""
    tree = ((0,), (1,), (0, 0), (1, 0), (1, 1))
    topo = tree_lib.topology(tree)
    v = 8
    nodes = jnp.asarray([[3, 4, 5, 6, 7]])
    # target argmax per slot: root -> 4 (node (1,), slot 2), slot 2 -> 7 (node (1,1), slot 5), slot 5 -> 1
    want = {0: 4, 1: 0, 2: 7, 3: 0, 4: 0, 5: 1}
    logits = jax.nn.one_hot(jnp.asarray([[want[w] for w in range(6)]]), v) * 10.0
    for rule in (acceptance.Greedy(), acceptance.SpecInfer()):  # SpecInfer under greedy: argmax draws
        acc = rule.accept(acceptance.Window(sampling=Greedy(), keys=jax.random.key(0)[None], nodes=nodes,
                                            q=None, logits=logits, params=SamplingParams.create(1), topo=topo))
        assert int(acc.n[0]) == 2 and int(acc.leaf[0]) == 5 and int(acc.next[0]) == 1
        assert acc.path[0, :3].tolist() == [0, 2, 5]


# ---- sampling: the tree walk is lossless -------------------------------------------------------


WIDE = ((0,), (1,), (2,), (3,), (4,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1))


@pytest.mark.parametrize("setting", ["t0.7", "t1.3", "t0.8_k6_p0.9"])
def test_tree_samples_follow_the_target(setting):
    import test_lossless as tl

    target = loader.init_model(tl.CONFIG, seed=0)
    e = Engine(target, assets={"medusa": LoadedHeads(random_heads(target, seed=2, num_heads=3))})
    opts = tl.SETTINGS[setting]
    batch = e.start([tl.PROMPT] * tl.N, tl.GenerateOptions(max_new_tokens=tl.NEW, seed=11, **opts),
                    spec=SpecConfig.make("medusa", tree=WIDE))
    batch.run()
    toks = np.array(batch.new_tokens())
    pvals = tl.pair_pvalues(toks, tl.joint(tl.conditionals(target, opts)))
    assert min(pvals.values()) > tl.ALPHA, pvals
    hist = np.asarray(batch.state.stats.accept_hist).sum(0)
    assert hist[0] > 0 and hist[1] > 0 and hist[2:].sum() > 0  # rejections and deep accepts both


def test_typical_acceptance_is_opt_in_and_greedy_is_unchanged(eng, ref):
    spec = SpecConfig(method="medusa", k=3, typical=(0.3, 0.09))
    res = eng.generate(PROMPTS, max_new_tokens=M, spec=spec)
    assert [r.tokens for r in res] == [t[:M] for t in ref]  # greedy ignores the lossy rule
    res = eng.generate(PROMPTS, max_new_tokens=M, spec=spec, temperature=0.8, seed=1)
    assert all(r.new_tokens == M for r in res)


# ---- bad input ---------------------------------------------------------------------------------


def test_bad_medusa_input(tiny_model, eng):
    bare = Engine(tiny_model)
    with pytest.raises(ValueError, match="needs Medusa heads"):
        bare.generate([[1, 2]], spec=SpecConfig(method="medusa"))
    with pytest.raises(ValueError, match="exceeds the 4 trained heads"):
        eng.generate([[1, 2]], spec=SpecConfig(method="medusa", k=5))
    other = loader.init_model(model_config.preset("tiny", dim=48), seed=0)
    with pytest.raises(ValueError, match="train heads for this model"):
        bare.set_asset("medusa", LoadedHeads(random_heads(other)))
    before = eng.compile_count
    with pytest.raises(ValueError, match="exceeds"):
        eng.generate([[1, 2]], spec=SpecConfig.make("medusa", tree=((0,), (0, 0), (0, 0, 0), (0, 0, 0, 0),
                                                                    (0, 0, 0, 0, 0))))
    assert eng.compile_count == before


def test_vocab_subset_heads_propose_only_subset_tokens(tiny_model, ref):
    e = Engine(tiny_model)
    subset = np.arange(0, tiny_model.config.vocab_size, 3)
    e.set_asset("medusa", LoadedHeads(random_heads(tiny_model, seed=4), vocab=subset))
    spec = SpecConfig.make("medusa", tree="small")
    res = e.generate(PROMPTS, max_new_tokens=M, spec=spec)
    assert [r.tokens for r in res] == [t[:M] for t in ref]
    assert_accepted(res)
    batch = e.start(PROMPTS, e_opts(), spec=spec)
    st = batch.prefill()
    prop, params = e.proposer(spec)
    nodes, _, _ = prop.propose(params, st.proposer, st.decode, None, None)
    assert np.isin(np.asarray(nodes), subset).all()
    with pytest.raises(ValueError, match="vocab_subset"):
        e.set_asset("medusa", LoadedHeads(random_heads(tiny_model), vocab=[tiny_model.config.vocab_size]))


def e_opts():
    from specjax.serving.engine import GenerateOptions

    return GenerateOptions(max_new_tokens=M)


def test_heads_carry_their_tuned_tree(tiny_model, ref):
    e = Engine(tiny_model, assets={"medusa": LoadedHeads(random_heads(tiny_model))})
    with pytest.raises(ValueError, match="carry a tuned tree"):
        e.generate(PROMPTS, max_new_tokens=M, spec=SpecConfig.make("medusa", tree="heads"))
    tree = [[0], [1], [0, 0], [0, 0, 0]]
    e.set_asset("medusa", LoadedHeads(random_heads(tiny_model), tree=tree))
    assert e.build_decoder(e.resolve(SpecConfig.make("medusa", tree="heads")), cache_length=64)[0].window == 5
    res = e.generate(PROMPTS, max_new_tokens=M, spec=SpecConfig.make("medusa", tree="heads"))
    assert [r.tokens for r in res] == [t[:M] for t in ref]
    assert_accepted(res)
    assert res[0].k == 3


def test_token_input_heads(tiny_model, ref, key):
    """Heads that also read the pending token: zero-init equals the base head; greedy identity."""
    cfg = tiny_model.config
    zero = MedusaHeads(HeadsConfig.for_model(cfg, token_input=True), rngs=nnx.Rngs(0))
    h = jax.random.normal(key, (3, cfg.dim))
    toks = jnp.asarray([1, 2, 3])
    np.testing.assert_array_equal(zero(h, tiny_model, toks), jnp.stack([tiny_model.logits(h)] * 4, 1))
    with pytest.raises(ValueError, match="token_input"):
        zero.features(h)
    heads = random_heads(tiny_model, seed=5, token_input=True)
    assert not np.allclose(heads(h, tiny_model, toks), heads(h, tiny_model, toks + 1))  # it reads them
    e = Engine(tiny_model, assets={"medusa": LoadedHeads(heads)})
    for spec in (SpecConfig(method="medusa", k=4), SpecConfig.make("medusa", tree="small")):
        res = e.generate(PROMPTS, max_new_tokens=M, spec=spec)
        assert [r.tokens for r in res] == [t[:M] for t in ref]
        assert_accepted(res)
    assert_accepted(res)
