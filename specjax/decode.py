"""The plain (non-speculative) decoding path: prefill, then one `jax.lax.while_loop`.

Pure functions of (model, static config, state). `specjax.engine` jits them; the speculative
loop reuses `prefill` and `state.commit`, and this loop is its baseline and test oracle.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Int

from specjax import sampling
from specjax.models.kv_cache import KVCache
from specjax.models.llama import Llama
from specjax.sampling import SamplingConfig, SamplingParams
from specjax.state import DecodeState, commit, last_tokens, step_keys


def prefill(
    model: Llama,
    sampling_config: SamplingConfig,
    prompts: Int[Array, "B P"],
    prompt_lengths: Int[Array, "B"],
    max_new: Int[Array, "B"],
    params: SamplingParams,
    stop_ids: Int[Array, "B E"],
    keys: Array,
    cache_length: int,
    window: int,
) -> tuple[DecodeState, Array]:
    """Runs the prompt bucket through the model and samples the first new token.

    Pad slots past a row's prompt are written to the cache but never attended: they lie
    after the row's query positions and are overwritten as the row generates.
    Returns the state and the final hidden state at each row's last prompt token.
    """
    b, p = prompts.shape
    cache = KVCache.zeros(model.config, b, cache_length)
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    hidden, cache = model.hidden_states(prompts, positions, cache)
    last = jnp.take_along_axis(hidden, (prompt_lengths - 1)[:, None, None], axis=1)  # [B, 1, D]
    logits = model.logits(last)[:, 0]
    tokens = jnp.zeros((b, cache_length), jnp.int32).at[:, :p].set(prompts)
    state = DecodeState(
        tokens=tokens,
        lengths=prompt_lengths.astype(jnp.int32),
        prompt_lengths=prompt_lengths.astype(jnp.int32),
        max_new=max_new.astype(jnp.int32),
        done=jnp.zeros((b,), bool),
        cache=cache,
        sampling=params,
        stop_ids=stop_ids,
        keys=keys,
        forwards=jnp.zeros((), jnp.int32),
        row_forwards=jnp.zeros((b,), jnp.int32),
    )
    first = sampling.sample(sampling_config, step_keys(state), logits, params)
    state, _ = commit(state, first[:, None], jnp.ones((b,), jnp.int32), window)
    return state, last[:, 0]


def plain_step(model: Llama, sampling_config: SamplingConfig, state: DecodeState) -> DecodeState:
    """Feeds each row's pending token, samples the next one and commits it."""
    pos = state.lengths - 1
    out = model(last_tokens(state)[:, None], pos[:, None], state.cache)
    nxt = sampling.sample(sampling_config, step_keys(state), out.logits[:, 0], state.sampling)
    state = state.replace(
        cache=out.cache,
        forwards=state.forwards + 1,
        row_forwards=state.row_forwards + (~state.done).astype(jnp.int32),
    )
    state, _ = commit(state, nxt[:, None], jnp.ones_like(pos), window=1)
    return state


def plain_loop(
    model: Llama, sampling_config: SamplingConfig, state: DecodeState, stop_at: Int[Array, ""]
) -> DecodeState:
    """Decodes until every row is done or `state.forwards` reaches `stop_at`.

    `stop_at` is an array, so streaming in chunks (stop_at = forwards + chunk) reuses the
    one compiled program that also runs to completion (stop_at = max int).
    """
    cond = lambda s: jnp.any(~s.done) & (s.forwards < stop_at)
    return jax.lax.while_loop(cond, lambda s: plain_step(model, sampling_config, s), state)
