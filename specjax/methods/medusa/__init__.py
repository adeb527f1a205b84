"""Medusa heads on the target's last hidden state: chains and static trees (`proposer`)."""
