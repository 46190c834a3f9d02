"""The run's state on etcd through the v3 API.

Layout under ``<key_prefix>/<run_id>/``: ``state`` (the JSON state, written by
compare-and-swap on ``mod_revision``, create-if-absent the first time), ``hb/<node>``
(heartbeat counters, on each agent's lease so they expire), ``join/<generation>/<round>/
<node>`` (join keys, ordered by their create revision), ``verdict`` and
``store/<generation>/<round>/`` (the round's c10d store for torch's agent). A keeper's
tick is one transaction; waiting for the state is a watch.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, TypeVar

from torch.distributed import Store

from elastic_ext.rendezvous.backend import (
    STATE_KEY,
    STATE_POLL_S,
    KeeperRead,
    StoreBackend,
    Token,
    heartbeat_value,
    unwrap_state,
    wrap_state,
)
from elastic_ext.rendezvous.clock import Clock
from elastic_ext.rendezvous.errors import StoreUnavailableError
from elastic_ext.rendezvous.etcd_client import (
    EtcdClient,
    KeyValue,
    op_delete,
    op_put,
    op_range,
    range_reply,
)
from elastic_ext.rendezvous.etcd_store import EtcdV3Store
from elastic_ext.rendezvous.liveness import LEFT
from elastic_ext.rendezvous.settings import Settings

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


@dataclass
class _SharedFeed:
    """The state watch of a backend and its clones (the keeper's): one stream per agent."""

    feed: _StateFeed | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def get(self, client: EtcdClient, key: str) -> _StateFeed:
        with self.lock:
            if self.feed is None:
                self.feed = _StateFeed(client, key)
            return self.feed

    def close(self) -> None:
        with self.lock:
            if self.feed is not None:
                self.feed.close()
                self.feed = None


@dataclass
class _Lease:
    """The agent's etcd lease, shared by its backend and the backend's clones."""

    ttl: int
    id: int | None = None
    refreshed: float = 0.0
    left: bool = False  # the agent left the run: no heartbeat may follow its LEFT marker
    lock: threading.Lock = field(default_factory=threading.Lock)


class _StateFeed:
    """The run's state as one etcd watch delivers it, for the life of the backend: waiting
    for the state costs no request, and each change reaches each agent once, with its
    value."""

    IDLE_S = 30.0  # a stream silent this long is opened anew (a half-open connection)

    def __init__(self, client: EtcdClient, key: str) -> None:
        self._client = client
        self._key = key
        self._changed = threading.Condition()
        self._latest: tuple[int, KeyValue | None] | None = None  # (revision, key or None)
        self._stop = threading.Event()
        threading.Thread(target=self._run, name="etcd-ext-state-watch", daemon=True).start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                kv, revision = self._client.get_with_revision(self._key)
                self._publish(kv.mod_revision if kv else revision, kv)
                for change in self._client.watch(self._key, revision + 1, self.IDLE_S,
                                                 self._stop):
                    self._publish(*change)
            except Exception as exc:  # etcd down or moving: read it again in a moment
                logger.debug("etcd-ext: state watch: %s", exc)
                self._stop.wait(STATE_POLL_S)

    def _publish(self, revision: int, kv: KeyValue | None) -> None:
        with self._changed:
            if self._latest is None or revision >= self._latest[0]:
                self._latest = (revision, kv)
                self._changed.notify_all()

    def wait_past(self, revision: int | None, timeout: float
                  ) -> tuple[int, KeyValue | None] | None:
        """The latest change after ``revision`` (None: whatever is known), waiting up to
        ``timeout`` seconds for one; None if none came."""
        with self._changed:
            if self._changed.wait_for(lambda: self._latest is not None and (
                    revision is None or self._latest[0] > revision), timeout):
                return self._latest
            return None

    def close(self) -> None:
        self._stop.set()


class EtcdBackend(StoreBackend):
    """The run's keys on an etcd cluster; see :class:`StoreBackend` for the contract."""

    FEED_CATCH_UP_S = 0.2
    """How long ``state_after`` waits for the watch to deliver a revision a read has seen
    before it reads the state itself."""

    def __init__(self, settings: Settings, client: EtcdClient | None = None,
                 lease: _Lease | None = None, feed: _SharedFeed | None = None) -> None:
        self._settings = settings
        self._client = client or EtcdClient(settings)
        self._prefix = settings.run_prefix
        self._state_key = self._prefix + STATE_KEY
        self._lease = lease or _Lease(ttl=max(10, math.ceil(4 * settings.timeouts.heartbeat)))
        self._beats = 0
        self._feed = feed or _SharedFeed()  # started by the first wait; clones share it
        self._owns_feed = feed is None

    @property
    def name(self) -> str:
        return "etcd-v3"

    @classmethod
    def connect(cls, settings: Settings) -> EtcdBackend:
        """A backend on an etcd that answered as etcd >= 3.4 serving the v3 gateway.

        Raises:
            StoreUnavailableError: no endpoint answered like etcd.
            StoreAuthError: the TLS handshake failed.
            ConfigError: the server is older than etcd 3.4.
        """
        backend = cls(settings)
        version = backend._client.server_version()
        logger.info("etcd-ext: etcd %s at %s", version, settings.describe_endpoints())
        return backend

    def get_state(self) -> tuple[bytes, Token] | None:
        kv = self._client.get(self._state_key)
        if kv is None:
            return None
        return unwrap_state(kv.value), kv.mod_revision

    def set_state(self, state: bytes, token: Token | None = None
                  ) -> tuple[bytes, Token, bool] | None:
        if token is not None and (not isinstance(token, int) or isinstance(token, bool)):
            current = self.get_state()
            return None if current is None else (*current, False)
        ok, kv = self._client.compare_and_swap(self._state_key, wrap_state(state), token or None)
        if ok and kv is not None:
            return state, kv.mod_revision, True
        if kv is None:  # deleted between our compare and our read
            return None
        return unwrap_state(kv.value), kv.mod_revision, False

    def state_version(self) -> object | None:
        return self._client.revision_of(self._state_key)

    def wait_for_state(self, token: Token | None, timeout: float, clock: Clock
                       ) -> bool | tuple[bytes, Token]:
        """Answered from this backend's watch of the state (``_StateFeed``): no request."""
        after = token if isinstance(token, int) and not isinstance(token, bool) else None
        change = self._feed.get(self._client, self._state_key).wait_past(after, timeout)
        if change is None:
            return False
        revision, kv = change
        if kv is None:
            return after is not None  # deleted (or still absent: nothing new)
        return unwrap_state(kv.value), revision

    def state_after(self, version: object | None) -> tuple[bytes, Token] | None:
        """From the watch of the state the handler keeps (the keeper's clone shares it):
        each version of the state reaches an agent once, not once more for its keeper."""
        if isinstance(version, int) and not isinstance(version, bool):
            feed = self._feed.get(self._client, self._state_key)
            change = feed.wait_past(version - 1, self.FEED_CATCH_UP_S)
            if change is not None and change[1] is not None:
                return unwrap_state(change[1].value), change[0]
        return self.get_state()

    def _join_prefix(self, generation: str, round_: int) -> str:
        return f"{self._prefix}join/{generation}/{round_}/"

    def join(self, generation: str, round_: int, node: str, entry: bytes) -> int:
        prefix = self._join_prefix(generation, round_)
        replies = self._client.txn([op_put(prefix + node, entry),
                                    op_range(prefix, prefix=True, count_only=True)])
        return range_reply(replies[1])[1]

    def count_joins(self, generation: str, round_: int) -> int:
        replies = self._client.txn([op_range(self._join_prefix(generation, round_), prefix=True,
                                             count_only=True)])
        return range_reply(replies[0])[1]

    def read_joins(self, generation: str, round_: int) -> list[tuple[str, bytes]]:
        prefix = self._join_prefix(generation, round_)
        kvs = sorted(self._client.get_prefix(prefix), key=lambda kv: kv.create_revision)
        return [(kv.key.decode()[len(prefix):], kv.value) for kv in kvs]

    def drop_joins(self, generation: str, round_: int, nodes: Iterable[str]) -> None:
        prefix = self._join_prefix(generation, round_)
        self._client.txn([op_delete(prefix + node) for node in nodes])

    def write_verdict(self, verdict: bytes) -> None:
        self._client.put(self._prefix + "verdict", verdict)

    def read_verdict(self) -> bytes | None:
        kv = self._client.get(self._prefix + "verdict")
        return None if kv is None else kv.value

    def keeper_read(self, node: str, presence_port: int | None,
                    watched: Sequence[str]) -> KeeperRead:
        # One transaction: the beat, the state's revision, the verdict and the heartbeats
        # (a range over all of them when many are watched, else one read each).
        self._beats += 1
        value = heartbeat_value(self._beats, presence_port)
        hb_prefix = f"{self._prefix}hb/"
        many = len(watched) > 8
        reads = [op_range(hb_prefix, prefix=True)] if many else \
            [op_range(hb_prefix + n) for n in watched]

        def beat_and_read() -> list[dict[str, Any]]:
            lease = self._current_lease()
            beat = [] if lease is None else [op_put(hb_prefix + node, value, lease=lease)]
            replies = self._client.txn([*beat, op_range(self._state_key, keys_only=True),
                                        op_range(self._prefix + "verdict"), *reads])
            return replies[len(beat):]
        replies = self._lease_retry(beat_and_read)
        state_kvs, _ = range_reply(replies[0])
        verdict_kvs, _ = range_reply(replies[1])
        found = {kv.key.decode()[len(hb_prefix):]: kv.value
                 for reply in replies[2:] for kv in range_reply(reply)[0]}
        return KeeperRead(state_kvs[0].mod_revision if state_kvs else None,
                          {n: found.get(n) for n in watched},
                          verdict_kvs[0].value if verdict_kvs else None)

    def beat(self, node: str, presence_port: int | None = None) -> None:
        self._beats += 1
        value = heartbeat_value(self._beats, presence_port)

        def put() -> None:
            lease = self._current_lease()
            if lease is not None:
                self._client.put(f"{self._prefix}hb/{node}", value, lease=lease)
        self._lease_retry(put)

    def _current_lease(self) -> int | None:
        """This agent's lease, kept alive: heartbeat keys hang on it, so a dead agent's
        key disappears. One per agent: the backend's clones share it. None once the agent
        left: its heartbeat is over."""
        lease = self._lease
        with lease.lock:
            if lease.left:
                return None
            now = time.monotonic()
            if lease.id is None:
                lease.id = self._client.lease_grant(lease.ttl)
                lease.refreshed = now
            elif now - lease.refreshed > lease.ttl / 3:
                self._client.lease_keepalive(lease.id)
                lease.refreshed = now
            return lease.id

    def _lease_retry(self, write: Callable[[], _T]) -> _T:
        try:
            return write()
        except StoreUnavailableError as exc:
            if "lease not found" not in str(exc):
                raise
            with self._lease.lock:
                self._lease.id = None  # expired while etcd was out of reach, or revoked
            return write()           # on leaving (then the write beats no more)

    def remove_run(self) -> None:
        self._client.delete_prefix(self._prefix)

    def leave(self, node: str) -> None:
        """Revokes the lease first: a heartbeat still on its way (a keeper thread that
        outlived its stop) then fails on the missing lease instead of landing after LEFT,
        where the last node out would read this node as still there and keep the run's
        keys. The revoke deletes the heartbeat key, so until LEFT is written the others
        read this node as gone, and the last of them may remove the run meanwhile: LEFT is
        written only while the run's state exists, never bringing back a removed run."""
        with self._lease.lock:
            self._lease.left = True
            lease, self._lease.id = self._lease.id, None
        if lease is not None:
            try:
                self._client.lease_revoke(lease)
            except StoreUnavailableError as exc:
                if "lease not found" not in str(exc):
                    raise
        self._client.put_if_exists(f"{self._prefix}hb/{node}", LEFT, guard=self._state_key)

    def read_beats(self, nodes: Iterable[str]) -> dict[str, bytes | None]:
        hb_prefix = f"{self._prefix}hb/"
        nodes = list(nodes)
        if len(nodes) <= 8:  # a few keys: read those, not every node's
            values = self._client.multi_get([hb_prefix + n for n in nodes])
            return {n: None if kv is None else kv.value
                    for n, kv in zip(nodes, values, strict=True)}
        found = {kv.key.decode()[len(hb_prefix):]: kv.value
                 for kv in self._client.get_prefix(hb_prefix)}
        return {node: found.get(node) for node in nodes}

    def round_store(self, generation: str, round_: int) -> Store:
        return EtcdV3Store(self._client, f"{self._prefix}store/{generation}/{round_}/",
                           timeout=timedelta(seconds=max(60.0, self._settings.timeouts.join)))

    def drop_round_stores(self, generation: str, keep_from_round: int) -> None:
        """Also the join keys of those rounds."""
        for kind in ("store/", "join/"):
            prefix = f"{self._prefix}{kind}"
            stale: set[tuple[str, str]] = set()
            for kv in self._client.get_prefix(prefix):
                parts = kv.key.decode()[len(prefix):].split("/")
                if len(parts) >= 2:
                    stale.add((parts[0], parts[1]))
            for gen, round_text in stale:
                if gen != generation or (round_text.isdigit()
                                         and int(round_text) < keep_from_round):
                    self._client.delete_prefix(f"{prefix}{gen}/{round_text}/")

    def list_runs(self) -> list[str]:
        prefix = self._settings.key_prefix.rstrip("/") + "/"
        return sorted({kv.key.decode()[len(prefix):].split("/", 1)[0]
                       for kv in self._client.get_prefix(prefix)})

    def close(self) -> None:
        if self._owns_feed:
            self._feed.close()

    def clone(self) -> EtcdBackend:
        # the client is thread-safe; the lease and the state watch are the agent's
        return EtcdBackend(self._settings, self._client, self._lease, self._feed)
