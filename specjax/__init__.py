"""specjax: speculative decoding in JAX.

The functional core is `Decoder` (static: proposer, acceptance rule, sampling method, cache length)
with pure `prefill`, `decode` and `step` (slot operations: `specjax.core.slots`); the sampling method is `sampling.Greedy()` or
`sampling.Sample()` (the top-level `Greedy` is the exact-match acceptance rule); `Inputs` holds the
per-row arrays; `generate` jits and runs them. `Engine` and `Scheduler` are hosts over the same
primitives. Shapes in type hints and einsum strings use one dimension alphabet, written once at
the top of `specjax.models.llama`.
"""

from specjax.core import acceptance
from specjax.core import sampling
from specjax.core.acceptance import Greedy, SpecInfer, Speculative, TypicalAcceptance
from specjax.methods.config import SpecConfig
from specjax.core.decoder import Decoder, Inputs, State, Stats, cache_length, generate, new_tokens
from specjax.serving.engine import Engine, GenerateOptions, Result
from specjax.methods import (DraftModelProposer, EagleParams, EagleProposer, MedusaParams, MedusaProposer,
                               NgramProposer)
from specjax.serving.scheduler import Scheduler
from specjax.telemetry import SpecCounters

__all__ = [
    "Decoder", "Inputs", "State", "Stats", "cache_length", "generate", "new_tokens",
    "acceptance", "sampling", "Greedy", "SpecInfer", "Speculative", "TypicalAcceptance",
    "SpecConfig", "Engine", "GenerateOptions", "Result", "Scheduler", "SpecCounters",
    "NgramProposer", "DraftModelProposer", "MedusaProposer", "MedusaParams", "EagleProposer", "EagleParams",
]
