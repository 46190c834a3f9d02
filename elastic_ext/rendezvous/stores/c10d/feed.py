"""The embedded store's state writes, counted so that a waiter need not read the state,
and reads of its keys and counters that never wait and never create a key.

Each state write adds one to ``STATE_SEQ`` and creates ``changed/<count>``; a waiter reads
the count, then blocks in ``TCPStore.wait`` on the key of the next write. A TCPStore
cannot watch a key, and waiting on one costs the store nothing until it appears. The
joins of an open round are counted the same way, for its closer (``c10d/backend.py``).
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Protocol

from torch.distributed import DistStoreError

logger = logging.getLogger(__name__)

STATE_SEQ = "state_seq"
CHANGED = "changed/"  # changed/<n>: created by the n-th state write
CHANGED_KEPT = 64
"""The newest ``changed/`` keys kept: a waiter is behind the count it read by a write or two,
never by 64 (and a key it missed costs it one ``WriteFeed.WAIT_S``, not the change)."""


_ABSENT = b"\0etcd-ext: no such key\0"


class CountingStore(Protocol):
    """What the protocol needs of a (prefixed) TCPStore."""

    def compare_set(self, key: str, expected_value: bytes, desired_value: bytes) -> bytes: ...
    def set(self, key: str, value: bytes) -> None: ...
    def delete_key(self, key: str) -> bool: ...
    def add(self, key: str, amount: int) -> int: ...
    def wait(self, keys: list[str], timeout: timedelta) -> None: ...


def read_key(store: CountingStore, key: str) -> bytes | None:
    """The key's value, or None, in one request that never waits: ``get`` waits for a
    missing key (a key removed after ``check`` said it was there would cost
    ``connect_timeout``), while ``compare_set`` echoes an expected value that is absent."""
    value = bytes(store.compare_set(key, _ABSENT, _ABSENT))
    return None if value == _ABSENT else value


def read_count(store: CountingStore, key: str) -> int:
    """A counter ``add`` keeps, read without creating it (``add(key, 0)`` would: a reader
    after the run's removal would bring a key of it back)."""
    raw = read_key(store, key)
    return 0 if raw is None else int(raw)


def announce_write(store: CountingStore) -> int:
    """Count a state write that just succeeded and wake the waiters; the new count."""
    count = store.add(STATE_SEQ, 1)
    store.set(f"{CHANGED}{count}", b"")
    if count > CHANGED_KEPT:
        store.delete_key(f"{CHANGED}{count - CHANGED_KEPT}")
    return count


class WriteFeed:
    """The count of the run's state writes (or of another ``counter`` whose every step
    creates ``marker<count>``), as a store connection of its own learns it: it blocks in
    ``TCPStore.wait`` on the key the next write creates, so a node waiting in an open round
    costs the store no request until the state changes (it read the count 20 times a
    second before). c10d logs a warning when a wait times out, so one wait lasts
    ``WAIT_S``; a caller whose wait ends reads the count once itself, so a change the
    feed missed is late by at most one of its waits, never lost.

    No feed may still be waiting when the interpreter exits: a C++ wait that returns into
    a finalizing interpreter aborts the process (``terminate called without an active
    exception``). ``close``, and at exit every feed still open, wake the thread through
    another connection (``poke``) and join it."""

    WAIT_S = 3600.0
    JOIN_S = 2.0

    def __init__(self, connect: Callable[[], CountingStore], poke: CountingStore,
                 counter: str = STATE_SEQ, marker: str = CHANGED) -> None:
        self._connect = connect
        self._poke = poke
        self._counter, self._marker = counter, marker
        self._changed = threading.Condition()
        self._count: int | None = None
        self._broken = False
        self._stop = threading.Event()
        self._listeners: list[Callable[[], None]] = []
        self._thread = threading.Thread(target=self._run, name="etcd-ext-state-wait",
                                        daemon=True)
        _OPEN.add(self)
        self._thread.start()

    def _run(self) -> None:
        try:
            store = self._connect()
            while not self._stop.is_set():
                count = read_count(store, self._counter)
                with self._changed:
                    moved, self._count = count != self._count, count
                    self._changed.notify_all()
                    listeners = list(self._listeners) if moved else []
                for listener in listeners:
                    listener()
                try:
                    store.wait([f"{self._marker}{count + 1}"], timedelta(seconds=self.WAIT_S))
                except DistStoreError as exc:
                    if "timeout" not in str(exc):
                        raise
        except Exception as exc:  # the store is gone: waiters return, their reads say so
            logger.debug("etcd-ext: waiting on the embedded store's state: %s", exc)
        finally:
            with self._changed:
                self._broken = True
                self._changed.notify_all()

    def add_listener(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (on the feed's thread) each time the count moves."""
        with self._changed:
            self._listeners.append(callback)

    def wait_past(self, count: int, timeout: float) -> bool:
        """True once a write after the ``count``-th is known, or the store broke; False
        after ``timeout`` seconds without either."""
        return self.wait_for(lambda known: known != count, timeout)

    def wait_for(self, done: Callable[[int], bool], timeout: float) -> bool:
        """True once the count is known and ``done`` with it, or the store broke; False
        after ``timeout`` seconds without either."""
        with self._changed:
            return self._changed.wait_for(
                lambda: self._broken or (self._count is not None and done(self._count)),
                timeout)

    def close(self) -> None:
        """Stop the thread: create the key it waits on and delete it again at once, until
        it is out (other agents' feeds waiting on that key wake, find the count unchanged
        and wait again; one that missed a write's key this way reads the count itself at
        its caller's next timeout)."""
        _OPEN.discard(self)
        self._stop.set()
        deadline = time.monotonic() + self.JOIN_S
        while self._thread.is_alive() and time.monotonic() < deadline:
            with self._changed:
                count = self._count  # the thread waits on the key of the write after it
            if count is not None:
                key = f"{self._marker}{count + 1}"
                try:
                    self._poke.set(key, b"")
                    self._poke.delete_key(key)
                except Exception as exc:  # the store is gone, and with it the wait
                    logger.debug("etcd-ext: waking the state wait: %s", exc)
            self._thread.join(0.1)
        if self._thread.is_alive():
            logger.warning("etcd-ext: the wait on the embedded store's state did not end "
                           "within %.0fs of closing", self.JOIN_S)


class SharedWriteFeed:
    """The ``WriteFeed`` of a backend and its clones (the keeper's), started when first
    needed: one waiting connection per agent, not one per thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._feed: WriteFeed | None = None

    def get(self, connect: Callable[[], CountingStore], poke: CountingStore) -> WriteFeed:
        with self._lock:
            if self._feed is None:
                self._feed = WriteFeed(connect, poke)
            return self._feed

    def close(self) -> None:
        with self._lock:
            feed, self._feed = self._feed, None
        if feed is not None:
            feed.close()


_OPEN: weakref.WeakSet[WriteFeed] = weakref.WeakSet()


@atexit.register
def _close_open_feeds() -> None:
    for feed in list(_OPEN):
        feed.close()
