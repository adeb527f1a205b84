"""Medusa head training (installed as train_heads)."""
