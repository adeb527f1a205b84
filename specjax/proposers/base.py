"""The proposer protocol (see `specjax.proposers`)."""

from __future__ import annotations

from typing import Any, Protocol

from jaxtyping import Array

from specjax.sampling import SamplingConfig
from specjax.state import DecodeState


class Proposer(Protocol):
    k: int

    def init(self, params: Any, state: DecodeState, prompts: Array, hidden: Array) -> Any: ...

    def propose(self, params: Any, pstate: Any, state: DecodeState,
                sampling_config: SamplingConfig, keys: Array) -> tuple[Array, Array | None, Any]: ...

    def reconcile(self, params: Any, pstate: Any, state: DecodeState, hidden: Array,
                  num_accepted: Array) -> Any: ...


class Stateless:
    """Mixin for proposers that keep no state between steps."""

    def init(self, params, state, prompts, hidden):
        return None

    def reconcile(self, params, pstate, state, hidden, num_accepted):
        return pstate
