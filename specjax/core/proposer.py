"""The proposer protocol (see `specjax.methods`), and mixins for chain proposers."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from jaxtyping import Array

from specjax.core import tree
from specjax.core.sampling import Sampling
from specjax.core.shared import SharedSpec
from specjax.core.state import DecodeState


@runtime_checkable
class Proposer(Protocol):
    """What a draft proposer declares: the static (hashable) side; its arrays travel as `params`
    and `pstate`. The Decoder reads these attributes and probes for nothing else.

    Attributes:
      k: drafts per step for a chain, or the depth of its tree.
      topology: its verify window: a static `tree.Topology` (a chain of k, or a fixed candidate
        tree), or a `tree.DynamicTopology` (the node budget of a tree it builds each step).
      taps: target layers whose input it reads (an EAGLE-3 head's fused features); () for none.
      shared: the batch-shared state it reads (`specjax.core.shared.SharedSpec`s: the cross-request
        n-gram table, token recycling's matrix), in `state.shared.parts[spec.name]`; () for none.
        The Decoder carries and updates them.

    `propose` returns (drafts, q, pstate): drafts are tokens `[B, N]` on the nodes of a static
    topology, or a `tree.DraftTree` for a dynamic one; q is the `[B, N, V]` distribution they were
    sampled from, or None for a deterministic proposer (one-hot q).
    """

    k: int

    @property
    def topology(self) -> tree.Topology | tree.DynamicTopology: ...

    @property
    def taps(self) -> tuple[int, ...]: ...

    @property
    def shared(self) -> tuple[SharedSpec, ...]: ...

    def init(self, params: Any, state: DecodeState, inputs: Any, hidden: Array) -> Any: ...

    def propose(self, params: Any, pstate: Any, state: DecodeState, sampling_config: Sampling,
                keys: Array) -> tuple[Array | tree.DraftTree, Array | None, Any]: ...

    def reconcile(self, params: Any, pstate: Any, state: DecodeState, verify: Any,
                  accepted: Any) -> Any: ...


class Chain:
    """Mixin: the proposer drafts a static tree given by `paths`, by default a chain of `k` tokens,
    and reads no tapped layers and no batch-shared state."""

    @property
    def paths(self) -> tree.Tree:
        return tree.chain(self.k)

    @property
    def topology(self) -> tree.Topology:
        return tree.topology(self.paths)

    @property
    def taps(self) -> tuple[int, ...]:
        return ()

    @property
    def shared(self) -> tuple[SharedSpec, ...]:
        return ()


class Stateless(Chain):
    """Mixin for chain proposers that keep no state between steps."""

    def init(self, params, state, inputs, hidden):
        return None

    def reconcile(self, params, pstate, state, verify, accepted):
        return pstate
