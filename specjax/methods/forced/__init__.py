"""Forced text as drafts: the tokens a structured-answer constraint fixes (`proposer`)."""
