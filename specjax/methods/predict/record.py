"""Predicted outputs' registry record: a row's prediction (the text the answer is expected to
repeat, given with the request) drafts a chain where the row's text matches it."""

from __future__ import annotations

from specjax.methods.method import NGRAM_FLAGS, Flag, Record
from specjax.methods.predict.options import METHOD, PredictOptions
from specjax.methods.predict.proposer import PredictProposer

RECORD = Record(METHOD, PredictProposer.from_spec, option_type=PredictOptions, on_request=True, flags=NGRAM_FLAGS + (
    Flag("--prediction-cap", "prediction_cap", int,
         "predict: tokens of a row's prediction buffer; a longer prediction is refused (default 1024)", min=1),))
