"""An EAGLE head as a proposer: a chain of K autoregressive draft steps, or a tree built each step.

The proposer state is the head's own KV cache and `feature`, its prediction of the target's feature
at each row's pending position (`lengths - 1`), from which the first draft's logits come.

Chain: K draft tokens, each from the head's logits, the head fed its own predicted feature and the
token it just drafted (entry at position `lengths - 2 + i`). Greedy decoding takes the argmax; sampling
draws from q, the head's distribution after the row's temperature / top-k / top-p, and returns q so
that Leviathan's rule keeps the output lossless.

Tree (EAGLE-2's dynamic expansion, `nodes` > 0): the root's `topk` best tokens are level 1; at each
level the `topk` frontier nodes are fed to the head in one call (each attending the committed
context and its own ancestors, whose entries sit in scratch slots after the row's cache), each gets
its `topk` best children, and the `topk` children of highest path probability form the next
frontier. After `k` levels the `nodes` candidates of highest path probability form the tree (a
child's path probability is below its parent's, so the set holds every chosen node's parent). The
tree's parents travel with the drafts (`tree.DraftTree`); drafts are deterministic, so greedy takes
the longest match and sampling the SpecInfer rule, both lossless.

After verification `reconcile` writes the head's entries for the accepted path from the target's
own features there (positions `L-1 .. L-1+n` of the old length L), which replaces every draft entry
of the step, and keeps the head's prediction after the last accepted token.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx, struct
from jaxtyping import Array, Float, Int

from specjax import sharding
from specjax.core import sampling
from specjax.core import tree
from specjax.models import eagle as eagle_model
from specjax.models.eagle import EagleConfig, EagleHead
from specjax.models.kv_cache import KVCache
from specjax.core.state import DecodeState

TIE_BREAK = 1e-6  # subtracted per level from path log-probabilities: a child never ties its parent


@struct.dataclass
class EagleParams(sharding.Logical):
    """The arrays an EAGLE proposer reads: the head, the LM head's rows for the draft vocabulary
    (`lm_rows [Vd, D]`, with `ids [Vd]` mapping back to token ids) and the target's embedding."""

    head: Any
    lm_rows: Float[Array, "Vd D"]
    ids: Int[Array, "Vd"]
    embed: Float[Array, "V D"]

    def logical_axes(self):  # the head by its own axes; the LM head's rows vocab-parallel
        return dict(head=None, lm_rows=("vocab", "embed"), ids=(), embed=("vocab", "embed"))


@struct.dataclass
class EagleState:
    cache: KVCache  # the head's: one slot per position, then scratch slots for tree nodes
    feature: Float[Array, "B D"]  # the head's feature at each row's pending position


@dataclasses.dataclass(frozen=True, kw_only=True)
class EagleProposer:
    """Static side: the draft depth `k`, the tree budget (`nodes`, 0 = chain), the head's graph.

    Attributes:
      k: chain length, or the tree's depth (levels expanded).
      graphdef: the head's `nnx.GraphDef`; `config` its `EagleConfig`.
      nodes: drafted nodes verified per step for the dynamic tree; 0 drafts a chain.
      topk: children per expanded node and frontier width of the dynamic tree.
    """

    k: int
    graphdef: Any
    config: EagleConfig
    nodes: int = 0
    topk: int = 4

    def __post_init__(self):
        if self.nodes:
            most = self.topk + (self.k - 1) * self.topk**2
            if not 1 <= self.nodes <= most:
                raise ValueError(f"eagle tree of {self.nodes} nodes: depth {self.k} with top-{self.topk} "
                                 f"expansion yields at most {most} candidates")

    @classmethod
    def from_head(cls, head: EagleHead, draft_ids, target, *, k: int, nodes: int = 0, topk: int = 4,
                  draft_vocab: int | None = None) -> tuple["EagleProposer", EagleParams]:
        """(proposer, params) for `head` on `target`; `draft_vocab` keeps only the most frequent
        tokens of the head's vocabulary (its first entries), which makes each draft step cheaper."""
        hc, tc = head.config, target.config
        if hc.dim != tc.dim or hc.vocab_size != tc.vocab_size:
            raise ValueError(f"the EAGLE head is for dim {hc.dim} / vocab {hc.vocab_size}, the model has dim "
                             f"{tc.dim} / vocab {tc.vocab_size}: train a head for this model")
        ids = eagle_model.check_draft_ids(draft_ids, tc.vocab_size, what="the EAGLE head's draft_ids",
                                          fix=": a draft vocabulary holds token ids of this model")
        if draft_vocab is not None:
            if not 1 <= draft_vocab <= len(ids):
                raise ValueError(f"draft_vocab={draft_vocab}: the head proposes from {len(ids)} tokens; "
                                 f"give 1..{len(ids)}")
            ids = ids[:draft_vocab]
        if nodes and topk > len(ids):
            raise ValueError(f"topk={topk} exceeds the draft vocabulary of {len(ids)}")
        graphdef, params = nnx.split(head)
        jids = jnp.asarray(ids)
        return cls(k=k, graphdef=graphdef, config=hc, nodes=nodes, topk=topk), EagleParams(
            head=params, lm_rows=eagle_model.lm_rows(target, jids), ids=jids, embed=target.embedding())

    # ---- static shape ------------------------------------------------------------------------
    @property
    def topology(self) -> tree.Topology | tree.DynamicTopology:
        """A chain of k, or the node budget of the dynamic tree it builds each step."""
        if self.nodes:
            return tree.DynamicTopology(num_nodes=self.nodes, max_depth=self.k)
        return tree.chain_topology(self.k)

    @property
    def taps(self) -> tuple[int, ...]:
        """The target layers a fused (EAGLE-3) head reads; () for the final hidden state."""
        return self.config.feature_layers

    @property
    def shared(self) -> tuple:
        return ()  # no batch-shared state

    @property
    def scratch(self) -> int:
        """Head cache slots past the positions, for the tree's frontier entries."""
        return self.topk * (self.k - 1) if self.nodes else 0

    def _head(self, params: EagleParams) -> EagleHead:
        return nnx.merge(self.graphdef, params.head)

    # ---- state -------------------------------------------------------------------------------
    def init(self, params: EagleParams, state: DecodeState, inputs, hidden: Float[Array, "B P D"]) -> EagleState:
        """Entries for every prompt position from the prompt's features (pad entries are junk past
        each row's length, overwritten before they are read)."""
        head = self._head(params)
        b, p, _ = hidden.shape
        nxt = state.tokens[:, 1: p + 1]  # token t + 1 at entry t (the first new token after the prompt)
        cache = head.cache(b, state.capacity + self.scratch)
        # behind a barrier, the start is not a compile-time constant: with it, every prompt entry's scores
        # against the empty cache are masked out in full, and XLA constant-folds that [B, P, K, G, S]
        # block while compiling (1.7-6.9 s per prompt bucket on SmolLM2, with E-level log lines)
        zero = jax.lax.optimization_barrier(jnp.zeros((b,), jnp.int32))
        out, cache = head(head.lift(hidden), jnp.take(params.embed, nxt, axis=0, mode="clip"),
                          jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p)), zero, cache)
        feature = jnp.take_along_axis(out, (inputs.prompt_lengths - 1)[:, None, None], axis=1)[:, 0]
        return EagleState(cache=cache, feature=feature)

    def reconcile(self, params: EagleParams, pstate: EagleState, state: DecodeState, verify, accepted) -> EagleState:
        """The head's entries for the accepted path, from the target's features there."""
        head = self._head(params)
        path = accepted.path  # [B, R] window slots, root first
        width = path.shape[1]
        feats = jnp.take_along_axis(eagle_model.features_of(self.config, verify), path[:, :, None], axis=1)
        start = jnp.maximum(state.lengths - accepted.n - 2, 0)  # the old pending position
        cols = jnp.minimum(start[:, None] + 1 + jnp.arange(width)[None], state.capacity - 1)
        toks = jnp.take_along_axis(state.tokens, cols, axis=1)
        positions = start[:, None] + jnp.arange(width, dtype=jnp.int32)[None]
        out, cache = head(head.lift(feats), jnp.take(params.embed, toks, axis=0, mode="clip"), positions, start,
                          pstate.cache)
        feature = jnp.take_along_axis(out, accepted.n[:, None, None], axis=1)[:, 0]
        return EagleState(cache=cache, feature=feature)

    # ---- drafting ----------------------------------------------------------------------------
    def _q(self, params: EagleParams, logits: Float[Array, "B Vd"], state: DecodeState) -> Float[Array, "B V"]:
        """The draft distribution over the whole vocabulary after the row's sampling filters."""
        full = jnp.full(logits.shape[:-1] + (params.embed.shape[0],), -jnp.inf, logits.dtype)
        full = full.at[..., params.ids].set(logits)
        return sampling.probs(full, state.sampling)

    def propose(self, params: EagleParams, pstate: EagleState, state: DecodeState, sampling_config, keys):
        if self.nodes:
            return self._tree(params, pstate, state), None, pstate
        head = self._head(params)
        sampled = not sampling_config.greedy
        feat, cache = pstate.feature, pstate.cache
        tokens, qs = [], []
        for i in range(self.k):
            logits = head.logits(feat, params.lm_rows)
            if sampled:
                q = self._q(params, logits, state)
                k_i = jax.vmap(lambda kk: jax.random.fold_in(kk, i))(keys)
                tok = jax.vmap(jax.random.categorical)(k_i, jnp.log(q)).astype(jnp.int32)
                qs.append(q)
            else:
                tok = jnp.take(params.ids, jnp.argmax(logits, axis=-1))
            tokens.append(tok)
            if i + 1 < self.k:  # the entry of the token just drafted, at position lengths - 1 + i
                pos = state.lengths - 1 + i
                out, cache = head(feat[:, None], jnp.take(params.embed, tok, axis=0, mode="clip")[:, None],
                                  pos[:, None], pos, cache)
                feat = out[:, 0]
        draft = jnp.stack(tokens, axis=1)
        # the entries written here lie past the committed length: `reconcile` overwrites them
        return draft, (jnp.stack(qs, axis=1) if sampled else None), pstate.replace(cache=cache)

    def _tree(self, params: EagleParams, pstate: EagleState, state: DecodeState) -> tree.DraftTree:
        head = self._head(params)
        k, depth = self.topk, self.k
        cache = pstate.cache
        b = state.lengths.shape[0]
        s, m = state.capacity, self.scratch
        logp = jax.nn.log_softmax(head.logits(pstate.feature, params.lm_rows), axis=-1)  # [B, Vd]
        score, tok = sharding.top_k(logp, k)  # no batch gather on a mesh
        scores, toks, parents = [score - TIE_BREAK], [tok], [jnp.full((b, k), -1, jnp.int32)]
        front = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (b, k))  # candidate index of each
        front_feat = jnp.broadcast_to(pstate.feature[:, None], (b, k, pstate.feature.shape[-1]))
        front_tok, front_score = tok, score - TIE_BREAK
        front_anc = jnp.zeros((b, k, m), bool)  # scratch slots of each frontier node's ancestors
        context = jnp.arange(s)[None, None, :] < (state.lengths - 1)[:, None, None]  # [B, 1, S]
        offset = k
        for level in range(1, depth):
            slot0 = (level - 1) * k
            own = jnp.zeros((k, m), bool).at[jnp.arange(k), slot0 + jnp.arange(k)].set(True)
            anc = front_anc | own[None]
            seen = jnp.concatenate([jnp.broadcast_to(context, (b, k, s)), front_anc], axis=-1)  # written before
            pos = jnp.broadcast_to((state.lengths - 2 + level)[:, None], (b, k))
            out, cache = head(front_feat, jnp.take(params.embed, jnp.take(params.ids, front_tok), axis=0, mode="clip"),
                              pos, jnp.full((b,), s + slot0, jnp.int32), cache, context=seen,
                              window_mask=jnp.broadcast_to(jnp.eye(k, dtype=bool), (b, k, k)))  # each sees itself
            lp = jax.nn.log_softmax(head.logits(out, params.lm_rows), axis=-1)  # [B, k, Vd]
            cs, ct = sharding.top_k(lp, k)
            child_score = (front_score[:, :, None] + cs - TIE_BREAK).reshape(b, k * k)
            child_tok = ct.reshape(b, k * k)
            child_parent = jnp.broadcast_to(front[:, :, None], (b, k, k)).reshape(b, k * k)
            scores.append(child_score)
            toks.append(child_tok)
            parents.append(child_parent)
            front_score, pick = sharding.top_k(child_score, k)
            front = offset + pick
            front_tok = jnp.take_along_axis(child_tok, pick, axis=1)
            front_feat = jnp.take_along_axis(out, (pick // k)[:, :, None], axis=1)
            front_anc = jnp.take_along_axis(anc, (pick // k)[:, :, None], axis=1)
            offset += k * k
        score, tok, parent = (jnp.concatenate(x, axis=1) for x in (scores, toks, parents))
        _, chosen = sharding.top_k(score, self.nodes)
        chosen = jnp.sort(chosen, axis=1)  # candidates are laid out level by level: parents first
        rows = jnp.arange(b)[:, None]
        slot_of = jnp.zeros(score.shape, jnp.int32).at[rows, chosen].set(jnp.arange(1, self.nodes + 1))
        par = jnp.take_along_axis(parent, chosen, axis=1)
        par_slot = jnp.where(par < 0, 0, jnp.take_along_axis(slot_of, jnp.maximum(par, 0), axis=1))
        window_parent = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), par_slot], axis=1)
        tokens = jnp.take(params.ids, jnp.take_along_axis(tok, chosen, axis=1))
        return tree.DraftTree(tokens=tokens, window=tree.Window.from_parents(window_parent, depth))
