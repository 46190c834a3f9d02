"""Judging other nodes alive or dead from heartbeat counters, on this agent's clock.

A node is dead when its counter has not changed for ``timeout`` seconds of *our*
observation. Time we could not observe (a failed read, e.g. etcd down or this
process frozen) does not count against anyone: after such a gap every timer
restarts, so an etcd outage or a leader election never kills a healthy job. Nor
does a late observer judge: when our last read is older than half the timeout (a
keeper delayed by a loaded machine or a long pause, or a read that took that long: a
starved store), nobody is dead until we read again. The judge may be the slow one, and a
false death adds load (a new round) to a system already short of it.

Where the store expires heartbeat keys itself (etcd's leases: ``expiring``), the judgement
is the store's: a key present is a live node, whatever its value; a key that vanished
after we saw it is a dead one at once (its agent did not renew its lease for a TTL, chosen
to fit in the timeout); a key never seen is judged as a still counter.

One node judges for the whole job (the round's closer, then its rank 0: ``joins.closer_of``)
and publishes a ``Verdict``; the others read it and watch only that node's heartbeat, so
liveness costs the store O(N) reads per interval for the job, not O(N) per agent.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

LEFT = b"left"  # what a node writes to its heartbeat key when it leaves cleanly


@dataclass(frozen=True)
class Verdict:
    """The watching node's judgement, as it publishes it: who is dead, and of those, who
    left, and who of the dead ran in the last closed round (``round``; its ``lost``), so
    that a node that knows its round only by its seat (``head.py``) can tell its workers."""

    by: str
    generation: str
    dead: frozenset[str]
    left: frozenset[str] = frozenset()
    round: int = 0
    lost: frozenset[str] = frozenset()

    def to_bytes(self) -> bytes:
        return json.dumps({"by": self.by, "generation": self.generation,
                           "dead": sorted(self.dead), "left": sorted(self.left),
                           "round": self.round, "lost": sorted(self.lost)},
                          separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, raw: bytes | None) -> Verdict | None:
        """Parse strictly; None for a missing value or anything etcd-ext did not write."""
        if raw is None or len(raw) > 1 << 20:
            return None
        try:
            doc = json.loads(raw)
            by, generation, dead, left = doc["by"], doc["generation"], doc["dead"], doc["left"]
            round_, lost = doc.get("round", 0), doc.get("lost", [])
            if not isinstance(by, str) or not isinstance(generation, str) \
                    or not isinstance(dead, list) or not isinstance(left, list) \
                    or not isinstance(lost, list) or not isinstance(round_, int) \
                    or not all(isinstance(n, str) for n in dead + left + lost):
                return None
            return cls(by, generation, frozenset(dead), frozenset(left), round_,
                       frozenset(lost))
        except (ValueError, KeyError, TypeError, UnicodeDecodeError, RecursionError):
            return None


@dataclass
class _Seen:
    value: bytes | None
    changed_at: float
    moved: bool = False  # the value changed since we first saw it: the node beats
    expired: bool = False  # an expiring key we saw vanished: its lease ran out


class Liveness:
    def __init__(self, timeout: float, clock: Callable[[], float] = time.monotonic, *,
                 expiring: bool = False) -> None:
        self._timeout = timeout
        self._expiring = expiring
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
                known.value, known.changed_at, known.moved = value, now, True
                known.expired = False
            elif self._expiring and value is not None:
                known.changed_at = now  # the key is there: its lease holds
            elif self._expiring and known.value is not None:
                known.expired = True  # seen, now gone: the store judged it

    def blind(self) -> None:
        """A read failed: what we saw so far says nothing about the time since."""
        self._blind = True

    def is_dead(self, node: str) -> bool:
        seen = self._seen.get(node)
        if seen is None:
            return False
        if seen.value == LEFT or seen.expired:
            return True
        now = self._clock()
        if self._last_read is None or now - self._last_read > self._timeout / 2:
            # Our own view is stale (a late keeper, a long pause of this process): what we
            # read last says nothing about the time since, so nobody is judged on it.
            return False
        return now - seen.changed_at >= self._timeout

    def certain(self, node: str) -> bool:
        """Whether ``node`` is dead on its own word or the store's (it left; its lease ran
        out), not on a still counter that our own slowness could explain."""
        seen = self._seen.get(node)
        return seen is not None and (seen.value == LEFT or seen.expired)

    @property
    def timeout(self) -> float:
        return self._timeout

    def still_for(self, node: str) -> float:
        """Seconds since ``node``'s heartbeat last changed, on our clock (0 if not seen)."""
        seen = self._seen.get(node)
        return 0.0 if seen is None else self._clock() - seen.changed_at

    def moved(self, node: str) -> bool:
        """Whether ``node``'s heartbeat changed since we started watching it."""
        seen = self._seen.get(node)
        return seen is not None and seen.moved

    def dead_among(self, nodes: Iterable[str]) -> frozenset[str]:
        return frozenset(n for n in nodes if self.is_dead(n))

    def silence(self) -> dict[str, float]:
        """Seconds since each watched node's heartbeat last changed (an expiring key: since
        we last saw it), on our clock (a node that left is not listed)."""
        now = self._clock()
        return {node: now - seen.changed_at for node, seen in self._seen.items()
                if seen.value != LEFT}

    def forget(self, keep: Iterable[str]) -> None:
        keep = set(keep)
        for node in list(self._seen):
            if node not in keep:
                del self._seen[node]
