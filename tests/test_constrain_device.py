"""Constraints inside the loop: a toy automaton from this file through every method, on the tiny model.

Greedy constrained output of every method equals the constrained plain loop token for token (a batch
of ragged rows, constrained by two automata and free, in one program), every answer walks its
automaton to an accepting state, free rows equal an unconstrained decoder's, and a second set of
automata runs without compiling anything.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from specjax.core.constraint import PoolSpec
from specjax.core.decoder import Decoder, Inputs, cache_length, new_tokens
from specjax.core.decoder import generate as specjax_generate
from specjax.core.host_lookup import replay
from specjax.methods.config import SpecConfig
from specjax.methods.draft.record import DraftModel
from specjax.methods.eagle.record import LoadedEagle
from specjax.methods.forced.proposer import host_replay as forced_host_replay
from specjax.methods.medusa.record import LoadedHeads
from specjax.models import config as model_config
from specjax.models import loader
from specjax.models.eagle import EagleConfig, EagleHead
from specjax.models.heads import HeadsConfig, MedusaHeads
from specjax.serving.engine import Engine
from specjax.telemetry import SpecCounters

V = 64
STOP = 2
PROMPTS = [[5, 9, 12, 5, 9, 12, 5, 9], [11, 12, 13, 11, 12], [40, 41, 42, 43, 40, 41], [7, 7, 30], [1, 2, 3, 4, 5, 6]]
MAX_NEW = [12, 9, 16, 7, 11]
BUCKET, NEW = 16, 16


@dataclasses.dataclass(frozen=True)
class Toy:
    """An automaton over token ids, in `specjax.constrain.TokenTables`' layout (class 0: refused)."""

    token_class: np.ndarray
    next_state: np.ndarray
    accepting: np.ndarray
    forced: np.ndarray | None = None

    @classmethod
    def build(cls, classes: dict[int, list[int]], moves: dict[tuple[int, int], int], accepting: set[int],
              vocab: int = V) -> "Toy":
        tc = np.zeros(vocab, np.int32)
        for c, toks in classes.items():
            tc[toks] = c
        s = 1 + max(max(a, b) for (a, _), b in moves.items())
        nxt = np.full((s, 1 + max(classes)), -1, np.int32)
        for (a, c), b in moves.items():
            nxt[a, c] = b
        return cls(tc, nxt, np.isin(np.arange(s), sorted(accepting)))

    def valid(self, tokens: list[int], stop: int = STOP) -> bool:
        """Whether `tokens` walk from state 0 to an accepting state, a `stop` token last if any."""
        state = 0
        for i, t in enumerate(tokens):
            if t == stop:
                return i == len(tokens) - 1 and bool(self.accepting[state])
            state = int(self.next_state[state, self.token_class[t]])
            if state < 0:
                return False
        return True  # cut by the budget: a valid prefix


# digits (10..19) one or more, then 5, then the answer is complete
DIGITS = Toy.build({1: list(range(10, 20)), 2: [5]}, {(0, 1): 1, (1, 1): 1, (1, 2): 2}, {2})
# forced 3 7 3 7, then 20 or 21, or 22 and a digit: then the answer is complete (a stop is forced)
FORCED = Toy.build({1: [3], 2: [7], 3: [20, 21], 4: [22], 5: list(range(10, 20))},
                   {(0, 1): 1, (1, 2): 2, (2, 1): 3, (3, 2): 4, (4, 3): 5, (4, 4): 6, (6, 5): 7}, {5, 7})
FORCED = dataclasses.replace(FORCED, forced=np.array([[3, 7, 3, 7], [7, 3, 7, -1], [3, 7, -1, -1], [7, -1, -1, -1]]
                                                     + [[-1] * 4] * 2 + [[STOP, -1, -1, -1]] * 2, np.int32))
# three rows constrained, two free (0); the free ones must equal an unconstrained decoder's output
SLOTS = [1, 0, 2, 1, 0]


@pytest.fixture(scope="module")
def eng(tiny_model):
    cfg = tiny_model.config
    heads = MedusaHeads(HeadsConfig.for_model(cfg, num_heads=4), base=tiny_model, rngs=nnx.Rngs(0))
    head = EagleHead(EagleConfig.for_model(cfg, draft_vocab=64), rngs=nnx.Rngs(2))
    return Engine(tiny_model, assets={"draft": DraftModel(loader.init_model(model_config.preset("tiny"), seed=1)),
                                      "medusa": LoadedHeads(heads), "eagle": LoadedEagle(head, np.arange(64))})


def _inputs(slots=SLOTS):
    return Inputs.create(PROMPTS, bucket=BUCKET, max_new_tokens=MAX_NEW, stop_ids=[STOP], constraint=slots)


def _run(eng, spec, constraints=(DIGITS, FORCED), slots=SLOTS, pool=True):
    proposer, pparams = eng.proposer(spec) if spec else (None, None)
    window = 1 if proposer is None else Decoder(proposer=proposer, cache_length=64).window
    dec = Decoder(cache_length=cache_length(BUCKET, NEW, window), proposer=proposer,
                  constraints=PoolSpec(vocab=V, capacity=2, states=8, classes=8) if pool else None)
    state = specjax_generate(eng.model, _inputs(slots), decoder=dec, pparams=pparams,
                             constraints=constraints if pool else ())
    return new_tokens(state)


@pytest.fixture(scope="module")
def plain(eng):
    return _run(eng, None)


def test_constrained_plain_follows_each_rows_automaton(eng, plain):
    free = _run(eng, None, slots=[0] * len(PROMPTS), pool=False)
    for r, (slot, toks) in enumerate(zip(SLOTS, plain)):
        assert toks, r
        if slot == 0:  # a free row in a constrained batch decodes as without a pool
            assert toks == free[r], r
        else:
            automaton = (DIGITS, FORCED)[slot - 1]
            assert automaton.valid(toks), (r, toks)
            assert toks[-1] == STOP or len(toks) == MAX_NEW[r], (r, toks)
    assert plain[2][:4] == [3, 7, 3, 7] and plain[2][-1] == STOP and len(plain[2]) in (6, 7)


SPECS = {
    "ngram": SpecConfig(method="ngram", k=4),
    "draft": SpecConfig(method="draft", k=3),
    "medusa_tree": SpecConfig.make("medusa", tree="small"),
    "eagle_dynamic": SpecConfig.make("eagle", k=3, nodes=6, topk=2),
    "recycle": SpecConfig(method="recycle", k=3),
    "forced": SpecConfig(method="forced", k=4),
}


@pytest.mark.parametrize("name", SPECS)
def test_every_method_equals_constrained_plain(eng, plain, name):
    assert _run(eng, SPECS[name]) == plain


def test_new_automata_reuse_the_compiled_programs(eng, plain):
    from conftest import PROGRAM_EVENTS

    events = []

    def listen(event, _secs, **_):
        if event in PROGRAM_EVENTS:
            events.append(event)

    spec = SPECS["draft"]
    _run(eng, spec)  # warm: the programs of this decoder exist
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        swapped = _run(eng, spec, constraints=(FORCED, DIGITS))
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert events == []
    for slot, toks in zip(SLOTS, swapped):
        if slot:
            assert (FORCED, DIGITS)[slot - 1].valid(toks), toks


def test_misuse_is_refused():
    with pytest.raises(ValueError, match="needs a stop token"):
        Inputs.create([[1, 2]], constraint=1)
    with pytest.raises(ValueError, match="constraint=-1"):
        Inputs.create([[1, 2]], constraint=-1, stop_ids=[STOP])
    with pytest.raises(ValueError, match="holds at most"):
        PoolSpec(vocab=V, states=2, classes=8).pack(DIGITS.token_class, DIGITS.next_state, DIGITS.accepting)


# ---- sampling under a mask keeps the masked target distribution ---------------------------------


def _toy16():
    """An automaton over test_lossless's 16-token vocabulary: three classes, every state live; 15 is
    the stop token (never accepting here, so never allowed)."""
    return Toy.build({1: list(range(0, 6)), 2: list(range(6, 11)), 3: list(range(11, 15))},
                     {(0, 1): 1, (0, 2): 2, (1, 1): 1, (1, 2): 2, (1, 3): 0, (2, 1): 0, (2, 3): 1}, set(), vocab=16)


def _masked_joint(model, toy, opts):
    """Exact P(t1..t4) of constrained sampling: the target's logits masked by the automaton's state
    after each prefix, then the sampling filters (as the loop applies them)."""
    import itertools

    import jax.numpy as jnp
    from conftest import full_logits
    from test_lossless import NEW, PROMPT, joint
    from test_lossless import V as V16

    from specjax.core import sampling
    from specjax.core.sampling import SamplingParams

    prefixes = np.array(list(itertools.product(range(V16), repeat=NEW - 1)), np.int32)
    tokens = np.concatenate([np.tile(PROMPT, (len(prefixes), 1)), prefixes], axis=1)
    logits = np.asarray(full_logits(*nnx.split(model), jnp.asarray(tokens))[:, len(PROMPT) - 1:])
    ok = np.zeros(logits.shape, bool)
    for r, pre in enumerate(prefixes):
        state = 0
        for i in range(NEW):
            ok[r, i] = (state >= 0) & (toy.next_state[max(state, 0)][toy.token_class[:V16]] >= 0)
            if i < NEW - 1:
                state = int(toy.next_state[state, toy.token_class[pre[i]]]) if state >= 0 else -1
    masked = np.where(ok, logits, sampling.NEG_INF)
    params = SamplingParams.create(len(prefixes), opts.get("temperature", 0.0), opts.get("top_k", 0),
                                   opts.get("top_p", 1.0))
    c = np.asarray(sampling.probs(jnp.asarray(masked), params), np.float64).reshape((V16,) * (NEW - 1) + (NEW, V16))
    return joint(c)


class RootMaskOnly(Decoder):
    """WRONG on purpose: every window slot masked with the row's state before the drafts (the drafts
    are not walked through the automaton)."""

    def _walk(self, state, nodes, topo):
        return jax.numpy.broadcast_to(state.automaton[:, None], (nodes.shape[0], nodes.shape[1] + 1))


@pytest.mark.parametrize("setting", ["t1.0", "top_k4"])
def test_sampling_under_a_mask_follows_the_masked_target(setting):
    from test_lossless import CONFIG, NEW, PROMPT, SETTINGS, pair, PAIRS
    from test_lossless import V as V16

    from scipy import stats

    target, draft = loader.init_model(CONFIG, seed=0), loader.init_model(CONFIG, seed=1)
    toy, opts, n = _toy16(), SETTINGS[setting], 8192
    dist = _masked_joint(target, toy, opts)
    proposer, pparams = Engine(target, assets={"draft": DraftModel(draft)}).proposer(SpecConfig(method="draft", k=2))
    inputs = Inputs.create([PROMPT] * n, max_new_tokens=NEW, seed=5 + len(setting), stop_ids=[15],
                           constraint=1, **opts)
    pool = PoolSpec(vocab=V16, capacity=1, states=4, classes=4)

    def sample(cls):
        dec = cls(proposer=proposer, sampling="sample", cache_length=64, constraints=pool)
        state = specjax_generate(target, inputs, decoder=dec, pparams=pparams, constraints=(toy,))
        toks = np.array(new_tokens(state))
        assert toks.shape == (n, NEW)
        return toks, state.stats

    def pvalue(toks):
        worst = 1.0
        for i, j in PAIRS:
            probs = pair(dist, i, j)
            counts = np.bincount(toks[:, i] * V16 + toks[:, j], minlength=len(probs)).astype(np.float64)
            if counts[probs <= 1e-12].sum():
                return 0.0  # an outcome the masked target never gives
            exp = probs / probs.sum() * n
            big = exp >= 5
            obs, ex = np.append(counts[big], counts[~big].sum()), np.append(exp[big], exp[~big].sum())
            worst = min(worst, stats.chisquare(obs[ex > 0], ex[ex > 0]).pvalue)
        return worst

    toks, st = sample(Decoder)
    assert all(toy.valid(list(t), stop=15) for t in toks)
    assert pvalue(toks) > 1e-3
    assert 0 < int(st.accepted.sum()) < int(st.drafted.sum())
    broken, _ = sample(RootMaskOnly)  # the negative control: the same test rejects it
    assert pvalue(broken) < 1e-6


def test_running_batch_uploads_a_constraint_into_its_pool_without_compiling(tiny_model):
    """The host's insert path: a constraint uploaded into a pool slot, then a request inserted with that
    slot, beside a free one; a second constraint replaces the first in the same slot. Each request's
    tokens are its batch-of-one constrained generation, and nothing compiles after the constructor."""
    from specjax.core.slots import RunningBatch, Slots
    from specjax.methods.ngram.proposer import NgramProposer

    pool = PoolSpec(vocab=V, capacity=2, states=8, classes=8)
    s = 64
    ops = Slots(base=Decoder(cache_length=s, constraints=pool),
                decoders=(Decoder(cache_length=s, proposer=NgramProposer(k=3), constraints=pool),))
    eng = Engine(tiny_model)
    rows = lambda p, c, r: Inputs.create([p], bucket=8, max_new_tokens=12, stop_ids=[STOP], constraint=c, row_ids=[r])
    rb = RunningBatch(ops, params=eng.params, pparams=(None,), compile=eng.program,
                      empty=Inputs.create([[0]] * 2, bucket=1, max_new_tokens=1), loops=(None, 0))
    rb.compile_insert(rows([1], 0, 0))
    compiled = eng.compile_count

    def alone(p, c, r, toy):
        state = specjax_generate(tiny_model, rows(p, c, r), decoder=ops.base, constraints=(toy,) * c)
        return new_tokens(state)[0]

    for toy, prompt in ((DIGITS, [5, 9, 12, 5, 9]), (FORCED, [7, 7, 30])):
        rb.upload(1, toy)
        got = {}
        for slot, (p, c) in enumerate(((prompt, 1), ([40, 41, 42], 0))):
            view = rb.insert(slot, rows(p, c, slot))
            got[slot] = (p, c, [int(view.tokens[slot, len(p)])])
        while not rb.read().done.all():
            chunk = rb.run(0, 3)
            for slot in got:
                got[slot][2].extend(chunk.new_tokens(slot))
        for slot, (p, c, toks) in got.items():
            assert toks == alone(p, c, slot, toy), (slot, toks)
        assert toy.valid(got[0][2])
    assert eng.compile_count == compiled
    with pytest.raises(ValueError, match="must be in"):
        rb.upload(3, DIGITS)


def test_forced_drafts_the_text_the_automaton_fixes(eng, plain):
    """The forced method drafts FORCED's fixed tokens: the row under it keeps 3 drafts at its first
    step (7 3 7 after the prefill's 3); its output is constrained plain's. Replayed on the host over
    the committed text (`forced.host_replay`, what the auto scheduler learns from while other options
    run), every row's counters are the real run's, but for a last step the text ends in."""
    proposer, pparams = eng.proposer(SPECS["forced"])
    dec = Decoder(cache_length=cache_length(BUCKET, NEW, 5), proposer=proposer,
                  constraints=PoolSpec(vocab=V, capacity=2, states=8, classes=8))
    state = specjax_generate(eng.model, _inputs(), decoder=dec, pparams=pparams, constraints=(DIGITS, FORCED))
    assert new_tokens(state) == plain
    hist = np.asarray(state.stats.accept_hist)[2]  # row 2: FORCED
    assert hist[3] >= 1, hist
    tables = {0: None, 1: DIGITS, 2: FORCED}
    for r, (prompt, toks) in enumerate(zip(PROMPTS, plain)):
        text = prompt + toks
        lookup = forced_host_replay(SPECS["forced"], text[:len(prompt) + 1], prompt_len=len(prompt),
                                    constraint=tables[SLOTS[r]])
        kept, steps = replay(lookup, text)
        real = SpecCounters.from_stats(state.stats, r)
        gap = [a - b for a, b in zip(real.accepted_tokens_per_pos, kept)]
        if steps == real.num_drafts:
            assert gap == [0] * 4, r
        else:  # the real run's last step: the text ends before its outcome's next token
            assert steps == real.num_drafts - 1 and set(gap) <= {0, 1} and gap == sorted(gap, reverse=True), r
        if SLOTS[r] == 2:
            assert kept[:3] == [1, 1, 1], kept  # 7 3 7, forced after the first token


# 5, then a dead state: not accepting and nothing allowed (hand-built: the compiler prunes such states)
DEAD = Toy.build({1: [5]}, {(0, 1): 1}, set())


@pytest.mark.parametrize("spec", [SpecConfig(), SpecConfig(method="ngram", k=4)], ids=["plain", "ngram"])
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "t1.0"])
def test_a_dead_state_ends_the_answer_with_constraint_unmet(eng, spec, temperature):
    """A row whose automaton reaches a dead state is never masked to all NEG_INF: its stop token is
    allowed there, the answer ends with it, and the result says the constraint was not met; a met
    answer says stop_token, in the same batch."""
    from specjax.core.constraint import met
    from specjax.serving.engine import GenerateOptions

    opts = GenerateOptions(max_new_tokens=8, stop_ids=(STOP,), temperature=temperature, seed=3)
    dead = eng.start([[1, 2, 3], [9, 8, 7]], opts, spec=spec, constraint=DEAD).run()
    for res in dead:
        assert res.tokens == [5, STOP] and res.stop_reason == "constraint_unmet", res
    done = eng.start([PROMPTS[0]], dataclasses.replace(opts, max_new_tokens=16), spec=spec, constraint=DIGITS).run()[0]
    assert done.stop_reason == "stop_token" and DIGITS.valid(done.tokens) and met(DIGITS, done.tokens, [STOP])
    assert not met(DEAD, [5, STOP], [STOP]) and not met(DIGITS, [10, 3, STOP], [STOP])


def test_a_dead_state_in_the_scheduler_is_a_finish_reason(tiny_model):
    """Through the scheduler (the server's path): the request ends with stop reason constraint_unmet,
    which the server sends as that finish_reason."""
    from specjax.serving.constraints import ConstraintLimits
    from specjax.serving.engine import GenerateOptions
    from specjax.serving.scheduler import Scheduler
    from specjax.serving.server.engine_thread import FINISH

    s = Scheduler(Engine(tiny_model), slots=1, opts=GenerateOptions(max_new_tokens=8, stop_ids=(STOP,)),
                  max_prompt_tokens=16, constraint_pool=ConstraintLimits(states=8, classes=8))
    s.submit([1, 2, 3], constraint=DEAD)
    s.submit([1, 2, 3], constraint=DIGITS)
    dead, digits = s.run()
    assert (dead.tokens, dead.stop_reason, FINISH[dead.stop_reason]) == ([5, STOP], "constraint_unmet", "constraint_unmet")
    assert digits.stop_reason in ("stop_token", "max_new_tokens") and DIGITS.valid(digits.tokens)
