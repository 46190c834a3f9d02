"""What the straggler tests read: a node's rendezvous id, its agent's ``slow`` events, the
job's step rate over a stretch, and the data position every step of an uninterrupted run
ends at."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from elastic_ext.local.job import Node
from elastic_ext.rendezvous.agent.events import EventKind
from elastic_ext.worker.loop.data import DataPosition, next_batch


def node_id(node: Node) -> str | None:
    """The id a node's agent goes by in the rendezvous (and in others' events)."""
    started = node.events(EventKind.STARTED)
    return str(started[0]["node"]) if started else None


def slow_events(nodes: Sequence[Node], about: str) -> list[dict[str, Any]]:
    """The ``slow`` events any agent emitted naming the node ``about``, oldest first."""
    found = [e for node in nodes for e in node.events(EventKind.SLOW) if e.get("peer") == about]
    return sorted(found, key=lambda e: float(e["time"]))


def steps_per_second(steps: Sequence[dict[str, Any]], start: float, end: float) -> float | None:
    """The job's step rate between ``start`` and ``end`` (unix times), from its ``step``
    events: steps after the first in the stretch over the time since it; None with fewer
    than three."""
    times = sorted(float(e["time"]) for e in steps if start <= float(e["time"]) <= end)
    if len(times) < 3 or times[-1] <= times[0]:
        return None
    return (len(times) - 1) / (times[-1] - times[0])


def positions(steps: int, *, seed: int, global_batch_size: int,
              dataset_size: int) -> dict[int, tuple[int, int]]:
    """``(epoch, offset)`` where the data stands after each step of an uninterrupted run:
    what ``ElasticLoop`` logs in its ``step`` events and keeps across rounds."""
    position, out = DataPosition(), {}
    for step in range(1, steps + 1):
        _, position = next_batch(position, seed, global_batch_size, dataset_size)
        out[step] = (position.epoch, position.offset)
    return out
