"""specjax: speculative decoding in JAX."""
