"""Llama-family models, loaders, tokenizer and registry (installed as specjax.models)."""
