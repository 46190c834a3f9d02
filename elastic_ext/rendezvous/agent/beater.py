"""The watcher's heartbeat on a thread of its own.

A keeper beats in its tick's one request (``StoreBackend.keeper_read``), so its beat is as
late as its tick. A follower's tick reads one heartbeat; the watcher's reads every
heartbeat and judges them, and in a round being formed its agent also reads every join
and writes the round. Starved (1,024 agents on two cores), that work made the watcher's
beat late past the heartbeat timeout while it worked, and its followers, who judge only
it, declared the busiest node in the job dead (issue 43). So while a keeper judges
everyone, a beater also beats every interval on its own connection (``clone``), without
waiting on the tick: the watcher's heartbeat says its agent lives, not that its last
judgement was quick. One request a second more, for one node of the job.

It beats only while the keeper ticks: a keeper that has not begun a tick for
``STALLED_TIMEOUTS`` heartbeat timeouts (stuck in a store call, say) judges nobody, and
its beat stops so that the others find it dead and take its place.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from elastic_ext.rendezvous.protocol.clock import Clock
from elastic_ext.rendezvous.protocol.pace import Pace
from elastic_ext.rendezvous.stores.contract import Heartbeats, StoreBackend

logger = logging.getLogger(__name__)

STALLED_TIMEOUTS = 3.0
"""Heartbeat timeouts without a tick begun after which the beater stops beating for the
keeper (a starved watcher's ticks took up to 3 s against a 3 s timeout)."""


class Beater:
    """Beats ``node`` every ``interval`` while the keeper judges everyone and ticks
    (``ticked``); its thread starts at the first ``ticked(wanted=True)`` after ``allow``
    (the keeper's own thread runs: a keeper ticked by hand in a test beats only in its
    ticks)."""

    def __init__(self, make_backend: Callable[[], StoreBackend], node: str, *, interval: float,
                 timeout: float, clock: Clock, presence_port: int | None,
                 pace: Callable[[], Pace | None]) -> None:
        self._make_backend = make_backend
        self._node = node
        self._interval = interval
        self._stalled_after = STALLED_TIMEOUTS * timeout
        self._clock = clock
        self._presence_port = presence_port
        self._pace = pace
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._wanted = False
        self._allowed = False
        self._tick_began = clock.monotonic()

    def allow(self) -> None:
        """The keeper's thread started: the beater may start its own when wanted."""
        self._allowed = True

    def ticked(self, *, wanted: bool) -> None:
        """The keeper began a tick; ``wanted``: it judges everyone now."""
        self._tick_began = self._clock.monotonic()
        self._wanted = wanted
        if wanted and self._allowed and self._thread is None and not self._stop.is_set():
            self._thread = threading.Thread(target=self._run, name="etcd-ext-beater",
                                            daemon=True)
            self._thread.start()

    def beats_now(self) -> bool:
        """Whether the beater beats at this moment: wanted, and the keeper not stalled."""
        stalled = self._clock.monotonic() - self._tick_began > self._stalled_after
        return self._wanted and not stalled

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5 * self._interval + 5)

    def _run(self) -> None:
        backend = self._make_backend()
        told_stalled = False
        try:
            while not self._stop.wait(self._interval):
                beats = self.beats_now()
                if beats:
                    self._beat(backend)
                elif self._wanted and not told_stalled:
                    logger.warning("etcd-ext: the keeper began no tick for %.1fs: its "
                                   "heartbeat stops so that the others take its place",
                                   self._clock.monotonic() - self._tick_began)
                told_stalled = not beats and self._wanted
        finally:
            backend.close()

    def _beat(self, backend: Heartbeats) -> None:
        try:
            backend.beat(self._node, self._presence_port, self._pace())
        except Exception as exc:  # the keeper's tick reports a store that is down
            logger.info("etcd-ext: the beater could not beat: %s", exc)
