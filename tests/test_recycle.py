"""Token recycling (`specjax.methods.recycle`): the matrix's update against a numpy reference, greedy
output equal to plain decoding (chains, trees, batches, Engine and Scheduler), tenant isolation,
compile counts, the warm start, prompt lookup on the spine, and bad options refused before any
compile. Sampling stays lossless: test_lossless.py."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import padded_logits
from flax import nnx

from specjax.core.decoder import Decoder, Inputs
from specjax.methods import registry
from specjax.methods.config import SpecConfig
from specjax.methods.recycle import assets as recycle_assets
from specjax.methods.recycle import record
from specjax.methods.recycle.matrix import RecycleParams, RecycleSpec, pair_slot
from specjax.serving.engine import Engine, GenerateOptions
from specjax.serving.scheduler import Scheduler

PROMPTS = [[5, 9, 12, 5, 9, 12, 5, 9], [40, 41, 42, 43, 40, 41], list(range(1, 20))]
M = 24
TREE = ((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 0, 0, 0))
WIDE = tuple((r,) for r in range(6)) + tuple((a, b) for a in range(3) for b in range(5)) + tuple(
    (0, b, c) for b in range(3) for c in range(4)) + ((0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 0, 0, 0))  # 36 nodes


def recycle(**kw) -> SpecConfig:
    return SpecConfig.make("recycle", **kw)


@pytest.fixture(scope="module")
def eng(tiny_model):
    return Engine(tiny_model)


@pytest.fixture(scope="module")
def plain(eng):
    return [r.tokens for r in eng.generate(PROMPTS, max_new_tokens=M)]


# ---- the update against a numpy reference ----------------------------------------------------------


def _top(logits, k):
    """numpy top-k, best first, ties to the lower id (as lax.top_k)."""
    return np.argsort(-logits, axis=-1, kind="stable")[..., :k]


class Reference:
    """The recycling state in numpy: writes applied in increasing priority, so the highest wins."""

    def __init__(self, spec: RecycleSpec):
        self.spec = spec
        t, v, k, z = spec.tenants, spec.vocab, spec.k, spec.slots
        self.first, self.first_owner = np.zeros((t, v, k), np.int32), np.full((t, v), -1, np.int32)
        self.keys, self.owner, self.second = np.full((z, 2), -1, np.int32), np.full((z,), -1, np.int32), np.zeros((z, k), np.int32)

    def write(self, writes):
        """writes: (priority, tenant, prev, cur, top-k) tuples of one commit."""
        for _, tenant, prev, cur, top in sorted(writes, key=lambda w: w[0]):
            self.first[tenant % self.spec.tenants, cur] = top
            self.first_owner[tenant % self.spec.tenants, cur] = tenant
            if prev >= 0:
                slot = int(pair_slot(jnp.asarray(prev), jnp.asarray(cur), jnp.asarray(tenant), self.spec.slots))
                self.keys[slot], self.owner[slot], self.second[slot] = (prev, cur), tenant, top

    def check(self, state):
        for name in ("first", "first_owner", "keys", "owner", "second"):
            np.testing.assert_array_equal(np.asarray(getattr(state, name)), getattr(self, name), err_msg=name)


def test_update_equals_a_numpy_reference(tiny_model):
    """Prefill (every prompt position) then one tree step (every window node, rejected ones too), on
    three ragged rows of two tenants over two matrices: the live state equals the numpy reference,
    duplicate keys in one commit included (the accepted path first, then the later slot, then the
    higher row)."""
    graphdef, params = nnx.split(tiny_model)
    k, _v = 4, tiny_model.config.vocab_size
    spec = recycle(tree=TREE, recycle_k=k, recycle_tenants=2, recycle_table=97, recycle_spine=0)
    proposer, warm = registry.build(spec, registry.Assets(target=tiny_model))
    rs = proposer.spec
    dec = Decoder(cache_length=64, proposer=proposer)
    prompts = [[5, 9, 12, 5, 9, 12, 5, 9], [7, 7, 7], [40, 41, 40, 41, 40]]
    tenants = [0, 1, 2]
    inputs = Inputs.create(prompts, max_new_tokens=20, tenant=tenants)
    prefill = jax.jit(lambda p, i: dec.prefill(nnx.merge(graphdef, p), warm, i))
    step = jax.jit(lambda p, s: dec.step(nnx.merge(graphdef, p), warm, s))
    s0 = prefill(params, inputs)
    ref = Reference(rs)
    logits = padded_logits(tiny_model, prompts)
    b = len(prompts)
    ref.write([(p * b + r + 1, tenants[r], prompts[r][p - 1] if p else -1, prompts[r][p], _top(logits[r, p], k))
               for r in range(b) for p in range(len(prompts[r]))])
    ref.check(s0.decode.shared.parts["recycle"])
    # one step: the window the proposer drafts, scored by full forwards over each node's path
    nodes = np.asarray(proposer.propose(warm, None, s0.decode, dec.sampling, None)[0])
    s1 = step(params, s0)
    topo = proposer.topology
    committed = [np.asarray(s0.decode.tokens)[r, :int(s0.decode.lengths[r])].tolist() for r in range(b)]
    writes, dup, rejected, kept = [], False, 0, 0
    for r in range(b):
        window = [committed[r][-1]] + nodes[r].tolist()
        path_of = lambda w: ([] if w == 0 else path_of(int(topo.parent[w])) + [w])
        seqs = [committed[r] + [window[x] for x in path_of(w)] for w in range(len(window))]
        lg = padded_logits(tiny_model, seqs)
        at = [lg[w, len(seqs[w]) - 1] for w in range(len(window))]
        ok = {0}
        for w in range(1, len(window)):  # greedy acceptance, by the reference's own logits
            if int(topo.parent[w]) in ok and window[w] == int(np.argmax(at[int(topo.parent[w])])):
                ok.add(w)
        deepest = max(ok, key=lambda w: (int(topo.depth[w]), -w))
        on_path = set(path_of(deepest)) | {0}
        kept += len(on_path) - 1
        rejected += len(window) - len(on_path)
        dup |= len(set(window)) < len(window)
        for w in range(len(window)):
            prev = committed[r][-2] if w == 0 else window[int(topo.parent[w])]
            order = (w in on_path) * len(window) + w
            writes.append((order * b + r + 1, tenants[r], prev, window[w], _top(at[w], k)))
        assert int(s1.decode.lengths[r]) == len(committed[r]) + len(on_path)  # the step kept that path
    ref.write(writes)
    ref.check(s1.decode.shared.parts["recycle"])
    assert kept > 0 and rejected > 0 and dup, (kept, rejected, dup)  # accepted, rejected, duplicate keys


# ---- greedy output equals plain -----------------------------------------------------------------


@pytest.mark.parametrize("kw", [dict(k=3), dict(tree=TREE), dict(tree=record.DEFAULT_TREE, recycle_spine=0),
                                dict(tree=WIDE, recycle_order=1)], ids=["chain3", "tree9", "tree16-nospine", "tree36-first-order"])
def test_engine_greedy_equals_plain(eng, plain, kw):
    res = eng.generate(PROMPTS, max_new_tokens=M, spec=recycle(**kw))
    assert [r.tokens for r in res] == plain
    assert sum(r.counters.num_accepted_tokens for r in res) > 0  # drafts were accepted
    assert all(r.counters.num_draft_tokens > r.counters.num_accepted_tokens for r in res)


def _serve(eng, prompts, *, spec, slots=2, tenants=None, **kw):
    s = Scheduler(eng, slots=slots, spec=spec, chunk=3, opts=GenerateOptions(max_new_tokens=M),
                  max_prompt_tokens=32, **kw)
    for i, p in enumerate(prompts):
        s.submit(p, tenant=0 if tenants is None else tenants[i])
    return s, s.run()


def test_scheduler_greedy_equals_plain_and_the_matrix_persists(eng, plain):
    """Through the scheduler's insert path, several rows per chunk: equal to plain; the same prompt
    again later is drafted from what the first request left in the matrix."""
    s, out = _serve(eng, PROMPTS + PROMPTS[:1], spec=recycle(tree=TREE))
    assert [r.tokens for r in out] == plain + plain[:1]
    first, again = out[0].counters, out[3].counters
    assert again.num_drafts < first.num_drafts  # fewer steps for the same tokens
    mem = s.memory(measured=False).parts
    specs = {x.name: x for x in s.shared}
    assert mem["recycle"] == specs["recycle"].nbytes > 0  # the matrix and the second-order table
    assert mem["ngram_table"] == specs["ngram_table"].nbytes > 0  # the spine's table


# ---- tenants -------------------------------------------------------------------------------------


@pytest.mark.parametrize("tenants", [1, 2])
def test_tenants_never_draft_from_each_others_rows(eng, plain, tenants):
    """Request B after request A on the same prompt: under another tenant B drafts exactly as in a
    fresh scheduler (nothing of A's), under A's tenant it drafts from A's rows and keeps more."""
    spec = recycle(tree=TREE, recycle_tenants=tenants, recycle_spine=0)
    prompt = [PROMPTS[2]]
    fresh = _serve(eng, prompt, spec=spec, slots=1, tenants=[2])[1][0].counters
    other = _serve(eng, prompt * 2, spec=spec, slots=1, tenants=[1, 2])[1][1].counters
    same = _serve(eng, prompt * 2, spec=spec, slots=1, tenants=[1, 1])[1][1].counters
    assert other.to_dict() == fresh.to_dict()
    assert same.num_drafts < fresh.num_drafts  # A's rows: fewer steps for the same tokens


def test_rows_read_only_their_tenants_entries(tiny_model):
    spec = RecycleSpec(vocab=tiny_model.config.vocab_size, k=3, table=31)
    warm = RecycleParams.cold(spec.vocab, 3)
    state = spec.init().replace(first=jnp.full((1, spec.vocab, 3), 7, jnp.int32),
                                first_owner=jnp.full((1, spec.vocab), 1, jnp.int32))
    cur, prev = jnp.asarray([[4, 5]]), jnp.asarray([[-1, 4]])
    assert (np.asarray(spec.rows(state, warm, prev, cur, jnp.asarray([1]))) == 7).all()
    np.testing.assert_array_equal(spec.rows(state, warm, prev, cur, jnp.asarray([2]))[0], [[0, 1, 2]] * 2)


# ---- compile counts, bad options ------------------------------------------------------------------


def test_the_matrix_contents_never_recompile(tiny_model):
    """Other warm starts of the same shape, and a live matrix that fills up across requests, reuse
    the compiled programs."""
    eng = Engine(tiny_model)
    spec = recycle(tree=TREE)
    eng.generate(PROMPTS, max_new_tokens=M, spec=spec)
    n = eng.compile_count
    v = tiny_model.config.vocab_size
    rng = np.random.default_rng(0)
    for _ in range(2):
        first = np.stack([rng.permutation(v)[:8] for _ in range(v)]).astype(np.int32)
        eng.set_asset("recycle", record.WarmStart(RecycleParams(first=jnp.asarray(first),
                                                                keys=jnp.full((1, 2), -1, jnp.int32),
                                                                second=jnp.zeros((1, 8), jnp.int32))))
        eng.generate(PROMPTS, max_new_tokens=M, spec=spec)
    assert eng.compile_count == n
    s, _ = _serve(eng, PROMPTS, spec=spec)
    n = eng.compile_count
    for p in PROMPTS * 2:
        s.submit(p)
    s.run()
    assert eng.compile_count == n


@pytest.mark.parametrize("kw, match", [
    (dict(recycle_k=0), r"recycle_k=0: the matrix keeps 1\.\.32"),
    (dict(recycle_k=33), r"recycle_k=33: the matrix keeps 1\.\.32"),
    (dict(tree=((0,), (8,))), r"rank 8, beyond the matrix's recycle_k=8"),
    (dict(tree=((0,), (1, 0))), "parent"),
    (dict(tree="heads"), "tree='heads'"),
    (dict(recycle_order=3), "recycle_order=3"),
])
def test_bad_options_fail_before_any_compile(tiny_model, kw, match):
    eng = Engine(tiny_model)
    with pytest.raises(ValueError, match=match):
        eng.generate(PROMPTS, max_new_tokens=4, spec=recycle(**kw))
    assert eng.compile_count == 0


# ---- the spine, the warm start ---------------------------------------------------------------------


def test_prompt_lookup_fills_the_spine_and_siblings_stay_distinct(tiny_model):
    """The context ends with [4, 5], which occurred before followed by 6, 7, 8, 3: with the spine the
    rank-0 chain is those followers; without it, the matrix's candidates. Siblings are distinct
    tokens either way (the spine token is taken out of the candidates after it)."""
    ctx = [3, 4, 5, 6, 7, 8, 3, 4, 5]
    graphdef, params = nnx.split(tiny_model)
    chains = {}
    for spine in (2, 0):
        proposer, warm = registry.build(recycle(tree=TREE, recycle_spine=spine), registry.Assets(target=tiny_model))
        dec = Decoder(cache_length=32, proposer=proposer)
        s = jax.jit(lambda p, i: dec.prefill(nnx.merge(graphdef, p), warm, i))(
            params, Inputs.create([ctx[:-1]], max_new_tokens=8)).decode
        s = s.replace(tokens=s.tokens.at[0, :len(ctx)].set(jnp.asarray(ctx)), lengths=jnp.asarray([len(ctx)]))
        nodes = np.asarray(proposer.propose(warm, None, s, dec.sampling, None)[0])[0]
        chains[spine] = [int(nodes[TREE.index((0,) * d)]) for d in (1, 2, 3, 4)]
        for parent in set(p[:-1] for p in TREE):
            kids = [int(nodes[i]) for i, p in enumerate(TREE) if p[:-1] == parent]
            assert len(set(kids)) == len(kids), (spine, parent, kids)
    assert chains[2] == [6, 7, 8, 3] and chains[0] != chains[2]


def test_warm_start_round_trip_and_refusals(tiny_model, tmp_path):
    """A warm start saved and loaded gives the same drafts; one for another vocabulary, or with a
    token id outside it, is refused."""
    v, k = tiny_model.config.vocab_size, 4
    rng = np.random.default_rng(1)
    first = np.stack([rng.permutation(v)[:k] for _ in range(v)]).astype(np.int32)
    written = rng.random(v) < 0.5
    keys = np.full((13, 2), -1, np.int32)
    second = np.zeros((13, k), np.int32)
    for prev, cur in ((1, 2), (3, 4)):
        slot = int(pair_slot(jnp.asarray(prev), jnp.asarray(cur), jnp.asarray(0), 13))
        keys[slot], second[slot] = (prev, cur), rng.permutation(v)[:k]
    recycle_assets.save(tmp_path / "w", first=first, written=written, keys=keys, second=second,
                        manifest=dict(model="tiny"))
    got = recycle_assets.load(tmp_path / "w", vocab=v, k=k, name="tiny")
    np.testing.assert_array_equal(np.asarray(got.first)[written], first[written])
    np.testing.assert_array_equal(np.asarray(got.first)[~written], np.broadcast_to(np.arange(k), ((~written).sum(), k)))
    np.testing.assert_array_equal(np.asarray(got.keys), keys)
    with pytest.raises(ValueError, match="vocabulary of 64, the model has 65"):
        recycle_assets.load(tmp_path / "w", vocab=v + 1, k=k)
    with pytest.raises(ValueError, match="written for model 'tiny', this is 'other'"):
        recycle_assets.load(tmp_path / "w", vocab=v, k=k, name="other")
    with pytest.raises(ValueError, match="recycle_k=8 needs at least 8"):
        recycle_assets.load(tmp_path / "w", vocab=v, k=8)
    bad = first.copy()
    bad[np.flatnonzero(written)[0], 0] = v
    recycle_assets.save(tmp_path / "bad", first=bad, written=written, keys=keys, second=second, manifest={})
    with pytest.raises(ValueError, match="outside the vocabulary"):
        recycle_assets.load(tmp_path / "bad", vocab=v, k=k)


def test_warm_start_from_the_targets_own_answer_drafts_on_the_first_request(tiny_model, tmp_path):
    """`warm` on one prompt, then that prompt in a fresh engine: its drafts are accepted more often
    than cold, output unchanged; `recycle_warm="cold"` ignores the loaded warm start."""
    from train_heads import recycle as warm_recycle

    eng = Engine(tiny_model)
    spec = RecycleSpec(vocab=tiny_model.config.vocab_size, k=8, table=1 << 10)
    seqs = [p + r.tokens for p, r in zip(PROMPTS, eng.generate(PROMPTS, max_new_tokens=M))]
    state = warm_recycle.write(eng, seqs, spec)
    written = np.asarray(state.first_owner[0]) == 0
    recycle_assets.save(tmp_path / "w", first=np.asarray(state.first[0]), written=written,
                        keys=np.where((np.asarray(state.owner) == 0)[:, None], np.asarray(state.keys), -1),
                        second=np.asarray(state.second), manifest=dict(model=eng.name))
    rate = {}
    for warm in ("cold", str(tmp_path / "w")):
        res = eng.generate(PROMPTS, max_new_tokens=M, spec=recycle(tree=TREE, recycle_spine=0, recycle_warm=warm))
        assert [r.tokens for r in res] == [s[len(p):] for p, s in zip(PROMPTS, seqs)]
        rate[warm] = sum(r.counters.num_accepted_tokens for r in res) / sum(r.counters.num_drafts for r in res)
    assert rate[str(tmp_path / "w")] > rate["cold"], rate
    eng.load_asset("recycle", str(tmp_path / "w"))
    loaded = eng.generate(PROMPTS, max_new_tokens=M, spec=recycle(tree=TREE, recycle_spine=0))
    assert sum(r.counters.num_accepted_tokens for r in loaded) / sum(r.counters.num_drafts for r in loaded) == rate[str(tmp_path / "w")]


def test_auto_runs_recycle_only_with_a_warm_start_and_adds_its_longest_chain(tiny_model, tmp_path):
    """Auto's recycle options: none without a warm start; with one, the tuned default and tree (the
    untuned default tree here) and a chain as long as auto's longest K, each once."""
    eng = Engine(tiny_model)
    assert record.auto(eng.assets, (0, 2, 4, 8), None) == []
    v, k = tiny_model.config.vocab_size, 8
    recycle_assets.save(tmp_path / "w", first=np.zeros((v, k), np.int32), written=np.zeros(v, bool),
                        keys=np.full((13, 2), -1, np.int32), second=np.zeros((13, k), np.int32),
                        manifest=dict(model=eng.name))
    eng.load_asset("recycle", str(tmp_path / "w"))
    options = record.auto(eng.assets, (0, 2, 4, 8), None)
    assert options == [dict(method="recycle", tree=record.DEFAULT_TREE), dict(method="recycle", k=8)]
    assert record.auto(eng.assets, (0,), None) == [dict(method="recycle", tree=record.DEFAULT_TREE)]
    for o in options:
        registry.check(SpecConfig.make(**o))
