"""The proposer protocol (see `specjax.proposers`)."""

from __future__ import annotations

from typing import Any, Protocol

from jaxtyping import Array

from specjax.tree import Tree, chain
from specjax.sampling import Sampling
from specjax.state import DecodeState


class Proposer(Protocol):
    """Static (hashable) side of a draft proposer; its arrays travel as `params` and `pstate`."""

    k: int

    @property
    def paths(self) -> Tree:
        """The window it drafts, as tree paths (a chain of k for chain proposers)."""

    def init(self, params: Any, state: DecodeState, inputs: Any, hidden: Array) -> Any: ...

    def propose(self, params: Any, pstate: Any, state: DecodeState,
                sampling_config: Sampling, keys: Array) -> tuple[Array, Array | None, Any]: ...

    def reconcile(self, params: Any, pstate: Any, state: DecodeState, verify: Any,
                  accepted: Any) -> Any: ...


class Chain:
    """Mixin: the proposer drafts a chain of `k` tokens."""

    @property
    def paths(self) -> Tree:
        return chain(self.k)


class Stateless(Chain):
    """Mixin for chain proposers that keep no state between steps."""

    def init(self, params, state, inputs, hidden):
        return None

    def reconcile(self, params, pstate, state, verify, accepted):
        return pstate
