"""Host replays for the auto controller: what the options a method's record can replay on the host
(prompt lookup, forced text under a request's constraint: `Record.replay`) would have kept on the
text other options commit, observed as evidence, so an option needs no chunk of its own to be judged.

`Replays` watches a continuous-batching host's requests: `start` when a request's first token exists,
`chunk` after each chunk with the kind that ran, `end` when it leaves. It knows no method by name:
the registry says which options replay and builds each replay.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

from specjax.core.host_lookup import replay
from specjax.methods import registry
from specjax.methods.config import SpecConfig

Observe = Callable[[Any, str, list[int], int], None]
"""`Controller.observe(row, kind, kept per draft position, steps)`."""


class Replays:
    """Each running request's host replays, one per replayable kind among `specs` (at its longest k).

    Args:
      specs: the host's options.
      observe: where the evidence goes (`Controller.observe`), read at each chunk (the controller may
        be built after this observer).
    """

    def __init__(self, specs: Iterable[SpecConfig], observe: Callable[[], Observe]):
        self.specs: dict[str, SpecConfig] = {}
        for s in specs:
            if registry.looks_up(s.method) and s.k > getattr(self.specs.get(s.kind), "k", -1):
                self.specs[s.kind] = s
        self._observe = observe
        self._rows: dict[int, dict[str, Any]] = {}  # request id -> {kind: its host replay}

    def start(self, req) -> None:
        """A request's replays from its prompt and first token (`Request.ids`, `tokens`, `constraint`)."""
        if self.specs:
            self._rows[req.id] = {kind: registry.host_replay(s, req.ids + req.tokens, prompt_len=len(req.ids),
                                                             constraint=req.constraint)
                                  for kind, s in self.specs.items()}

    def chunk(self, req, ran: str) -> None:
        """Evidence from the text the last chunk committed to `req`; the kind that ran (`ran`) was
        observed for real, so its replay only catches up."""
        committed = req.ids + req.tokens
        for kind, lookup in self._rows.get(req.id, {}).items():
            if kind == ran:
                lookup.extend(committed[len(lookup.tokens):])
                continue
            kept, steps = replay(lookup, committed)
            if steps:
                self._observe()(req.id, kind, kept, steps)

    def end(self, req) -> None:
        self._rows.pop(req.id, None)
