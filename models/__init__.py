"""Model families over shared layers, loaders, tokenizer and the model catalogue (installed as specjax.models)."""
