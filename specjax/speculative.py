"""The speculative decoding loop: propose, verify, accept, commit, in one `lax.while_loop`.

```
draft, q = propose(...)                 # [B, K] tokens (+ q [B, K, V] when sampled)
out = verify(target, state, draft)      # one target pass over the K+1 window
n, nxt = accept(out.logits, draft, q)   # kept prefix length and correction/bonus token
state = commit(state, draft[:n] + nxt)  # lengths += n + 1; nothing to roll back
```
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, Int

from specjax import acceptance, tree
from specjax.models.llama import Llama, Output
from specjax.sampling import SamplingConfig
from specjax.state import DecodeState, commit, last_tokens, step_keys


@struct.dataclass
class SpecStats:
    """Per-row acceptance counters (telemetry)."""

    drafted: Int[Array, "B"]
    accepted: Int[Array, "B"]
    accepted_per_position: Int[Array, "B K"]  # how often draft position j was accepted
    accept_hist: Int[Array, "B K+1"]  # how often a step accepted exactly n drafts

    @classmethod
    def zeros(cls, batch: int, k: int) -> "SpecStats":
        z = lambda *s: jnp.zeros(s, jnp.int32)
        return cls(drafted=z(batch), accepted=z(batch), accepted_per_position=z(batch, k),
                   accept_hist=z(batch, k + 1))

    def update(self, active, num_accepted) -> "SpecStats":
        k = self.accepted_per_position.shape[1]
        a = active.astype(jnp.int32)
        n = num_accepted * a
        return SpecStats(
            drafted=self.drafted + k * a,
            accepted=self.accepted + n,
            accepted_per_position=self.accepted_per_position
            + (jnp.arange(k)[None] < n[:, None]).astype(jnp.int32),
            accept_hist=self.accept_hist
            + jax.nn.one_hot(num_accepted, k + 1, dtype=jnp.int32) * a[:, None],
        )


@struct.dataclass
class SpecState:
    decode: DecodeState
    proposer: Any
    stats: SpecStats


def verify(target: Llama, state: DecodeState, draft: Int[Array, "B K"]) -> Output:
    """One target forward over [pending token, drafts] at positions lengths-1 .. lengths-1+K."""
    window = jnp.concatenate([last_tokens(state)[:, None], draft], axis=1)
    positions = state.lengths[:, None] - 1 + jnp.arange(window.shape[1])[None, :]
    return target(window, positions, state.cache)


def spec_step(target: Llama, proposer, pparams, sampling_config: SamplingConfig,
              s: SpecState) -> SpecState:
    if getattr(proposer, "tree", None) is not None:
        return tree_step(target, proposer, pparams, sampling_config, s)
    state = s.decode
    draft, q, pstate = proposer.propose(pparams, s.proposer, state, sampling_config,
                                        step_keys(state, salt=1))
    out = verify(target, state, draft)
    n, nxt = acceptance.accept(sampling_config, step_keys(state, salt=2), draft, q, out.logits,
                               state.sampling)
    active = ~state.done
    state = state.replace(cache=out.cache, forwards=state.forwards + 1,
                          row_forwards=state.row_forwards + active.astype(jnp.int32))
    new = jnp.concatenate([draft, nxt[:, None]], axis=1)
    new = new.at[jnp.arange(new.shape[0]), n].set(nxt)  # correction right after the kept prefix
    state, _ = commit(state, new, n + 1, window=proposer.k + 1)
    pstate = proposer.reconcile(pparams, pstate, state, out.hidden, n)
    return SpecState(decode=state, proposer=pstate, stats=s.stats.update(active, n))


def tree_step(target: Llama, proposer, pparams, sampling_config: SamplingConfig,
              s: SpecState) -> SpecState:
    """`spec_step` for a static candidate tree (see `specjax.tree`)."""
    state = s.decode
    topo = tree.topology(proposer.tree)
    nodes, _, pstate = proposer.propose(pparams, s.proposer, state, sampling_config,
                                        step_keys(state, salt=1))
    out = tree.verify(target, state, nodes, topo)
    n, leaf, path, nxt = tree.accept(sampling_config, step_keys(state, salt=2), nodes, out.logits,
                                     state.sampling, topo, proposer.typical)
    active = ~state.done
    window = jnp.concatenate([last_tokens(state)[:, None], nodes], axis=1)
    new = jnp.take_along_axis(window, path, axis=1)  # [B, D+1]: root, then the path's tokens
    new = jnp.concatenate([new[:, 1:], nxt[:, None]], axis=1)
    new = new.at[jnp.arange(new.shape[0]), n].set(nxt)
    state = state.replace(cache=tree.compact(out.cache, state.lengths - 1, path),
                          forwards=state.forwards + 1,
                          row_forwards=state.row_forwards + active.astype(jnp.int32))
    state, _ = commit(state, new, n + 1, window=window.shape[1])
    pstate = proposer.reconcile(pparams, pstate, state, out.hidden, leaf)
    return SpecState(decode=state, proposer=pstate, stats=s.stats.update(active, n))


def spec_loop(target: Llama, proposer, pparams, sampling_config: SamplingConfig, s: SpecState,
              stop_at: Int[Array, ""]) -> SpecState:
    """Speculative steps until every row is done or `forwards` reaches `stop_at`."""
    cond = lambda s: jnp.any(~s.decode.done) & (s.decode.forwards < stop_at)
    body = lambda s: spec_step(target, proposer, pparams, sampling_config, s)
    return jax.lax.while_loop(cond, body, s)
