"""The functional core: `Decoder`, a static description of a decoding program, and its pure functions.

Everything that shapes the program (proposer, acceptance rule, sampling method, window, cache
length, the device mesh) lives on the frozen, hashable `Decoder`; everything that only changes values (prompts and
their lengths, max_new_tokens, temperature, top-k, top-p, stop ids, keys) is an array in `Inputs`
and then in the loop carry. Each method is a pure function you may wrap in your own `jax.jit`
(with your shardings and donation):

```python
graphdef, params = nnx.split(model)

@jax.jit
def run(params, inputs):
    model = nnx.merge(graphdef, params)
    state = decoder.prefill(model, pparams, inputs)
    return decoder.decode(model, pparams, state)
```

One speculative step reads as the algorithm does, for chains and trees alike:

```
nodes, q = propose(...)                  # [B, K] drafted tokens (+ q [B, K, V] when sampled)
out = verify(target, state, nodes)       # one target pass over the window (tree mask)
acc = rule.accept(Window(...))         # accepted path and the token after it
state = commit_path(state, acc)          # tokens, K/V of the path, lengths; nothing rolled back
shared = update(shared, observed)        # methods' batch-shared state reads the commit and the scores
pstate = proposer.reconcile(out, acc)    # e.g. a draft cache or the hidden state at the leaf
```

Random streams are per row: row keys come from the seed and the row's global index
(`row_keys`), and each step folds in the row's own position, so a row's sample depends on
neither its batch neighbours nor the batch size.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct
from jax.sharding import Mesh
from jaxtyping import Array, Bool, Int, PyTree

from specjax import sharding
from specjax.core import acceptance
from specjax.core import constraint as constraints_
from specjax.core import sampling
from specjax.core import shared as shared_state
from specjax.core import tree
from specjax.core.logprobs import Logprobs, TokenLogprob, check_top, entries
from specjax.core.proposer import Proposer
from specjax.models.transformer import Output, Transformer
from specjax.core.sampling import Sampling, SamplingParams
from specjax.core.constraint import PoolSpec
from specjax.core.shared import Observed, SharedSpec
from specjax.core.state import (AnyArray, DecodeState, Shared, commit, commit_path, insert_row, last_tokens,
                                scores_of, step_keys, tick)

MAX_STOP_IDS = 8
RUN_TO_END = np.iinfo(np.int32).max


def proposer_topology(proposer: Proposer) -> tree.Topology | tree.DynamicTopology:
    """The verify window a proposer drafts (its declared `Proposer.topology`): its static tree (a
    chain of K for chain proposers), or the node budget of a tree it builds each step
    (`tree.DynamicTopology`)."""
    return proposer.topology


def window_of(proposer) -> int:
    """Tokens the target sees per step with this proposer (its tree's width, the root included)."""
    return proposer_topology(proposer).width


def round_up_pow2(n: int, minimum: int = 16) -> int:
    return max(minimum, 1 << (int(n) - 1).bit_length())


def cache_length(prompt_bucket: int, max_new_tokens: int, window: int) -> int:
    """Cache slots for a batch: its prompt bucket, max_new_tokens rounded up to a power of two
    (so budgets up to the same power share one program), and one window of headroom."""
    return int(prompt_bucket) + round_up_pow2(max_new_tokens) + int(window)


def row_keys(seed: int | Sequence[int], row_ids: Sequence[int]) -> Array:
    """One PRNG key per row: `fold_in(key(seed), row_id)`. Distinct ids never share a stream."""
    seeds = np.broadcast_to(np.asarray(seed, np.uint32), (len(row_ids),))
    ids = np.asarray(row_ids, np.uint32)
    return jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(seeds, ids)


def check_max_new_tokens(value, *, most: int | None = None, why: str = "") -> int:
    """A budget of new tokens, checked: an integer >= 1 (and <= `most`, with `why` that bound); the
    one rule every host applies (`Inputs.create`, `GenerateOptions.validate`, `Scheduler.submit`)."""
    if isinstance(value, bool) or int(value) != value or value < 1 or (most is not None and value > most):
        bound = ">= 1" if most is None else f"in [1, {most}]"
        raise ValueError(f"max_new_tokens={value}: must be an integer {bound}{f' ({why})' if why else ''}")
    return int(value)


def _check_prompts(prompts, bucket: int | None, batch_size) -> tuple[int, int, int]:
    """`Inputs.create`'s prompts checked: (prompts n, rows b, bucket p)."""
    if isinstance(prompts, (str, bytes)) or any(isinstance(p, (str, bytes)) or not hasattr(p, "__len__")
                                                for p in prompts):
        raise ValueError("Inputs.create takes token ids: pass a list of prompts, each a list of ints, "
                         "e.g. [[1, 2, 3]] (tokenize text first, or use Engine.generate([\"text\"]))")
    n = len(prompts)
    if n == 0:
        raise ValueError("no prompts given")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("a prompt is empty: give at least one token")
    if batch_size is not None and (int(batch_size) != batch_size or batch_size < 1):
        raise ValueError(f"batch_size={batch_size}: must be an integer >= 1 (or None: one row per prompt)")
    b = n if batch_size is None else int(batch_size)
    if b < n:
        raise ValueError(f"{n} prompts for batch_size={b}: split them")
    longest = max(len(x) for x in prompts)
    p = longest if bucket is None else int(bucket)
    if longest > p:
        raise ValueError(f"a prompt of {longest} tokens exceeds the bucket of {p}")
    return n, b, p


def _check_rows(per_row: dict, seed, stops: tuple) -> None:
    """`Inputs.create`'s per-row values, seeds and stop tokens checked."""
    if len(stops) > MAX_STOP_IDS:
        raise ValueError(f"{len(stops)} stop tokens: at most {MAX_STOP_IDS} are supported")
    for t, k, tp in zip(per_row["temperature"], per_row["top_k"], per_row["top_p"]):
        sampling.validate(t, k, tp)
    for s in np.ravel(seed):
        if int(s) != s or not 0 <= s < 2 ** 32:
            raise ValueError(f"seed={s}: must be an integer in [0, 2**32)")
    for t in per_row["tenant"]:
        if int(t) != t or not 0 <= t < 2 ** 31:
            raise ValueError(f"tenant={t}: must be an integer in [0, 2**31)")
    for c in per_row["constraint"]:
        if isinstance(c, bool) or int(c) != c or c < 0:
            raise ValueError(f"constraint={c}: must be a pool slot, an integer >= 0 (0: unconstrained)")
    if any(per_row["constraint"]) and not stops:
        raise ValueError("a constrained row needs a stop token (its EOS) to end an answer: pass stop_ids")
    for m in per_row["max_new_tokens"]:
        check_max_new_tokens(m)


def _padded(rows, p: int) -> np.ndarray:
    """Token-id rows right-padded with 0 to `p` columns; a negative id is refused."""
    tokens = np.zeros((len(rows), p), np.int32)
    for r, x in enumerate(rows):
        tokens[r, : len(x)] = x
    if (tokens < 0).any():
        raise ValueError(f"prompt {int(np.argmax((tokens < 0).any(axis=1)))} has a negative token id: "
                         "token ids lie in [0, vocab_size)")
    return tokens


def _per_row(value, n: int, name: str) -> list:
    values = list(value) if isinstance(value, (list, tuple, np.ndarray)) else [value] * n
    if len(values) != n:
        raise ValueError(f"{name} has {len(values)} values for {n} prompts: give one, or one per prompt")
    return values


def _predictions(prediction, bucket, n: int, b: int):
    """(`[b, Q]` token ids right-padded with 0, `[b]` lengths) of the rows' predictions, checked;
    (None, None) when there are none and no bucket is asked for."""
    if prediction is None and bucket is None:
        return None, None
    rows = [None] * n if prediction is None else list(prediction)
    if len(rows) != n:
        raise ValueError(f"prediction has {len(rows)} entries for {n} prompts: give one per prompt (None for none)")
    rows = [[] if r is None else list(r) for r in rows]
    for i, r in enumerate(rows):
        if any(isinstance(t, (str, bytes)) or isinstance(t, bool) or int(t) != t or t < 0 for t in r):
            raise ValueError(f"prediction {i} must be token ids >= 0 (tokenize its text first, or use "
                             "Engine.generate(prediction=...))")
    longest = max((len(r) for r in rows), default=0)
    q = max(longest, 1) if bucket is None else int(bucket)
    if longest > q:
        raise ValueError(f"a prediction of {longest} tokens exceeds prediction_bucket={q}: shorten it, or "
                         "raise the predict method's prediction_cap")
    pred = np.zeros((b, q), np.int32)
    lengths = np.zeros((b,), np.int32)
    for r, x in enumerate(rows):
        pred[r, :len(x)] = x
        lengths[r] = len(x)
    return jnp.asarray(pred), jnp.asarray(lengths)


def _logit_biases(bias, width, n: int, b: int):
    """(`[b, Lb]` token ids padded with -1, `[b, Lb]` values) of the rows' logit biases, checked
    (`sampling.check_logit_bias`); (None, None) when there are none and no width is asked for."""
    if bias is None and width is None:
        return None, None
    rows = [None] * n if bias is None else list(bias)
    if len(rows) != n:
        raise ValueError(f"logit_bias has {len(rows)} entries for {n} prompts: give one per prompt (None for none)")
    rows = [sampling.check_logit_bias({} if r is None else r) for r in rows]
    most = max((len(r) for r in rows), default=0)
    lb = max(most, 1) if width is None else int(width)
    if most > lb:
        raise ValueError(f"a logit_bias of {most} tokens exceeds this host's {lb} per request: send fewer "
                         "(or start the host with a larger logit_bias width)")
    ids, values = np.full((b, lb), -1, np.int32), np.zeros((b, lb), np.float32)
    for r, x in enumerate(rows):
        ids[r, :len(x)] = list(x)
        values[r, :len(x)] = list(x.values())
    return jnp.asarray(ids), jnp.asarray(values)


@struct.dataclass
class Inputs:
    """Per-row inputs of a batch: all arrays, so new values never recompile."""

    prompts: Int[Array, "B P"]  # right-padded to the bucket P
    prompt_lengths: Int[Array, "B"]
    max_new: Int[Array, "B"]
    sampling: SamplingParams
    stop_ids: Int[Array, "B E"]  # padded with -1
    keys: Array  # [B] PRNG keys
    contribute: Bool[Array, "B"]  # the row's text may enter batch-shared method state
    tenant: Int[Array, "B"] | None = None  # the row's scope of that state (see specjax.core.shared)
    prediction: Int[Array, "B Q"] | None = None  # each row's predicted output, right-padded (None: none)
    prediction_lengths: Int[Array, "B"] | None = None  # its tokens (0: the row has none)
    constraint: Int[Array, "B"] | None = None  # the row's constraint pool slot (None, 0: free)

    @classmethod
    def create(cls, prompts: Sequence, *, bucket: int | None = None,  # Sequence[Sequence[int]], checked here
               batch_size=None, max_new_tokens=128, temperature=0.0, top_k=0, top_p=1.0,
               stop_ids: Sequence = (), seed=0, row_ids: Sequence | None = None, contribute=True,
               tenant=0, prediction: Sequence | None = None, prediction_bucket: int | None = None,
               constraint=0, logit_bias: Sequence | None = None, logit_bias_width: int | None = None) -> "Inputs":
        """Pads token-id prompts into a batch.

        Args:
          prompts: token ids per row.
          bucket: padded prompt length P (default: the longest prompt).
          batch_size: rows B (default: one per prompt); extra rows repeat prompt 0 with a budget
            of one token, so they finish at once.
          max_new_tokens, temperature, top_k, top_p: one value, or one per prompt.
          stop_ids: tokens that end a row (kept in its output), at most `MAX_STOP_IDS`.
          seed, row_ids: row r's key is `fold_in(key(seed), row_ids[r])`; row ids default to
            0..B-1. Give each row its global index (or request id) so that no two rows of any
            batch share a random stream.
          contribute: whether each row's text may enter batch-shared method state (the cross-request
            n-gram table, token recycling's matrix).
          tenant: each row's scope of that state: a row reads only what rows of its tenant wrote.
          prediction: each row's predicted output (token ids, or None for none), the text that
            `specjax.methods.predict` drafts from; None: no row has one.
          prediction_bucket: the padded prediction length Q (a predict proposer's `prediction_cap`,
            so that every prediction shares one program); default: the longest prediction. Given
            alone, every row gets an empty prediction of that width.
          constraint: each row's slot in the decoder's constraint pool (`specjax.core.constraint`),
            0 for a free row; the decoder must carry a pool (`Decoder(constraints=...)`).
          logit_bias: each row's bias (token id -> value in [-100, 100], or None for none), added to
            the target's logits at every position (`sampling.biased`); None: no row has one.
          logit_bias_width: the padded entries per row Lb (a host's fixed width, so that every bias
            shares one program); default: the most any row gives. Given alone, no row is biased.
        """
        n, b, p = _check_prompts(prompts, bucket, batch_size)
        stops = tuple(stop_ids)
        per_row = {name: _per_row(v, n, name) for name, v in
                   dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                        top_p=top_p, contribute=contribute, tenant=tenant, constraint=constraint).items()}
        _check_rows(per_row, seed, stops)
        pad = b - n
        rows = list(prompts) + [prompts[0]] * pad  # padding rows repeat prompt 0
        tokens = _padded(rows, p)
        stop = np.full((b, MAX_STOP_IDS), -1, np.int32)
        stop[:, : len(stops)] = stops
        fill = lambda name, pad_value: np.asarray(per_row[name] + [pad_value] * pad)
        ids = list(range(b)) if row_ids is None else list(row_ids)
        if len(ids) < b:  # padding rows continue the ids
            ids += [max(ids) + 1 + i for i in range(b - len(ids))]
        pred, pred_len = _predictions(prediction, prediction_bucket, n, b)
        bias_ids, bias_values = _logit_biases(logit_bias, logit_bias_width, n, b)
        return cls(
            prompts=jnp.asarray(tokens), prompt_lengths=jnp.asarray([len(x) for x in rows], jnp.int32),
            max_new=jnp.asarray(fill("max_new_tokens", 1), jnp.int32),
            sampling=SamplingParams(temperature=jnp.asarray(fill("temperature", 0.0), jnp.float32),
                                    top_k=jnp.asarray(fill("top_k", 0), jnp.int32),
                                    top_p=jnp.asarray(fill("top_p", 1.0), jnp.float32),
                                    bias_ids=bias_ids, bias_values=bias_values),
            stop_ids=jnp.asarray(stop), keys=row_keys(seed, ids[:b]),
            contribute=jnp.asarray(fill("contribute", False), bool),
            tenant=jnp.asarray(fill("tenant", 0), jnp.int32), prediction=pred, prediction_lengths=pred_len,
            constraint=jnp.asarray(fill("constraint", 0), jnp.int32))

    @property
    def batch_size(self) -> int:
        return self.prompts.shape[0]


@struct.dataclass
class Stats:
    """Per-row speculation counters, on device (`specjax.telemetry.SpecCounters` on the host)."""

    drafted: Int[AnyArray, "B"]  # draft tokens verified (a tree counts every node)
    accepted: Int[AnyArray, "B"]
    accepted_per_position: Int[AnyArray, "B A"]  # how often the draft at depth j + 1 was kept
    accept_hist: Int[AnyArray, "B A+1"]  # how often a step kept exactly n drafts
    accepted_per_node: Int[AnyArray, "B N"] | None = None  # how often window node i was kept (slot i + 1)

    @classmethod
    def zeros(cls, batch: int, depth: int, nodes: int = 0) -> "Stats":
        z = lambda *s: jnp.zeros(s, jnp.int32)
        return cls(drafted=z(batch), accepted=z(batch), accepted_per_position=z(batch, depth),
                   accept_hist=z(batch, depth + 1), accepted_per_node=z(batch, nodes))

    def update(self, active, n, nodes: int, path=None) -> "Stats":
        """Counts one step of the `active` rows: `n` drafts kept along `path` (the kept nodes' window
        slots by depth, `Accepted.path`; None: a chain's)."""
        depth = self.accepted_per_position.shape[1]
        a = active.astype(jnp.int32)
        kept = n * a
        per_node = self.accepted_per_node
        if per_node is not None and per_node.shape[1]:
            w = per_node.shape[1] + 1
            d = jnp.arange(path.shape[1])[None, :]
            hit = jax.nn.one_hot(path, w, dtype=jnp.int32) * ((d >= 1) & (d <= kept[:, None]))[..., None]
            per_node = per_node + hit.sum(axis=1)[:, 1:]
        return Stats(
            drafted=self.drafted + nodes * a,
            accepted=self.accepted + kept,
            accepted_per_position=self.accepted_per_position
            + (jnp.arange(depth)[None] < kept[:, None]).astype(jnp.int32),
            accept_hist=self.accept_hist + jax.nn.one_hot(n, depth + 1, dtype=jnp.int32) * a[:, None],
            accepted_per_node=per_node,
        )


@struct.dataclass
class State:
    """The loop carry: committed tokens and cache, the proposer's own state, the counters."""

    decode: DecodeState
    proposer: Any
    stats: Stats


def verify(target: Transformer, state: DecodeState, nodes: Int[Array, "B K"], topo: tree.AnyTopology,
           taps: tuple[int, ...] = ()) -> Output:
    """One target forward over [pending token, nodes] at positions `lengths - 1 + depth`.

    A chain's window mask is the causal one; a tree's lets each node see only its ancestors.
    `taps`: layers whose input the output also carries (for a proposer that reads them).
    """
    window = jnp.concatenate([last_tokens(state)[:, None], nodes], axis=1)
    start = state.lengths - 1
    if topo.is_chain:
        positions = start[:, None] + jnp.arange(window.shape[1], dtype=jnp.int32)[None, :]
        return target(window, positions, state.cache, taps=taps)
    depth, mask = tree.batched(topo, window.shape[0])  # a static tree, or one per row (dynamic)
    positions = start[:, None] + depth.astype(jnp.int32)
    return target(window, positions, state.cache, start=start, window_mask=mask, taps=taps)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Decoder:
    """Everything that shapes a decoding program; hashable, so it can be a static jit argument.

    Attributes:
      cache_length: KV cache slots S per row (see `cache_length`); a row is done once another
        window would not fit.
      proposer: a draft proposer (a `specjax.methods.Proposer`), or None for the plain loop.
      acceptance: the acceptance rule (`specjax.core.acceptance`); None picks the lossless default for
        the sampling method and the window's shape (`acceptance.default_rule`).
      sampling: `sampling.Greedy()` (argmax) or `sampling.Sample()` (per-row temperature / top-k /
        top-p; rows at temperature 0 stay greedy), or their names "greedy" / "sample".
      shared: the batch-shared method state the program carries (`specjax.core.shared`): one
        `SharedSpec` per part (the cross-request n-gram table, token recycling's matrix), updated
        after every commit. None: the proposer's own (`Proposer.shared`). A host that runs several
        options over one batch gives each the union of theirs (`shared.union`); it must cover the
        proposer's.
      constraints: the constraint pool the batch carries (`specjax.core.constraint.PoolSpec`), or
        None: none, and no mask. With a pool every row is masked by its slot's automaton (slot 0, a
        free row, allows everything) at every sampled and verified position. It joins `shared`
        (a `shared` that holds a pool sets it).
      mesh: the device mesh the programs run on (`specjax.sharding.make_mesh`), or None for one
        device. The methods trace for it (`sharding.use`): the carry, the model's activations and
        top-k are laid out by the logical-axis rules on this mesh, whatever `jax.set_mesh` says.
      logprobs: record each committed token's log-probability and its position's `logprobs` most
        likely tokens (0..20; `specjax.core.logprobs`) in `DecodeState.logprobs`; None: record
        nothing (no buffer, no cost). Read them with `token_logprobs`.
    """

    cache_length: int
    proposer: Proposer | None = None
    acceptance: Any = None
    sampling: Sampling | str = sampling.Greedy()
    shared: tuple[SharedSpec, ...] | None = None
    constraints: PoolSpec | None = None
    mesh: Mesh | None = None
    logprobs: int | None = None

    def __post_init__(self):
        sharding.check_mesh(self.mesh)
        if self.logprobs is not None:
            object.__setattr__(self, "logprobs", check_top(self.logprobs, "logprobs"))
        if self.proposer is not None and not isinstance(self.proposer, Proposer):
            raise TypeError(f"{type(self.proposer).__name__} is not a Proposer: it must declare k, topology, "
                            "taps, init, propose and reconcile (specjax.core.proposer)")
        object.__setattr__(self, "sampling", sampling.method(self.sampling))
        own = () if self.proposer is None else tuple(self.proposer.shared)
        given = own if self.shared is None else tuple(self.shared)
        bad = [s for s in given if not isinstance(s, SharedSpec)]
        if bad:
            raise TypeError(f"shared={bad[0]!r} is not a SharedSpec (specjax.core.shared): it must declare "
                            "name, top_k, init, update, merge and nbytes")
        shared_state.covers(given, own)
        if self.constraints is not None:
            if not isinstance(self.constraints, PoolSpec):
                raise TypeError(f"constraints={self.constraints!r}: pass a specjax.core.constraint.PoolSpec")
            given += (self.constraints,)
        object.__setattr__(self, "shared", shared_state.union(given))
        object.__setattr__(self, "constraints", next((s for s in self.shared if s.name == PoolSpec.name), None))
        if int(self.cache_length) != self.cache_length or self.cache_length < self.window + 1:
            raise ValueError(f"cache_length={self.cache_length}: must be an integer > the window "
                             f"({self.window}); see specjax.core.decoder.cache_length")
        if self.proposer is None:
            if self.acceptance is not None:
                raise ValueError("an acceptance rule needs a proposer: the plain loop accepts nothing")
            return
        if self.acceptance is None:
            object.__setattr__(self, "acceptance", acceptance.default_rule(self.sampling, self.topology))
        if not isinstance(self.acceptance, acceptance.AcceptanceRule):
            raise TypeError(f"acceptance={self.acceptance!r} is not an acceptance rule: pass an object with "
                            "check(topology) and accept(window) (see specjax.core.acceptance.AcceptanceRule)")
        self.acceptance.check(self.topology)

    @property
    def topology(self) -> tree.Topology | tree.DynamicTopology:
        """The verify window: the proposer's tree (a chain of K for chain proposers), or the node
        budget of a tree the proposer builds each step (`tree.DynamicTopology`)."""
        return tree.topology(()) if self.proposer is None else proposer_topology(self.proposer)

    @property
    def taps(self) -> tuple[int, ...]:
        """Target layers whose input the proposer reads (an EAGLE-3 head's fused features)."""
        return () if self.proposer is None else tuple(self.proposer.taps)

    @property
    def window(self) -> int:
        """Tokens the target sees per step (1 for the plain loop)."""
        return self.topology.width

    @property
    def depth(self) -> int:
        """The most drafts one step can accept (0 for the plain loop)."""
        return self.topology.max_depth

    @property
    def nodes(self) -> int:
        """Drafted nodes per step (0 for the plain loop)."""
        return self.topology.num_nodes

    # ---- prefill ---------------------------------------------------------------------------
    def prefill_target(self, model: Transformer, inputs: Inputs, parts: dict | None = None, *,
                       window: int | None = None) -> tuple[DecodeState, Array]:
        """Runs the prompts through the target and commits the first new token of each row.

        The model builds the cache (`init_cache`) for forwards of up to `window` tokens (this
        decoder's own window by default; `Slots` passes the widest of the options sharing it). Pad
        slots past a row's prompt are never attended: they lie after the row's query positions and
        are overwritten as the row generates (a sliding-window ring does not store them). The
        batch-shared state sees every prompt position (`Observed`): `parts` is the state it starts
        from (a running batch's, when a request is inserted into it), or None for empty
        (`SharedSpec.init`). Returns the state and the features the proposer reads at every prompt
        position: the final hidden states `[B, P, D]`, or the inputs of its `taps` layers
        concatenated `[B, P, len(taps) * D]`.
        """
        with sharding.use(self.mesh):
            return self._prefill_target(model, inputs, parts, window or self.window)

    def _prefill_target(self, model: Transformer, inputs: Inputs, parts: dict | None,
                        window: int) -> tuple[DecodeState, Array]:
        b, p = inputs.prompts.shape
        if p + self.window > self.cache_length:
            raise ValueError(f"prompt bucket {p} + a window of {self.window} does not fit cache_length="
                             f"{self.cache_length}: size it with specjax.cache_length(bucket, max_new, window)")
        # the empty cache and the positions behind a barrier, as EAGLE's prompt pass does: known, they
        # make the masked-out scores against the empty cache (every ring entry unwritten, every slot
        # past the window) a constant block, which XLA folds at compile time (Gemma 3 270M at bucket
        # 1024: 45 s to compile its insert program)
        cache = jax.lax.optimization_barrier(model.init_cache(b, self.cache_length, window=window))
        positions = jax.lax.optimization_barrier(jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p)))
        hidden, cache, tapped = model.features(inputs.prompts, positions, cache, taps=self.taps,
                                               kept=inputs.prompt_lengths)
        last = jnp.take_along_axis(hidden, (inputs.prompt_lengths - 1)[:, None, None], axis=1)
        logits = model.logits(last)[:, 0]
        tokens = jnp.zeros((b, self.cache_length), jnp.int32).at[:, :p].set(inputs.prompts)
        state = DecodeState(
            tokens=tokens, lengths=inputs.prompt_lengths.astype(jnp.int32),
            prompt_lengths=inputs.prompt_lengths.astype(jnp.int32), max_new=inputs.max_new.astype(jnp.int32),
            done=jnp.zeros((b,), bool), cache=cache, sampling=inputs.sampling, stop_ids=inputs.stop_ids,
            keys=inputs.keys, row_forwards=jnp.zeros((b,), jnp.int32),
            shared=Shared(forwards=jnp.zeros((), jnp.int32),
                          parts=shared_state.init(self.shared) if parts is None else parts),
            contribute=inputs.contribute, tenant=inputs.tenant,
            logprobs=None if self.logprobs is None else Logprobs.zeros(b, self.cache_length, self.logprobs))
        raw, logits = logits, sampling.biased(logits, inputs.sampling)
        if self.constraints is not None:  # every automaton starts in state 0
            slot = jnp.zeros((b,), jnp.int32) if inputs.constraint is None else inputs.constraint.astype(jnp.int32)
            state = state.replace(constraint=slot, automaton=jnp.zeros((b,), jnp.int32))
            logits = self._mask(state, state.automaton[:, None], logits[:, None])[:, 0]
        first = self.sampling.draw(step_keys(state), logits, inputs.sampling)
        after = commit(state, first[:, None], jnp.ones((b,), jnp.int32), self.window,
                       scores=scores_of(state, raw[:, None], first[:, None]))[0]
        if self.constraints is not None:
            after = self._advanced(state, after, state.automaton, first)
        if self.shared:
            k = shared_state.top_k_needed(self.shared)
            top = shared_state.chunked_top_k(model.logits, hidden, k) if k else None
            prev = jnp.concatenate([jnp.full((b, 1), -1, jnp.int32), inputs.prompts[:, :-1]], axis=1)
            real = jnp.arange(p)[None, :] < inputs.prompt_lengths[:, None]
            after = self._observe(state, after, inputs.prompts, prev, real, jnp.arange(p)[None, :], top, width=1)
        return after, (jnp.concatenate(tapped, axis=-1) if tapped else hidden)

    # ---- constraints (specjax.core.constraint) ---------------------------------------------------
    def _mask(self, state: DecodeState, states: Int[Array, "B W"], logits: Array) -> Array:
        """`logits` [B, W, V] masked by each row's automaton at the window slots' `states`."""
        pool = state.shared.parts[PoolSpec.name]
        return constraints_.mask(pool, state.constraint, states, state.stop_ids, logits)

    def _walk(self, state: DecodeState, nodes: Int[Array, "B K"], topo: tree.AnyTopology) -> Int[Array, "B W"]:
        """Each row's automaton state at every window slot (`specjax.core.constraint.walk`)."""
        return constraints_.walk(state.shared.parts[PoolSpec.name], state.constraint, state.automaton, nodes, topo)

    def _advanced(self, before: DecodeState, after: DecodeState, at: Int[Array, "B"],
                  token: Int[Array, "B"]) -> DecodeState:
        """`after` with each row's automaton moved by `token` from the state `at` (the state at the
        slot the token was drawn at); rows done before keep theirs, a row that left its automaton is done."""
        nxt = constraints_.advance(after.shared.parts[PoolSpec.name], before.constraint, at, token)
        automaton = jnp.where(before.done, before.automaton, nxt)
        return after.replace(automaton=automaton, done=after.done | (automaton < 0))

    def _observe(self, before: DecodeState, after: DecodeState, scored, prev, real, order, top, *,
                 width: int) -> DecodeState:
        """`after` with the batch-shared state updated by the commit from `before` and the scores."""
        if not self.shared:
            return after
        contribute = jnp.ones_like(before.done) if after.contribute is None else after.contribute
        mask = real & (~before.done & contribute)[:, None]
        seen = Observed(before=before, after=after, scored=scored.astype(jnp.int32), prev=prev.astype(jnp.int32),
                        mask=mask, order=jnp.broadcast_to(order, scored.shape).astype(jnp.int32), top=top,
                        width=width)
        parts = shared_state.update(self.shared, after.shared.parts, seen)
        return after.replace(shared=after.shared.replace(parts=parts))

    def _observe_window(self, before: DecodeState, after: DecodeState, window, logits, path, n,
                        topo: tree.AnyTopology) -> DecodeState:
        """`_observe` of a verified window (the pending token and the nodes): each slot's token,
        its parent's token (the root's: the committed token before it), the accepted path first."""
        if not self.shared:
            return after
        b, w = window.shape
        k = shared_state.top_k_needed(self.shared)
        top = shared_state.top_k(logits, k) if k else None
        before_root = jnp.take_along_axis(before.tokens, jnp.maximum(before.lengths - 2, 0)[:, None], axis=1)
        root_prev = jnp.where(before.lengths[:, None] >= 2, before_root, -1)
        prev = root_prev if w == 1 else jnp.concatenate([root_prev, tree.at_parents(window, topo)], axis=1)
        d = jnp.arange(path.shape[1])[None, :]
        kept = jnp.where(d <= n[:, None], path, -1)  # the accepted path's slots
        on_path = jnp.any(kept[:, :, None] == jnp.arange(w)[None, None, :], axis=1)
        order = on_path.astype(jnp.int32) * w + jnp.arange(w)[None, :]
        return self._observe(before, after, window, prev, jnp.ones((b, w), bool), order, top, width=path.shape[1])

    def init_proposer(self, pparams, state: DecodeState, inputs: Inputs, hidden) -> Any:
        """The proposer's state after the prefill (None for the plain loop)."""
        if self.proposer is None:
            return None
        with sharding.use(self.mesh):
            return self.proposer.init(pparams, state, inputs, hidden)

    def prefill(self, model: Transformer, pparams, inputs: Inputs, parts: dict | None = None) -> State:
        """Prefills the batch and sets up the proposer: the state `decode` continues from. `parts`:
        the batch-shared state to start from (None: empty; `constraint_parts` for a constraint pool)."""
        state, hidden = self.prefill_target(model, inputs, parts)
        state = State(decode=state, proposer=self.init_proposer(pparams, state, inputs, hidden),
                      stats=Stats.zeros(inputs.batch_size, self.depth, self.nodes))
        return sharding.constrain_carry(state, self.mesh)  # the loop's layout (a no-op without a mesh)

    def insert(self, state: PyTree, row: PyTree, slot: Int[Array, ""]) -> PyTree:
        """`state` with row `slot` replaced by the batch-of-one `row` (same cache length): the
        functional API's continuous batching (the scheduler uses `specjax.core.slots.Slots.insert`)."""
        return insert_row(state, row, slot)

    # ---- decode ----------------------------------------------------------------------------
    def step(self, model: Transformer, pparams, s: State) -> State:
        """One target forward: a plain step, or propose -> verify -> accept -> commit."""
        with sharding.use(self.mesh):
            return self._step(model, pparams, s)

    def _step(self, model: Transformer, pparams, s: State) -> State:
        if self.proposer is None:
            return dataclasses.replace(s, decode=self.plain_step(model, s.decode))
        state = s.decode
        drafts, q, pstate = self.proposer.propose(pparams, s.proposer, state, self.sampling,
                                                  step_keys(state, salt=1))
        nodes, topo = tree.drafted(drafts, self.topology)
        out = verify(model, state, nodes, topo, self.taps)
        logits = sampling.biased(out.logits, state.sampling)
        if self.constraints is not None:  # each slot masked by the state after the drafts before it
            states = self._walk(state, nodes, topo)
            logits = self._mask(state, states, logits)
        acc = self.acceptance.accept(acceptance.Window(
            sampling=self.sampling, keys=step_keys(state, salt=2), nodes=nodes, q=q, logits=logits,
            params=state.sampling, topo=topo))
        active = ~state.done
        window = jnp.concatenate([last_tokens(state)[:, None], nodes], axis=1)
        new = commit_path(state, out.cache, nodes, acc, topo, logits=out.logits)
        if self.constraints is not None:  # the state at the kept leaf, then the token after it
            leaf = jnp.take_along_axis(acc.path, acc.n[:, None], axis=1)
            new = self._advanced(state, new, jnp.take_along_axis(states, leaf, axis=1)[:, 0], acc.next)
        state = self._observe_window(state, new, window, out.logits, acc.path, acc.n, topo)
        pstate = self.proposer.reconcile(pparams, pstate, state, out, acc)
        return State(decode=state, proposer=pstate, stats=s.stats.update(active, acc.n, topo.num_nodes, acc.path))

    def plain_step(self, model: Transformer, state: DecodeState) -> DecodeState:
        """The plain loop's step (`plain_step`), then the batch-shared state sees its one token."""
        mask = None if self.constraints is None else functools.partial(self._mask, state, state.automaton[:, None])
        new, logits = _plain(model, self.sampling, state, mask)
        if self.constraints is not None:
            new = self._advanced(state, new, state.automaton, last_tokens(new))
        path = jnp.zeros((state.lengths.shape[0], 1), jnp.int32)
        return self._observe_window(state, new, last_tokens(state)[:, None], logits, path,
                                    jnp.zeros_like(state.lengths), tree.topology(()))

    def decode(self, model: Transformer, pparams, state: State, stop_at: Int[Array, ""] | None = None) -> State:
        """Steps until every row is done or the batch's step counter reaches `stop_at`.

        `stop_at` is an array, so streaming in chunks (`forwards + chunk`) reuses the one compiled
        program that also runs to the end (None).
        """
        stop_at = jnp.asarray(RUN_TO_END if stop_at is None else stop_at, jnp.int32)
        cond = lambda s: jnp.any(~s.decode.done) & (s.decode.forwards < stop_at)
        with sharding.use(self.mesh):
            body = lambda s: sharding.constrain_carry(self._step(model, pparams, s), self.mesh)  # keeps its layout
            return jax.lax.while_loop(cond, body, sharding.constrain_carry(state, self.mesh))


def plain_step(model: Transformer, sampling_config: Sampling, state: DecodeState) -> DecodeState:
    """The plain loop's step, the oracle of every speculative path: feed the pending token, sample
    the next one, commit it (without batch-shared state: `Decoder.plain_step` updates it)."""
    return _plain(model, sampling_config, state)[0]


def _plain(model: Transformer, sampling_config: Sampling, state: DecodeState,
           mask=None) -> tuple[DecodeState, Array]:
    """The step and the target's logits as the model gave them (no logit_bias, no mask); `mask` maps the
    biased logits [B, 1, V] to the masked ones."""
    pos = state.lengths - 1
    out = model(last_tokens(state)[:, None], pos[:, None], state.cache)
    logits = sampling.biased(out.logits, state.sampling)
    logits = logits if mask is None else mask(logits)
    nxt = sampling_config.draw(step_keys(state), logits[:, 0], state.sampling)
    return commit(tick(state.replace(cache=out.cache)), nxt[:, None], jnp.ones_like(pos), window=1,
                  scores=scores_of(state, out.logits, nxt[:, None]))[0], out.logits


# ---- jitted programs (what the hosts compile) ----------------------------------------------------


@functools.partial(jax.jit, static_argnames=("graphdef", "static"))
def prefill_program(graphdef, params, pparams, inputs: Inputs, parts: dict | None = None, *,
                    static: Decoder) -> State:
    """`static.prefill`, jitted: `static` is the Decoder (everything that shapes the program)."""
    return static.prefill(nnx.merge(graphdef, params), pparams, inputs, parts)


@functools.partial(jax.jit, static_argnames=("graphdef", "static"), donate_argnames=("state",))
def decode_program(graphdef, params, pparams, state: State, stop_at, *, static: Decoder) -> State:
    """`static.decode`, jitted, the carry donated."""
    return static.decode(nnx.merge(graphdef, params), pparams, state, stop_at)


def generate(model: Transformer, inputs: Inputs, *, decoder: Decoder, pparams=None, mesh=None,
             constraints: Sequence = ()) -> State:
    """Prefill and decode to the end with the jitted programs; returns the final state.

    `constraints`: the automata of the decoder's constraint pool, slot 1 first (each a
    `specjax.constrain.TokenTables`, or any object with its `token_class`, `next_state`, `accepting`
    and `forced` (None: no forced tokens)); a row takes one by its `Inputs.create(constraint=slot)`.

    Read the text back with `new_tokens(state, mesh)`. Calls with the same decoder and shapes reuse
    the compiled programs. On a mesh (`decoder.mesh`, or `mesh` here for a decoder without one) the
    model, the proposer's params and the inputs are placed on it by their logical axes and the
    programs trace for it.
    """
    mesh = sharding.check_mesh(mesh)
    if mesh is not None and decoder.mesh is None:
        decoder = dataclasses.replace(decoder, mesh=mesh)
    elif mesh is not None and mesh != decoder.mesh:
        raise ValueError("generate(mesh=...) differs from decoder.mesh: give the mesh once, as Decoder(mesh=...)")
    mesh = decoder.mesh
    if mesh is not None:
        model = sharding.place_module(model, mesh)
        pparams = sharding.place_pparams(pparams, mesh)
        inputs = sharding.place_inputs(inputs, mesh)
    parts = constraint_parts(decoder, constraints, inputs)
    graphdef, params = nnx.split(model)
    state = prefill_program(graphdef, params, pparams, inputs, parts, static=decoder)
    return decode_program(graphdef, params, pparams, state, np.int32(RUN_TO_END), static=decoder)


def constraint_parts(decoder: Decoder, constraints: Sequence, inputs: Inputs | None = None) -> dict | None:
    """The batch-shared state a prefill starts from with `constraints` in pool slots 1, 2, ...
    (None when the decoder carries no pool and none is given). Checks that the rows' slots exist."""
    spec = decoder.constraints
    used = 0 if inputs is None or inputs.constraint is None else _local_max(inputs.constraint)
    if spec is None:
        if constraints or used:
            raise ValueError("constrained rows need a decoder with a constraint pool: "
                             "Decoder(constraints=specjax.core.constraint.PoolSpec(vocab=...))")
        return None
    if len(constraints) > spec.capacity:
        raise ValueError(f"{len(constraints)} constraints for a pool of {spec.capacity}: raise PoolSpec(capacity=...)")
    if used > len(constraints):
        raise ValueError(f"a row uses constraint slot {used}, but {len(constraints)} constraints were given")
    parts = shared_state.init(decoder.shared)
    pool = parts[PoolSpec.name]
    for slot, t in enumerate(constraints, start=1):
        one = spec.pack(np.asarray(t.token_class), np.asarray(t.next_state), np.asarray(t.accepting),
                        None if t.forced is None else np.asarray(t.forced))
        pool = constraints_.upload(pool, jnp.int32(slot), one)
    return {**parts, PoolSpec.name: pool}


def _local_max(x) -> int:
    """The largest value of `x` this process holds: a global array split over processes is read
    through its addressable shards (every process checks the rows it feeds; no collective)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return max(int(np.max(np.asarray(s.data))) for s in x.addressable_shards)
    return int(np.max(np.asarray(x)))


def token_logprobs(state: State | DecodeState, mesh=None) -> list[list[TokenLogprob]]:
    """Each row's recorded log-probabilities of its generated tokens (`Decoder(logprobs=N)`), one
    `TokenLogprob` per token of `new_tokens`; read as `new_tokens` reads."""
    s = state.decode if isinstance(state, State) else state
    if s.logprobs is None:
        raise ValueError("this state records no log-probabilities: build its decoder with Decoder(logprobs=N)")
    lp, lens, plen = sharding.host_view((s.logprobs, s.lengths, s.prompt_lengths), mesh)
    return [entries(lp, r, int(plen[r]), int(lens[r])) for r in range(lens.shape[0])]


def new_tokens(state: State | DecodeState, mesh=None) -> list[list[int]]:
    """The generated ids of every row (a stop token included when one ended the row); with the
    `mesh` the state lives on, read through one replicated view (every process sees every row)."""
    s = state.decode if isinstance(state, State) else state
    toks, lens, plen = sharding.host_view((s.tokens, s.lengths, s.prompt_lengths), mesh)
    return [toks[r, plen[r]: lens[r]].tolist() for r in range(toks.shape[0])]
