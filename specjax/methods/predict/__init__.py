"""Predicted outputs: drafts copied from a text the client expects the answer to restate (`proposer`)."""
