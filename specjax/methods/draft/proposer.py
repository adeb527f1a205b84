"""A separate small draft model with the target's vocabulary.

It keeps its own position-indexed KV cache (the proposer state). Each step it feeds the
row's last two committed tokens at their positions (one of them may be a correction or a
bonus token it has never seen; re-feeding a seen one rewrites identical K/V), then drafts
K-1 more tokens one at a time in a `lax.scan`. Its cache needs no rollback for the same
reason the target's does not: positions past the accepted length are never attended.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.core import sampling
from specjax.core.proposer import Chain
from specjax.models.kv_cache import KVCache
from specjax.core.sampling import Sampling
from specjax.core.state import DecodeState


@dataclasses.dataclass(frozen=True, kw_only=True)
class DraftModelProposer(Chain):
    """Static side: K and the draft's graph; its params are the draft's weights."""

    k: int
    graphdef: Any  # nnx.GraphDef of the draft model (hashable, static)

    @classmethod
    def from_model(cls, draft: nnx.Module, *, k: int) -> tuple["DraftModelProposer", Any]:
        """(proposer, params) for a draft model with the target's vocabulary."""
        graphdef, params = nnx.split(draft)
        return cls(k=k, graphdef=graphdef), params

    def init(self, params, state: DecodeState, inputs, hidden):
        model = nnx.merge(self.graphdef, params)
        prompts = inputs.prompts
        b, p = prompts.shape
        # its writes reach k positions past what is committed (2 re-fed tokens, then its drafts one at a time)
        cache = model.init_cache(b, state.capacity, window=self.k + 1)
        positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
        _, cache = model.hidden_states(prompts, positions, cache, kept=inputs.prompt_lengths)
        return cache

    def _draw(self, sampling_config: Sampling, keys, logits, state: DecodeState, j: int | jax.Array):
        if sampling_config.greedy:
            return sampling.argmax(logits), None
        q = sampling.probs(logits, state.sampling)
        keys = jax.vmap(lambda k: jax.random.fold_in(k, j))(keys)
        tok = jax.vmap(jax.random.categorical)(keys, jnp.log(q)).astype(jnp.int32)
        return tok, q

    def propose(self, params, cache: KVCache, state: DecodeState, sampling_config, keys):
        model = nnx.merge(self.graphdef, params)
        pos = state.lengths[:, None] - 2 + jnp.arange(2)[None, :]
        out = model(jnp.take_along_axis(state.tokens, pos, axis=1), pos, cache)
        tok, q = self._draw(sampling_config, keys, out.logits[:, 1], state, 0)

        def step(carry, j):
            cache, tok = carry
            p = state.lengths[:, None] - 1 + j
            o = model(tok[:, None], p, cache)
            nxt, q = self._draw(sampling_config, keys, o.logits[:, 0], state, j)
            return (o.cache, nxt), (nxt, q)

        (cache, _), (rest, qs) = jax.lax.scan(step, (out.cache, tok), jnp.arange(1, self.k))
        draft = jnp.concatenate([tok[:, None], rest.T], axis=1)
        if q is None:
            return draft, None, cache
        return draft, jnp.concatenate([q[:, None], jnp.moveaxis(qs, 0, 1)], axis=1), cache

    def reconcile(self, params, cache, state, verify, accepted):
        return cache  # positions come from state.lengths; stale slots are never attended
