"""Prompt lookup: drafts copied from an earlier occurrence of the recent n-gram (`proposer`)."""
