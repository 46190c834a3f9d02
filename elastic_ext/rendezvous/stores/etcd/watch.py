"""The run's keys as etcd's watches deliver them: reading them costs no request.

One stream per watch, through the gateway (``EtcdClient.watch``); each agent holds the
run's head (which moves with its state) and the watcher's verdict, the heartbeat keys its
keeper watches with ``heartbeat_mode=lease``, and the closer of an open round one of the round's
join keys (``stores/etcd/backend.py``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from elastic_ext.rendezvous.errors import StoreUnavailableError
from elastic_ext.rendezvous.stores.contract import STATE_POLL_S
from elastic_ext.rendezvous.stores.etcd.client import EtcdClient
from elastic_ext.rendezvous.stores.etcd.wire import KeyValue

logger = logging.getLogger(__name__)


class WatchedKeys:
    """One key, or the keys under a prefix, as one etcd watch delivers them for the life
    of the backend: reading them costs no request, and each change reaches the agent once,
    with its value. ``latest`` is the newest change (a single key: its ``mod_revision``, or
    the revision of its deletion)."""

    IDLE_S = 30.0  # a stream silent this long is opened anew (a half-open connection)

    def __init__(self, client: EtcdClient, key: str, *, prefix: bool = False) -> None:
        self.key, self.prefix = key, prefix
        self._client = client
        self._changed = threading.Condition()
        self._latest: tuple[int, KeyValue | None] | None = None  # (revision, key or None)
        self._keys: dict[bytes, KeyValue] = {}
        self._current = False  # read and watched now: False before that and after a break
        self._stop = threading.Event()
        self._listeners: list[Callable[[], None]] = []
        threading.Thread(target=self._run, name="etcd-ext-watch", daemon=True).start()

    def add_listener(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (on the watch's thread) after each change delivered."""
        with self._changed:
            self._listeners.append(callback)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                kvs, revision = self._client.read_range(self.key, prefix=self.prefix)
                with self._changed:
                    self._keys = {kv.key: kv for kv in kvs}
                    self._current = True
                single = kvs[0] if kvs and not self.prefix else None
                self._publish(single.mod_revision if single else revision, None, single)
                for change in self._client.watch(self.key, revision + 1, self.IDLE_S,
                                                 self._stop, prefix=self.prefix):
                    self._publish(*change)
            except Exception as exc:  # etcd down or moving: read it again in a moment
                logger.debug("etcd-ext: watch of %s: %s", self.key, exc)
                with self._changed:
                    self._current = False
                self._stop.wait(STATE_POLL_S)

    def _publish(self, revision: int, key: bytes | None, kv: KeyValue | None) -> None:
        with self._changed:
            if key is not None:
                if kv is None:
                    self._keys.pop(key, None)
                else:
                    self._keys[key] = kv
            if self._latest is None or revision >= self._latest[0]:
                self._latest = (revision, kv)
            self._changed.notify_all()
            listeners = list(self._listeners)
        for listener in listeners:
            listener()

    def wait_past(self, revision: int | None, timeout: float
                  ) -> tuple[int, KeyValue | None] | None:
        """The latest change after ``revision`` (None: whatever is known), waiting up to
        ``timeout`` seconds for one; None if none came."""
        with self._changed:
            if self._changed.wait_for(lambda: self._latest is not None and (
                    revision is None or self._latest[0] > revision), timeout):
                return self._latest
            return None

    def current(self, timeout: float) -> dict[bytes, KeyValue]:
        """The keys as the watch has them, waiting up to ``timeout`` for a first read.

        Raises:
            StoreUnavailableError: the keys are not being watched (etcd unreachable): what
                we have may be stale.
        """
        with self._changed:
            if not self._changed.wait_for(lambda: self._current, timeout):
                raise StoreUnavailableError(f"no current watch of {self.key} within "
                                            f"{timeout:g}s")
            return dict(self._keys)

    def keys_known(self) -> dict[bytes, KeyValue] | None:
        """The keys as last read or delivered, current or not (a watch opened anew after a
        break is a moment behind); None before the first read."""
        with self._changed:
            return dict(self._keys) if self._latest is not None else None

    def keys_now(self) -> dict[bytes, KeyValue] | None:
        """The keys as the watch has them, or None while they are not being watched."""
        with self._changed:
            return dict(self._keys) if self._current else None

    def wait_until(self, done: Callable[[dict[bytes, KeyValue]], bool], timeout: float
                   ) -> bool:
        """Wait up to ``timeout`` seconds until the watched keys satisfy ``done`` (called
        under the watch's lock: keep it cheap); False if they did not (or were not being
        watched) by then."""
        with self._changed:
            return self._changed.wait_for(lambda: self._current and done(self._keys),
                                          timeout)

    def close(self) -> None:
        self._stop.set()


@dataclass
class SharedFeeds:
    """The watches of a backend and its clones (the keeper's), one of each per agent: the
    run's head, and the heartbeat keys the keeper watches."""

    head: WatchedKeys | None = None  # the state's head (``head.py``), which moves with it
    beats: WatchedKeys | None = None
    joins: WatchedKeys | None = None  # the join keys of the open round this agent closes
    verdict: WatchedKeys | None = None  # the watcher's verdict (``keeper``)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def head_feed(self, client: EtcdClient, key: str) -> WatchedKeys:
        with self.lock:
            if self.head is None:
                self.head = WatchedKeys(client, key)
            return self.head

    def verdict_feed(self, client: EtcdClient, key: str) -> WatchedKeys:
        with self.lock:
            if self.verdict is None:
                self.verdict = WatchedKeys(client, key)
            return self.verdict

    def beats_feed(self, client: EtcdClient, key: str, prefix: bool) -> WatchedKeys:
        """The watch of ``key`` (or every key under it), replacing a watch of other keys."""
        with self.lock:
            self.beats = _replaced(self.beats, client, key, prefix)
            return self.beats

    def joins_feed(self, client: EtcdClient, prefix: str) -> WatchedKeys:
        """The watch of the keys under ``prefix`` (a round's joins), replacing the watch
        of another round's."""
        with self.lock:
            self.joins = _replaced(self.joins, client, prefix, True)
            return self.joins

    def joins_of(self, prefix: str) -> WatchedKeys | None:
        """The watch of the keys under ``prefix``, if this agent keeps one (never opens it)."""
        with self.lock:
            return self.joins if self.joins is not None and self.joins.key == prefix else None

    def close(self) -> None:
        with self.lock:
            for feed in (self.head, self.beats, self.joins, self.verdict):
                if feed is not None:
                    feed.close()
            self.head = self.beats = self.joins = self.verdict = None


def _replaced(feed: WatchedKeys | None, client: EtcdClient, key: str, prefix: bool
              ) -> WatchedKeys:
    """``feed`` if it watches ``key`` (``prefix``: the keys under it), else a new watch of
    them, the old one closed."""
    if feed is not None and (feed.key, feed.prefix) == (key, prefix):
        return feed
    if feed is not None:
        feed.close()
    return WatchedKeys(client, key, prefix=prefix)
