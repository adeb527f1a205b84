"""Medusa head training (installed as specjax.train_heads)."""
