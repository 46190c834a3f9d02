"""Judging other nodes alive or dead from heartbeat counters, on this agent's clock.

A node is dead when its counter has not changed for ``timeout`` seconds of *our*
observation. Time we could not observe (a failed read, e.g. etcd down or this
process frozen) does not count against anyone: after such a gap every timer
restarts, so an etcd outage or a leader election never kills a healthy job. Nor
does a late observer judge: when our last read is older than half the timeout (a
keeper delayed by a loaded machine or a long pause), nobody is dead until we read again.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

LEFT = b"left"  # what a node writes to its heartbeat key when it leaves cleanly


@dataclass
class _Seen:
    value: bytes | None
    changed_at: float


class Liveness:
    def __init__(self, timeout: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._timeout = timeout
        self._clock = clock
        self._seen: dict[str, _Seen] = {}
        self._last_read: float | None = None
        self._blind = False

    def observe(self, beats: Mapping[str, bytes | None]) -> None:
        """Record one successful read of the heartbeat keys of ``beats``' nodes."""
        now = self._clock()
        gap = self._last_read is not None and now - self._last_read > self._timeout / 2
        if self._blind or gap:
            for seen in self._seen.values():
                seen.changed_at = now
            self._blind = False
        self._last_read = now
        for node, value in beats.items():
            known = self._seen.get(node)
            if known is None:
                self._seen[node] = _Seen(value, now)
            elif known.value != value and value is not None:
                # A key that vanished (a dead agent's etcd lease expired) is no heartbeat.
                known.value, known.changed_at = value, now

    def blind(self) -> None:
        """A read failed: what we saw so far says nothing about the time since."""
        self._blind = True

    def is_dead(self, node: str) -> bool:
        seen = self._seen.get(node)
        if seen is None:
            return False
        if seen.value == LEFT:
            return True
        now = self._clock()
        if self._last_read is None or now - self._last_read > self._timeout / 2:
            # Our own view is stale (a late keeper, a long pause of this process): what we
            # read last says nothing about the time since, so nobody is judged on it.
            return False
        return now - seen.changed_at >= self._timeout

    def dead_among(self, nodes: Iterable[str]) -> frozenset[str]:
        return frozenset(n for n in nodes if self.is_dead(n))

    def silence(self) -> dict[str, float]:
        """Seconds since each watched node's heartbeat last changed, on our clock (a node
        that left is not listed)."""
        now = self._clock()
        return {node: now - seen.changed_at for node, seen in self._seen.items()
                if seen.value != LEFT}

    def forget(self, keep: Iterable[str]) -> None:
        keep = set(keep)
        for node in list(self._seen):
            if node not in keep:
                del self._seen[node]
