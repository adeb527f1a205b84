#!/usr/bin/env python
"""Gemma 3 270M: a forward of 1 and 5 tokens at a deep position with the sliding layers in a ring
(init_cache(window=5)) against full buffers with the window as a mask (init_cache()), interleaved."""
import statistics
import time

import jax, jax.numpy as jnp
from flax import nnx
from specjax.models import loader

lm = loader.load("gemma3-270m")
model = lm.model
graphdef, params = nnx.split(model)

@jax.jit
def fwd(params, tokens, positions, cache):
    m = nnx.merge(graphdef, params)
    return m(tokens, positions, cache).logits

rows = []
for S in (1024, 4096):
    caches = {"ring": model.init_cache(1, S, window=5), "mask": model.init_cache(1, S)}
    nbytes = {k: sum(x.nbytes for x in jax.tree.leaves(c)) for k, c in caches.items()}
    for T in (1, 5):
        pos = jnp.arange(S - 8, S - 8 + T, dtype=jnp.int32)[None]
        tok = jnp.full((1, T), 100, jnp.int32)
        for c in caches.values():
            fwd(params, tok, pos, c).block_until_ready()
        times = {k: [] for k in caches}
        for _ in range(15):
            for k, c in caches.items():
                t = time.perf_counter(); fwd(params, tok, pos, c).block_until_ready(); times[k].append(time.perf_counter() - t)
        for k in caches:
            rows.append((S, T, k, statistics.median(times[k]) * 1e3, nbytes[k] / 2**20))
            print(f"S={S} T={T} {k}: {rows[-1][3]:.1f} ms, cache {rows[-1][4]:.1f} MiB", flush=True)
