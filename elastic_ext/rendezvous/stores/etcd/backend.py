"""The run's state on etcd through the v3 API.

Layout under ``<key_prefix>/<run_id>/``: ``state`` (written by compare-and-swap on
``mod_revision``), ``head`` (what most agents read of it, in the same transaction:
``head.py``), ``seat/<generation>/<round>/<node>`` (written before a round closes),
``hb/<node>`` (heartbeats, on the agent's lease: ``etcd/lease.py``), ``join/<generation>/
<round>/<node>``, ``verdict`` and ``store/<generation>/<round>/`` (torch's round store).
Waits are watches (``etcd/watch.py``): of the head (a few hundred bytes where the state is
29 KB at 1,024 nodes) and of the verdict. A keeper's tick is one transaction, none when
woken early, or with ``heartbeat_mode=lease`` none at all: the lease renews itself.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from datetime import timedelta
from typing import Any, TypeVar

from torch.distributed import Store

from elastic_ext.rendezvous.errors import StoreUnavailableError
from elastic_ext.rendezvous.protocol.clock import Clock
from elastic_ext.rendezvous.protocol.liveness import LEFT
from elastic_ext.rendezvous.protocol.pace import Pace
from elastic_ext.rendezvous.settings import Settings
from elastic_ext.rendezvous.stores.contract import KeeperRead, StoreBackend, Token
from elastic_ext.rendezvous.stores.etcd.client import EtcdClient
from elastic_ext.rendezvous.stores.etcd.lease import EXPIRY_CHECK_S, AgentLease, lease_ttl
from elastic_ext.rendezvous.stores.etcd.round_store import EtcdV3Store
from elastic_ext.rendezvous.stores.etcd.watch import SharedFeeds, WatchedKeys
from elastic_ext.rendezvous.stores.etcd.wire import (
    KeyValue,
    batches,
    op_delete,
    op_put,
    op_range,
    range_reply,
)
from elastic_ext.rendezvous.stores.wire import (
    HEAD_KEY,
    SEAT_DIR,
    STATE_KEY,
    head_and_seats,
    unwrap_state,
    wrap_state,
)

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


class EtcdBackend(StoreBackend):
    """The run's keys on an etcd cluster; see :class:`StoreBackend` for the contract."""

    FEED_CATCH_UP_S = 0.2
    """How long ``head_after`` waits for the watch to deliver a revision a read has seen."""

    def __init__(self, settings: Settings, client: EtcdClient | None = None,
                 lease: AgentLease | None = None, feeds: SharedFeeds | None = None) -> None:
        self._settings = settings
        self._client = client or EtcdClient(settings)
        self._prefix = settings.run_prefix
        self._state_key = self._prefix + STATE_KEY
        self._head_key = self._prefix + HEAD_KEY
        self._hb_prefix = self._prefix + "hb/"
        self._leased = settings.heartbeat_mode == "lease"
        self._lease = lease or AgentLease(
            self._client, self._hb_prefix, lease_ttl(settings.timeouts.heartbeat,
                                                      is_heartbeat=self._leased),
            settings.timeouts.heartbeat)
        self._feeds = feeds or SharedFeeds()  # started when first read; clones share them
        self._owns_feeds = feeds is None
        self._whole: tuple[bytes, int] | None = None  # the state this backend read last
        self._seated = b""  # the first seat of the last round whose seats it wrote
        self._beats_read: dict[str, bytes | None] | None = None  # by the last keeper_read

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
        slowest = backend._lease.ttl + EXPIRY_CHECK_S
        if backend._leased and settings.timeouts.heartbeat < slowest:
            logger.warning("etcd-ext: heartbeat_timeout=%g is shorter than etcd's leases can "
                           "tell (a TTL of at least 2 s, expired within 0.5 s): a frozen node "
                           "is found after up to %g s", settings.timeouts.heartbeat, slowest)
        return backend

    @property
    def keeps_heads(self) -> bool:
        return True

    def _head_feed(self) -> WatchedKeys:
        return self._feeds.head_feed(self._client, self._head_key)

    def get_state(self) -> tuple[bytes, Token] | None:
        """The state's version first (a keys-only read): the state itself (29 KB at 1,024
        nodes) only when it changed since this backend last read it."""
        if self._whole is not None and self.state_version() == self._whole[1]:
            return self._whole
        return self.read_whole_state()

    def read_whole_state(self) -> tuple[bytes, Token] | None:
        """``get_state`` by reading the value itself."""
        kv = self._client.get(self._state_key)
        if kv is None:
            return None
        self._whole = (unwrap_state(kv.value), kv.mod_revision)
        return self._whole

    def set_state(self, state: bytes, token: Token | None = None
                  ) -> tuple[bytes, Token, bool] | None:
        """The head in the same transaction; a closed round's seats before it."""
        if token is not None and (not isinstance(token, int) or isinstance(token, bool)):
            current = self.get_state()
            return None if current is None else (*current, False)
        head, seats = head_and_seats(state)
        self._write_seats(seats)
        ok, kv = self._client.compare_and_swap(self._state_key, wrap_state(state), token or None,
                                               also=[op_put(self._head_key, head or b"")])
        if ok and kv is not None:
            self._whole = (state, kv.mod_revision)
            return state, kv.mod_revision, True
        if kv is None:  # deleted between our compare and our read
            return None
        self._whole = (unwrap_state(kv.value), kv.mod_revision)
        return (*self._whole, False)

    def _write_seats(self, seats: dict[str, bytes]) -> None:
        """A closed round's seats, 128 to a transaction, unless they are there already (a
        later write of the same round: its progress, a notice)."""
        if not seats:
            return
        first_key, first = next(iter(seats.items()))
        if first == self._seated:
            return
        kv = self._client.get(self._prefix + SEAT_DIR + first_key)
        if kv is None or kv.value != first:
            for batch in batches(list(seats.items())):
                self._client.txn([op_put(self._prefix + SEAT_DIR + name, seat)
                                  for name, seat in batch])
        self._seated = first

    def state_version(self) -> object | None:
        return self._client.revision_of(self._state_key)

    def wait_for_state(self, token: Token | None, timeout: float, clock: Clock
                       ) -> bool | tuple[bytes, Token]:
        """Answered from this backend's watch of the head (``WatchedKeys``), which moves
        with the state: no request, and never the state itself."""
        after = token if isinstance(token, int) and not isinstance(token, bool) else None
        change = self._head_feed().wait_past(after, timeout)
        if change is None:
            return False
        return change[1] is not None or after is not None

    def on_state_change(self, callback: Callable[[], None]) -> None:
        """Also at each verdict the watcher writes: a death it judged reaches every keeper
        at once, not at its next beat (``heartbeat_interval``, 1 s on etcd)."""
        self._head_feed().add_listener(callback)
        self._verdict_feed().add_listener(callback)

    def _verdict_feed(self) -> WatchedKeys:
        return self._feeds.verdict_feed(self._client, self._prefix + "verdict")

    def state_after(self, version: object | None) -> tuple[bytes, Token] | None:
        """The state this backend read last if it is that version, else read anew."""
        if self._whole is not None and version == self._whole[1]:
            return self._whole
        return self.read_whole_state()

    def head_after(self, version: object | None) -> tuple[bytes, Token] | None:
        """From the watch of the head the handler keeps (the keeper's clone shares it):
        each head reaches an agent once. Derived from the state only when there is no head
        (bytes that are no state were stored: the head is empty) or the watch lags."""
        if isinstance(version, int) and not isinstance(version, bool):
            change = self._head_feed().wait_past(version - 1, self.FEED_CATCH_UP_S)
        else:
            change = self._head_feed().wait_past(None, self._settings.timeouts.connect)
        if change is not None and change[1] is not None and change[1].value:
            return change[1].value, change[0]
        return super().head_after(version)

    def read_seat(self, generation: str, round_: int, node: str) -> bytes | None:
        kv = self._client.get(f"{self._prefix}{SEAT_DIR}{generation}/{round_}/{node}")
        return None if kv is None else kv.value

    def read_seats(self, generation: str, round_: int) -> list[tuple[str, bytes]]:
        prefix = f"{self._prefix}{SEAT_DIR}{generation}/{round_}/"
        return [(kv.key.decode()[len(prefix):], kv.value)
                for kv in self._client.get_prefix(prefix)]

    def _join_prefix(self, generation: str, round_: int) -> str:
        return f"{self._prefix}join/{generation}/{round_}/"

    def join(self, generation: str, round_: int, node: str, entry: bytes) -> int:
        prefix = self._join_prefix(generation, round_)
        replies = self._client.txn([op_put(prefix + node, entry),
                                    op_range(prefix, prefix=True, count_only=True)])
        return range_reply(replies[1])[1]

    def count_joins(self, generation: str, round_: int) -> int:
        """From the watch of the round's joins while this agent keeps one (the closer)."""
        prefix = self._join_prefix(generation, round_)
        watched = self._watched_joins(prefix)
        if watched is not None:
            return len(watched)
        replies = self._client.txn([op_range(prefix, prefix=True, count_only=True)])
        return range_reply(replies[0])[1]

    def _watched_joins(self, prefix: str) -> dict[bytes, KeyValue] | None:
        """The round's join keys from this agent's watch of them; None without a current
        one."""
        feed = self._feeds.joins_of(prefix)
        return feed.keys_now() if feed is not None else None

    def wait_for_joins(self, generation: str, round_: int, at_least: int, timeout: float,
                       clock: Clock) -> bool:
        """A watch of the round's join keys (one per agent: the round it closes), which
        ``count_joins`` and ``read_joins`` answer from while it lasts: each join reaches
        the closer once, and its waits and reads cost no request."""
        feed = self._feeds.joins_feed(self._client, self._join_prefix(generation, round_))
        return feed.wait_until(lambda keys: len(keys) >= at_least, timeout)

    def read_joins(self, generation: str, round_: int) -> list[tuple[str, bytes]]:
        prefix = self._join_prefix(generation, round_)
        watched = self._watched_joins(prefix)
        kvs = sorted(self._client.get_prefix(prefix) if watched is None else watched.values(),
                     key=lambda kv: kv.create_revision)
        return [(kv.key.decode()[len(prefix):], kv.value) for kv in kvs]

    def drop_joins(self, generation: str, round_: int, nodes: Iterable[str]) -> None:
        prefix = self._join_prefix(generation, round_)
        dropped = sorted(nodes)
        for batch in batches(dropped):  # a thousand dead at once need several
            self._client.txn([op_delete(prefix + node) for node in batch])
        feed = self._feeds.joins_of(prefix)
        if feed is not None:  # reads from it after this one lack them
            gone = [(prefix + node).encode() for node in dropped]
            feed.wait_until(lambda keys: not any(key in keys for key in gone),
                            self.FEED_CATCH_UP_S)

    @property
    def heartbeats_expire(self) -> bool:  # with ``heartbeat_mode=lease``
        return self._leased

    def write_verdict(self, verdict: bytes) -> None:
        """One put: every agent watches the verdict (``keeper_read``)."""
        self._client.put(self._prefix + "verdict", verdict)

    def read_verdict(self) -> bytes | None:
        kv = self._client.get(self._prefix + "verdict")
        return None if kv is None else kv.value

    def keeper_read(self, node: str, presence_port: int | None, watched: Sequence[str],
                    due: bool = True, pace: Pace | None = None) -> KeeperRead:
        """One transaction: the beat and the watched heartbeats (one range over all when
        many are watched); the version and the verdict by watches. A tick not ``due`` (every
        keeper woken by a state write or a verdict) sends nothing, reusing the heartbeats
        last read. With ``heartbeat_mode=lease`` no request at most ticks (``_watched_read``)."""
        if self._leased:
            return self._watched_read(node, presence_port, watched, pace)
        last = self._beats_read
        if not due and last is not None and set(watched) <= last.keys():
            version, verdict = self._watched()
            return KeeperRead(version, {n: last[n] for n in watched}, verdict)
        hb = self._hb_prefix
        reads = [op_range(hb, prefix=True)] if len(watched) > 8 else \
            [op_range(hb + n) for n in watched]

        def beat_and_read() -> list[dict[str, Any]]:
            self._lease.ensure(node, presence_port, put_beat=False, pace=pace)
            with self._lease.lock:
                beat = self._lease.beat_ops()
            replies = self._client.txn([*beat, *reads])
            return replies[len(beat):]
        replies = self._lease.retry(beat_and_read)
        found = {kv.key.decode()[len(hb):]: kv.value
                 for reply in replies for kv in range_reply(reply)[0]}
        version, verdict = self._watched()
        self._beats_read = {n: found.get(n) for n in watched}
        return KeeperRead(version, dict(self._beats_read), verdict)

    def _watched(self) -> tuple[object | None, bytes | None]:
        """The state's version (its head's) and the verdict as their watches last had
        them, read only before a watch's first read: a tick waiting on a watch opened anew
        held keepers past their heartbeat timeout (1,024 agents, a loaded etcd)."""
        head = self._head_feed().wait_past(None, 0.0)
        version = self.state_version() if head is None else \
            head[0] if head[1] is not None else None
        keys = self._verdict_feed().keys_known()
        if keys is None:
            return version, self.read_verdict()
        verdict = keys.get((self._prefix + "verdict").encode())
        return version, None if verdict is None else verdict.value

    def _watched_read(self, node: str, presence_port: int | None,
                      watched: Sequence[str], pace: Pace | None) -> KeeperRead:
        """``heartbeat_mode=lease``: no request at most ticks (the lease renews itself): the
        state's version, the verdict and the heartbeats from watches (of the one key
        watched, or of all of them when more are); the value put anew when the pace moved."""
        self._lease.retry(lambda: self._lease.ensure(node, presence_port, True, pace))
        timeout = self._settings.timeouts.connect
        one = len(watched) == 1
        beats: dict[str, bytes | None] = {}
        if watched:
            feed = self._feeds.beats_feed(
                self._client, self._hb_prefix + watched[0] if one else self._hb_prefix,
                prefix=not one)
            keys = feed.current(timeout)
            beats = {n: kv.value if (kv := keys.get((self._hb_prefix + n).encode())) else None
                     for n in watched}
        version, verdict = self._watched()
        return KeeperRead(version, beats, verdict)

    def beat(self, node: str, presence_port: int | None = None, pace: Pace | None = None) -> None:
        def put() -> None:
            if self._lease.ensure(node, presence_port, put_beat=False, pace=pace) is None:
                return
            with self._lease.lock:
                beat = self._lease.beat_ops()
                if beat:
                    self._client.txn(beat)
        self._lease.retry(put)

    def remove_run(self) -> None:
        self._client.delete_prefix(self._prefix)

    def leave(self, node: str) -> None:
        """Revokes the lease first: a heartbeat still on its way (a keeper thread that
        outlived its stop) then fails on the missing lease instead of landing after LEFT,
        where the last node out would read this node as still there and keep the run's
        keys. The revoke deletes the heartbeat key, so until LEFT is written the others
        read this node as gone, and the last of them may remove the run meanwhile: LEFT is
        written only while the run's state exists, never bringing back a removed run."""
        lease = self._lease.end()
        if lease is not None:
            try:
                self._client.lease_revoke(lease)
            except StoreUnavailableError as exc:
                if "lease not found" not in str(exc):
                    raise
        self._client.put_if_exists(self._hb_prefix + node, LEFT, guard=self._state_key)

    def read_beats(self, nodes: Iterable[str]) -> dict[str, bytes | None]:
        hb_prefix = self._hb_prefix
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
        """Also the join keys and seats of those rounds."""
        for kind in ("store/", "join/", SEAT_DIR):
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
        if self._owns_feeds:
            self._feeds.close()
            self._lease.stop()

    def clone(self) -> EtcdBackend:
        # the client is thread-safe; the lease and the state watch are the agent's
        return EtcdBackend(self._settings, self._client, self._lease, self._feeds)
