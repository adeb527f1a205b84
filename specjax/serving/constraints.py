"""A scheduler's constraint pool: its static sizes, the check that a constraint fits, and the slots.

A scheduler created with `constraint_pool=ConstraintLimits(...)` carries a pool of `slots` automata
(`specjax.core.constraint.PoolSpec`, capacity = the batch's rows, so every running request can hold
one), padded to the limits' states and classes: every program compiles once, in `prepare`, whatever
constraints arrive later. A constrained request's tables are checked against the limits at submit
(`ConstraintLimits.check`); at insert it takes a free pool slot (`PoolSlots.take`), the tables are
uploaded into it and the row carries that slot in `DecodeState.constraint`, so packing moves the row
with its constraint. The slot is freed when the request ends (finished, cancelled, failed) or the
batch resets. A free request keeps slot 0.
"""

from __future__ import annotations

import dataclasses

from specjax.core.constraint import PoolSpec

# how a server is started with a pool, or a larger one
FLAGS = "specjax serve --constraint-states N --constraint-classes M"


class ConstraintError(ValueError):
    """A request's constraint refused (malformed, two given, no pool, too large, no stop token): the
    message says what is wrong and how to fix it; `field` names the request field at fault
    ("response_format", "regex", "choice" or "constraint")."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclasses.dataclass(frozen=True, kw_only=True)
class ConstraintLimits:
    """The largest constraint a scheduler's pool holds (static: they shape every program).

    Attributes:
      states: automaton states of one constraint. Measured on SmolLM2's vocabulary: a 15-key config
        schema (strings, integers, numbers, booleans, all required) 270; the same with maxLength 32 on
        its strings 2136; `json_object` 1505.
      classes: token classes of one constraint (tokens with the same transitions from every state):
        207, 264 and 101 for those three.
      forced: tokens the `forced` method may draft from one state.
    """

    states: int = 4096  # ~4.4 MB of tables per pool slot on SmolLM2 (next_state is int16 [states, classes])
    classes: int = 512
    forced: int = PoolSpec.forced

    def __post_init__(self):
        for f in (x.name for x in dataclasses.fields(self)):
            v = getattr(self, f)
            if isinstance(v, bool) or int(v) != v or v < 1:
                raise ValueError(f"constraint pool {f}={v}: must be an integer >= 1 (no pool: constraint_pool=None)")

    def pool(self, *, vocab: int, capacity: int) -> PoolSpec:
        """The batch's pool: `capacity` constraints over the target's `vocab`, at these sizes."""
        return PoolSpec(vocab=vocab, capacity=capacity, states=self.states, classes=self.classes, forced=self.forced)

    def check(self, tables, *, vocab: int) -> None:
        """Raises ValueError unless `tables` (`specjax.constrain.TokenTables`) fit this pool, naming
        the limit it exceeds and how to raise it."""
        s, c = tables.next_state.shape
        for what, n, most, arg in (("automaton states", s, self.states, "states"),
                                   ("token classes", c, self.classes, "classes")):
            if n > most:
                raise ValueError(f"the constraint needs {n} {what}; the constraint pool holds at most {most}: "
                                 "simplify it (fewer keys, shorter maxLength), or raise the limit "
                                 f"(ConstraintLimits({arg}=...), {FLAGS})")
        if len(tables.token_class) > vocab:
            raise ValueError(f"the constraint was compiled over {len(tables.token_class)} tokens, the target has "
                             f"{vocab}: compile it with the target's tokenizer")


class PoolSlots:
    """Which pool slot (1..capacity) each constrained request holds; slot 0 is the free one.

    Slots are handed out lowest first and owned by request id, so a row that packing moves keeps its
    slot (the device row carries it) and a slot is reused only after its request ended."""

    def __init__(self, capacity: int):
        self.capacity = int(capacity)
        self._owner: dict[int, int] = {}  # request id -> its pool slot

    def take(self, rid: int) -> int:
        """A free slot, now held by request `rid`."""
        if rid in self._owner:
            raise ValueError(f"request {rid} already holds constraint pool slot {self._owner[rid]}")
        used = set(self._owner.values())
        slot = next((i for i in range(1, self.capacity + 1) if i not in used), None)
        if slot is None:  # a pool slot per batch row: a running request always finds one
            raise RuntimeError(f"every constraint pool slot (1..{self.capacity}) is held: {self._owner}")
        self._owner[rid] = slot
        return slot

    def free(self, rid: int) -> None:
        """Frees request `rid`'s slot (nothing if it holds none)."""
        self._owner.pop(rid, None)

    def clear(self) -> None:
        """Every slot free (a fresh batch: its pool is empty)."""
        self._owner.clear()

    @property
    def held(self) -> dict[int, int]:
        """{request id: pool slot} now."""
        return dict(self._owner)
