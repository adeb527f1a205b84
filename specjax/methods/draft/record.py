"""The draft model's registry record: a small model with the target's vocabulary drafts a chain; its
asset is that model (`--draft-model NAME`), loaded in the target's dtype."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

from specjax import sharding
from specjax.methods.draft.proposer import DraftModelProposer
from specjax.methods.method import Record
from specjax.models import loader

METHOD = "draft"
PROBE = "Hello, world! 12345 def f(x): return x"  # text both tokenizers must encode alike


@dataclasses.dataclass(frozen=True)
class DraftModel:
    """A draft model (a `specjax.models.transformer.Transformer`) and its tokenizer (None: not
    checked against the target's)."""

    module: Any
    tokenizer: Any = None


def build(spec, assets):
    """(proposer, the draft's weights) for a chain of `spec.k`."""
    draft = assets.methods.get(METHOD)
    if draft is None:
        raise ValueError("method 'draft' needs a draft model: Engine.load(..., assets={'draft': NAME}) "
                         "or --draft-model NAME")
    dv, tv = draft.module.config.vocab_size, assets.target.config.vocab_size
    if dv != tv:  # its drafts are ids of its own vocabulary: they must be the target's
        raise ValueError(f"draft model vocabulary ({dv} tokens) differs from the target's ({tv}); "
                         "a draft must share the target's tokenizer")
    return DraftModelProposer.from_model(draft.module, k=spec.k)


def load(host, path: str) -> DraftModel:
    """The model named `path` (a catalogue name, .gguf file or HF directory) in the host's dtype."""
    lm = loader.load(path, dtype=host.config.dtype)
    return DraftModel(module=lm.model, tokenizer=lm.tokenizer)


def fit(draft: DraftModel, host) -> DraftModel:
    """`draft` checked against the host's target: the same vocabulary and tokenizer (raises), not
    larger (warns); placed on its mesh."""
    dc, tc = draft.module.config, host.config
    if dc.vocab_size != tc.vocab_size:
        raise ValueError(f"draft model vocabulary ({dc.vocab_size} tokens) differs from the target's "
                         f"({tc.vocab_size}); a draft must share the target's tokenizer")
    if draft.tokenizer is not None and host.tokenizer is not None:
        if draft.tokenizer.encode(PROBE, add_bos=False) != host.tokenizer.encode(PROBE, add_bos=False):
            raise ValueError("draft model tokenizer encodes text differently from the target's; "
                             "a draft must share the target's tokenizer")
    if draft.module.num_params > host.model.num_params:
        warnings.warn(f"draft model ({draft.module.num_params / 1e6:.0f}M params) is larger than its target "
                      f"({host.model.num_params / 1e6:.0f}M): speculation will be slower than plain")
    return dataclasses.replace(draft, module=sharding.place_module(draft.module, host.mesh))


RECORD = Record(METHOD, build, flag="--draft-model", flag_value="NAME (a model with the target's vocabulary)",
                flag_help="draft model for --method draft", load=load, fit=fit,
                modules=lambda draft: ((draft.module, True),))
