"""An EAGLE head drafting chains or dynamic trees from the target's features (`proposer`)."""
