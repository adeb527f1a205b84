"""Static decoding choices: which proposer, how many drafts, which tree. Hashable, jit-static."""

from __future__ import annotations

import dataclasses
import functools

from typing import Any

from specjax.methods import registry
from specjax.core.tree import MAX_TREE_NODES, TREES, Tree, chain, parse_tree, validate_tree  # noqa: F401 (re-exported)

MAX_K = 16  # verify windows beyond this cost more than they save on any model we target


@functools.total_ordering
@dataclasses.dataclass(frozen=True, kw_only=True)
class SpecConfig:
    """How to speculate; also the auto scheduler's option (hashable; `SpecConfig()` is plain).

    It holds what every method shares; each method's own options (a tree, n-gram lengths, ...) are
    `options`, a dataclass of the method's folder.

    Attributes:
      method: none (the plain loop) or the name of a method's record in
        `specjax.methods.registry.RECORDS` (ngram: prompt lookup; draft: a small draft model;
        medusa: heads on the target's last hidden state, chain or static tree; eagle: an EAGLE
        head; recycle: token recycling), which checks the options that belong to it.
      k: drafted tokens per step for chains, or the depth of a tree; the target verifies the window
        in one forward. A static tree in the options sets it to the tree's depth.
      typical: LOSSY: Medusa's typical acceptance (epsilon, delta) at temperature > 0 instead of
        the lossless rule (`acceptance.TypicalAcceptance`). Output no longer follows the target
        distribution.
      options: the method's own options, the dataclass its record names (`Record.option_type`:
        `NgramOptions`, `MedusaOptions`, `EagleOptions`, `RecycleOptions`); None takes its defaults
        (filled in here). `SpecConfig.make(method, **fields)` builds one from keywords.

    As an option of the auto controller (`specjax.serving.controller`), a spec is named by its `label`
    ("none", "ngram:4", "medusa-tree:3", "eagle-tree:4"), keeps its acceptance statistics under its
    `kind` and commits at most `depth` drafts per step.
    """

    method: str = "none"
    k: int = 4
    typical: tuple[float, float] | None = None
    options: Any = None

    @classmethod
    def make(cls, method: str = "none", **fields) -> "SpecConfig":
        """A spec from keywords: `SpecConfig` fields, and the fields of the method's own options
        (`SpecConfig.make("ngram", k=4, ngram_table=4096)`). A keyword given as None keeps its
        default (as an unset command-line flag); one that is another method's option is refused."""
        mine = {f.name for f in dataclasses.fields(cls)}
        spec_kw = {k: v for k, v in fields.items() if k in mine and v is not None}
        rest = {k: v for k, v in fields.items() if k not in mine and v is not None}
        kind = None if method == "none" else registry.record(method).option_type
        names = set() if kind is None else {f.name for f in dataclasses.fields(kind)}
        for k in rest:
            if k not in names:
                owners = registry.option_owners(k)
                if not owners:
                    raise ValueError(f"unknown option {k}=: give a SpecConfig field or an option of method "
                                     f"{method!r}")
                raise ValueError(f"{k}= applies to method {' or '.join(map(repr, owners))} only")
        if rest:
            spec_kw["options"] = dataclasses.replace(spec_kw.get("options") or kind(), **rest)
        return cls(method=method, **spec_kw)

    def with_options(self, **fields) -> "SpecConfig":
        """This spec with some of its method's own options replaced."""
        return dataclasses.replace(self, options=dataclasses.replace(self.options, **fields))

    def __post_init__(self):
        object.__setattr__(self, "options", registry.options_of(self))  # its defaults when None
        registry.check(self)  # the method exists; its own checks hold
        if self.typical is not None and self.method == "none":
            raise ValueError("typical= is an acceptance rule: give a speculative method")
        if self.typical is not None:
            eps, delta = self.typical
            if not (0 < eps < 1 and 0 < delta < 1):
                raise ValueError(f"typical={self.typical}: need 0 < epsilon < 1 and 0 < delta < 1")
        if self.method == "none":
            return
        depth, _ = registry.shape(self)
        if depth is not None:
            object.__setattr__(self, "k", depth)
        if int(self.k) != self.k or not 1 <= self.k <= MAX_K:
            raise ValueError(f"k={self.k}: must be an integer in [1, {MAX_K}]")

    @property
    def is_tree(self) -> bool:
        """The method drafts a tree (a static one in its options, or one built each step)."""
        return registry.shape(self)[1]

    @property
    def kind(self) -> str:
        """The option's family: "none" (plain), the method for a chain, the method with "-tree" for
        a tree ("medusa-tree", "eagle-tree"); the auto controller keeps acceptance per kind."""
        if self.method == "none":
            return "none"
        return f"{self.method}-tree" if self.is_tree else self.method

    @property
    def depth(self) -> int:
        """The most drafts one step can accept: 0 for plain, k for a chain, the tree's depth."""
        return 0 if self.method == "none" else int(self.k)

    @property
    def label(self) -> str:
        """A short stable name ("none", "ngram:4", "medusa-tree:3"), used in chunk logs, telemetry
        and metrics."""
        if self.method == "none":
            return "none"
        return f"{self.kind}:{self.depth}"

    def _order(self) -> tuple[str, str]:
        return self.label, repr(self)

    def __lt__(self, other):
        """A total order (by label), so that dicts keyed by specs are JAX pytrees (sorted keys)."""
        if not isinstance(other, SpecConfig):
            return NotImplemented
        return self._order() < other._order()
