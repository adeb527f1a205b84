"""A small draft model of the target's vocabulary proposing K tokens autoregressively (`proposer`)."""
