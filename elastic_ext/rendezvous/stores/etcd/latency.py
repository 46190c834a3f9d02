"""How long etcd takes to answer, as this agent measures it, and the request timeout and
retry waits that follow from it.

A fixed request timeout turns a starved store into a storm: at 1,024 agents on two cores
etcd answered in seconds, every request that outlasted ``request_timeout`` was dropped
and sent again (etcd still did the first), and each retry's short backoff added more.
TCP's answer to the same problem is a retransmission timeout that follows the measured
round trip and backs off on a loss (RFC 6298); this is that, for one agent's requests:
the timeout is ``TIMEOUT_MULTIPLE`` times the slowest recent answer (a timed-out request
counts as an answer as slow as its timeout, so timeouts back off), never under the
configured ``request_timeout`` and never over ``connect_timeout``; the retry waits start
at half the slowest recent answer. The slowest answer is forgotten by halves every
``HALF_LIFE_S``, so the agent speeds up again once the store does.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

TIMEOUT_MULTIPLE = 4.0
"""A request may take this many times the slowest recent answer before it is given up."""

HALF_LIFE_S = 10.0
"""The slowest recent answer counts half as much after this long."""

FIRST_WAIT_S = 0.02
"""The first retry wait while the store answers fast (as before the wait followed the load)."""


class StoreLatency:
    """Thread-safe: every request of an agent's client records its answer time here."""

    def __init__(self, floor: float, ceiling: float, clock: Callable[[], float]) -> None:
        """``floor``: the configured request timeout; ``ceiling``: how long one operation
        may keep trying (``connect_timeout``)."""
        self._floor = floor
        self._ceiling = max(floor, ceiling)
        self._clock = clock
        self._lock = threading.Lock()
        self._slowest = 0.0
        self._at = clock()

    def record(self, seconds: float) -> None:
        """One request took ``seconds`` (answered, or given up after its timeout)."""
        now = self._clock()
        with self._lock:
            if seconds >= self._decayed(now):
                self._slowest, self._at = seconds, now

    @property
    def slowest(self) -> float:
        """The slowest recent answer, forgotten by halves every ``HALF_LIFE_S``."""
        with self._lock:
            return self._decayed(self._clock())

    def _decayed(self, now: float) -> float:
        return self._slowest * 0.5 ** (max(0.0, now - self._at) / HALF_LIFE_S)

    def request_timeout(self) -> float:
        """How long the next request may take before it is given up and sent again."""
        return min(self._ceiling, max(self._floor, TIMEOUT_MULTIPLE * self.slowest))

    def first_retry_wait(self) -> float:
        """The first wait before a retry; the next ones double (``tenacity``'s exponential)."""
        return max(FIRST_WAIT_S, self.slowest / 2)
