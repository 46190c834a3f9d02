"""A node's pace: how long its steps take, and how long its own work in them takes.

Under DDP every rank finishes a step at the pace of the slowest (each waits for the others
in the gradient all-reduce), so step times alone cannot tell which node is slow. A rank's
*own* time can: the forward and backward compute DDP's reducer times itself, without the
wait for the other ranks (``worker/progress.py`` reads it; on a GPU DDP times it with CUDA
events, on the CPU with the wall clock). A node is as slow as its slowest worker.

The pace travels in the node's heartbeat (``stores/wire.py``) as ``<step_s>/<own_s>``
(four significant digits),
``-`` for a figure not known (no DDP: no own time). Pure.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass

from elastic_ext.rendezvous.protocol.hang import Beacon

MIN_STEPS = 3
"""Steps a worker finishes in its round before its figures count: the first steps of a
round restore, compile and warm caches."""


@dataclass(frozen=True)
class Pace:
    """One node's median step time and its slowest worker's median own time (seconds)."""

    step_s: float
    own_s: float | None = None

    def to_text(self) -> str:
        """Four significant digits: a fraction of a millisecond still compares."""
        own = "-" if self.own_s is None else f"{self.own_s:.4g}"
        return f"{self.step_s:.4g}/{own}"

    @classmethod
    def from_text(cls, text: str) -> Pace | None:
        """The pace ``to_text`` wrote; None for anything else (a newer format included)."""
        step, sep, own = text.partition("/")
        try:
            step_s = float(step)
            own_s = None if own == "-" else float(own)
        except ValueError:
            return None
        if not sep or not step_s > 0 or (own_s is not None and not own_s > 0):
            return None
        return cls(step_s, own_s)

    def differs(self, other: Pace | None, *, by: float = 0.15) -> bool:
        """Whether ``other`` is worth telling the others about instead of this one: a figure
        that appeared, went, or moved by more than the fraction ``by``."""
        if other is None or (self.own_s is None) != (other.own_s is None):
            return True
        pairs = [(self.step_s, other.step_s)]
        if self.own_s is not None and other.own_s is not None:
            pairs.append((self.own_s, other.own_s))
        return any(abs(a - b) > by * max(a, b) for a, b in pairs)


def node_pace(beacons: Iterable[Beacon]) -> Pace | None:
    """This node's pace from its workers' beacons (those past a round's first steps); None
    while none has a step time."""
    counted = [b for b in beacons if b.steps_in_round >= MIN_STEPS and b.step_s is not None
               and b.process not in ("", "Z")]
    if not counted:
        return None
    owns = [b.own_s for b in counted if b.own_s is not None]
    return Pace(statistics.median(b.step_s for b in counted if b.step_s is not None),
                max(owns) if owns else None)
