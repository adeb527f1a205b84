"""Prompt lookup's registry record: n-grams of the row's own text (and, in a long-running host, a
cross-request table) draft a chain; it needs no asset, and the auto scheduler replays it on the
host over the text other options commit (`Record.replay`)."""

from __future__ import annotations

from specjax.methods.method import NGRAM_FLAGS, Record
from specjax.methods.ngram import proposer
from specjax.methods.ngram.options import NgramOptions

METHOD = "ngram"

RECORD = Record(
    METHOD, proposer.NgramProposer.from_spec, option_type=NgramOptions, serving=proposer.serving,
    replay=proposer.host_replay, flags=NGRAM_FLAGS)
