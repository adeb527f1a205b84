"""The forced method's registry record: drafts the tokens a row's constraint fixes, prompt lookup
elsewhere."""

from __future__ import annotations

from specjax.methods.forced.options import ForcedOptions
from specjax.methods.forced.proposer import ForcedProposer, host_replay
from specjax.methods.method import NGRAM_FLAGS, Record

METHOD = "forced"

RECORD = Record(METHOD, ForcedProposer.from_spec, option_type=ForcedOptions, flags=NGRAM_FLAGS, on_request=True,
                replay=host_replay)
