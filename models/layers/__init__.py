"""The layers every model family composes: norms, rope, attention, the gated MLP, parameters.

Each takes its options explicitly (from `specjax.models.config.ModelConfig` fields): a family module
(`specjax.models.llama`, `gemma3`, `qwen3`) is a composition of these, not a fork of them.
"""
