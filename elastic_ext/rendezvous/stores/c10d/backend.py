"""The run's state on an embedded c10d TCPStore, for machines with no etcd.

The node whose address matches the one endpoint (``c10d://host:port``) hosts the store
inside its agent; the others connect to it. That host is a single point of failure:
when its agent dies the store dies with it, the other agents' next store operation
fails at once, and they exit. A store that survives a node is etcd's job (a 3-member
cluster); the embedded store takes exactly one endpoint (``settings.py``).

A node waiting on the state costs the store no request: a connection of its own blocks in
``TCPStore.wait`` on the key the next state write creates (``c10d.feed.WriteFeed``), and the
closer of an open round waits on the key the next join creates the same way. Where torch's
TCPStore can list its keys (``list_keys``, torch >= 2.10) a closed round's join keys and
round store are deleted and ``elastic-ext list`` works; before, they lived as long as the
store.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Protocol, TypeVar, cast

from torch.distributed import PrefixStore, Store, TCPStore

from elastic_ext.rendezvous.errors import ConfigError, StoreUnavailableError
from elastic_ext.rendezvous.protocol.clock import Clock
from elastic_ext.rendezvous.protocol.liveness import LEFT
from elastic_ext.rendezvous.protocol.pace import Pace
from elastic_ext.rendezvous.protocol.state import RunState
from elastic_ext.rendezvous.settings import Settings
from elastic_ext.rendezvous.stores.c10d.feed import (
    STATE_SEQ,
    SharedWriteFeed,
    WriteFeed,
    announce_write,
    read_count,
    read_key,
)
from elastic_ext.rendezvous.stores.contract import StoreBackend, Token
from elastic_ext.rendezvous.stores.wire import STATE_KEY, heartbeat_value, unwrap_state, wrap_state
from elastic_ext.torch_compat import matches_machine_hostname

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

JOINED = "joined/"
"""``join/<generation>/<round>/joined/<n>``: created by the round's n-th join, after its
entry, to wake the closer (the entry's own key is never touched by the wake-up)."""

STORE_ERRORS = (RuntimeError, ValueError, TimeoutError)


class ByteStore(Protocol):
    """A c10d store as its binding really is: values are bytes (torch's stubs say ``str``)."""

    def set(self, key: str, value: bytes) -> None: ...
    def get(self, key: str) -> bytes: ...
    def check(self, keys: list[str]) -> bool: ...
    def compare_set(self, key: str, expected_value: bytes, desired_value: bytes) -> bytes: ...
    def multi_get(self, keys: list[str]) -> list[bytes]: ...
    def delete_key(self, key: str) -> bool: ...
    def add(self, key: str, amount: int) -> int: ...
    def wait(self, keys: list[str], timeout: timedelta) -> None: ...


def list_keys(store: TCPStore) -> list[str] | None:
    """Every key the store holds (all tenants'), named as the store names them (a
    ``PrefixStore`` adds its prefix and a ``/``); None where torch's TCPStore cannot list
    them (``list_keys`` came in torch 2.10, pytorch PR 167883)."""
    lister = getattr(store, "list_keys", None)
    return None if lister is None else list(lister())


def connect_tcp_store(settings: Settings, host_if_possible: bool = True) -> tuple[TCPStore, bool]:
    """Host the embedded store if this node should, else connect to it; (store, hosting)."""
    endpoint = settings.endpoints[0]
    timeout = timedelta(seconds=settings.timeouts.connect)
    want_host = settings.is_host
    if want_host is None:
        want_host = host_if_possible and matches_machine_hostname(endpoint.host)
    attempts = [True, False] if want_host and settings.is_host is None else [bool(want_host)]
    last: Exception | None = None
    for is_server in attempts:
        try:
            store = TCPStore(endpoint.host, endpoint.port, is_master=is_server,
                             wait_for_workers=False, multi_tenant=True, timeout=timeout)
        except STORE_ERRORS as exc:
            last = exc
            continue
        if is_server:
            logger.info("agent %d hosts the embedded etcd-ext store on %s", os.getpid(), endpoint)
        return store, is_server
    raise StoreUnavailableError(
        f"cannot reach the embedded c10d store at {endpoint} within "
        f"{settings.timeouts.connect:g}s ({last}); check --rdzv-endpoint, or start the node "
        "that hosts it (the one whose address matches the endpoint)") from last


def decode_state(raw: bytes) -> bytes:
    # value = magic + nonce line + state; the nonce makes every write's token unique
    return unwrap_state(raw).split(b"\n", 1)[1]


class C10dBackend(StoreBackend):
    """The run's keys on the embedded TCPStore; see :class:`StoreBackend` for the contract."""

    def __init__(self, settings: Settings, store: TCPStore, *, hosts_store: bool = False,
                 left: set[str] | None = None, feed: SharedWriteFeed | None = None,
                 beats: Iterator[int] | None = None) -> None:
        self._settings = settings
        # Nodes this agent marked left, shared with the clones: a late heartbeat (a keeper
        # thread that outlived its stop) must not overwrite LEFT.
        self._left: set[str] = set() if left is None else left
        self._tcp = store
        self._prefixed = PrefixStore(settings.run_prefix, store)
        self._store = cast(ByteStore, self._prefixed)
        self._hosts_store = hosts_store
        # The heartbeat counter, shared with the clones: a keeper's beater beats on a clone
        # (``agent/beater.py``), and the counter must move at every beat whoever writes it.
        self._beats = itertools.count(1) if beats is None else beats
        self._seq_at: tuple[bytes, int] = (b"", -1)  # a state read and the write count before it
        self._key_root = settings.run_prefix + "/"  # this run's keys as the TCPStore names them
        self._feed = feed or SharedWriteFeed()  # started when first waited on; clones share it
        self._owns_feed = feed is None
        self._joins_feed: tuple[str, WriteFeed] | None = None  # (round's prefix, its joins)

    @classmethod
    def connect(cls, settings: Settings, *, may_host: bool = True) -> C10dBackend:
        """Host the embedded store if this node should (and ``may_host``), else connect to it.

        Raises:
            StoreUnavailableError: the store could not be hosted or reached in time.
        """
        store, hosting = connect_tcp_store(settings, host_if_possible=may_host)
        return cls(settings, store, hosts_store=hosting)

    @property
    def name(self) -> str:
        return "c10d-embedded"

    @property
    def outages_are_transient(self) -> bool:
        return False  # the store lives in one agent; when that agent dies it is gone

    @property
    def hosts_store(self) -> bool:
        return self._hosts_store

    @contextmanager
    def _reaching(self, op: str) -> Iterator[None]:
        """Turn the TCPStore's errors into the contract's ``StoreUnavailableError``."""
        try:
            yield
        except STORE_ERRORS as exc:
            raise StoreUnavailableError(
                f"the embedded c10d store at {self._settings.endpoints[0]} failed during {op} "
                f"({exc}); its host agent may have died") from exc

    def _run(self, op: str, call: Callable[[], _T]) -> _T:
        """``call`` on the store, its errors reported as the contract's."""
        with self._reaching(op):
            return call()

    def get_state(self) -> tuple[bytes, Token] | None:
        def read() -> tuple[bytes, Token] | None:
            seq = read_count(self._store, STATE_SEQ)  # before the state: a write after bumps it
            raw = read_key(self._store, STATE_KEY)
            if raw is None:
                return None
            state = decode_state(raw)
            self._seq_at = (raw, seq)
            return state, raw
        return self._run("get_state", read)

    def wait_for_state(self, token: Token | None, timeout: float, clock: Clock
                       ) -> bool | tuple[bytes, Token]:
        """Waits on the count of state writes (``c10d.feed.WriteFeed``), not the state."""
        if token is None or self._seq_at[0] != token:
            return super().wait_for_state(token, timeout, clock)  # reads the state itself
        seq = self._seq_at[1]
        if self._write_feed().wait_past(seq, timeout):
            return True
        try:
            return bool(self._run("state_version",
                                 lambda: read_count(self._store, STATE_SEQ)) != seq)
        except StoreUnavailableError:
            return True

    def _write_feed(self) -> WriteFeed:
        return self._feed.get(lambda: self.clone()._store, poke=self._store)

    def on_state_change(self, callback: Callable[[], None]) -> None:
        self._write_feed().add_listener(callback)

    def set_state(self, state: bytes, token: Token | None = None
                  ) -> tuple[bytes, Token, bool] | None:
        if token is not None and not isinstance(token, bytes):
            current = self.get_state()
            return None if current is None else (*current, False)
        new_raw = wrap_state(os.urandom(8).hex().encode() + b"\n" + state)

        def write() -> tuple[bytes, Token, bool] | None:
            result = bytes(self._store.compare_set(STATE_KEY, token or b"", new_raw))
            if result == new_raw:
                self._seq_at = (new_raw, announce_write(self._store))
                return state, new_raw, True
            if token and result == token and not self._store.check([STATE_KEY]):
                return None  # the key vanished; compare_set echoes the expected value
            return decode_state(result), result, False
        return self._run("set_state", write)

    def state_version(self) -> object | None:
        return self._run("state_version", lambda: read_count(self._store, STATE_SEQ))

    def join(self, generation: str, round_: int, node: str, entry: bytes) -> int:
        # A TCPStore cannot list keys: joins are numbered by an atomic counter.
        prefix = f"join/{generation}/{round_}/"

        def write() -> int:
            position = self._store.add(prefix + "n", 1)
            self._store.set(f"{prefix}{position}", node.encode() + b"\n" + entry)
            self._store.set(f"{prefix}{JOINED}{position}", b"")  # wakes the closer's wait
            return position
        return self._run("join", write)

    def wait_for_joins(self, generation: str, round_: int, at_least: int, timeout: float,
                       clock: Clock) -> bool:
        """Blocks in ``TCPStore.wait`` on the key the next join creates, on a connection of
        its own for the round (``c10d.feed.WriteFeed``): no request while nobody joins."""
        prefix = f"join/{generation}/{round_}/"
        if self._joins_feed is None or self._joins_feed[0] != prefix:
            if self._joins_feed is not None:
                self._joins_feed[1].close()
            self._joins_feed = (prefix, WriteFeed(lambda: self.clone()._store, poke=self._store,
                                                  counter=prefix + "n",
                                                  marker=prefix + JOINED))
        return self._joins_feed[1].wait_for(lambda count: count >= at_least, timeout)

    def _numbered_joins(self, generation: str, round_: int) -> list[tuple[str, str, bytes]]:
        """(key, node, entry) of every join of the round, in order; a node that joined
        twice keeps its first place and its last entry."""
        prefix = f"join/{generation}/{round_}/"

        def read() -> list[tuple[str, bytes]]:
            count = read_count(self._store, prefix + "n")
            keys = [f"{prefix}{i}" for i in range(1, count + 1)]
            if keys and self._store.check(keys):
                return [(k, bytes(v)) for k, v in zip(keys, self._store.multi_get(keys),
                                                      strict=True)]
            # a joiner between its count and its entry: read what is there, never wait
            return [(k, v) for k in keys if (v := read_key(self._store, k)) is not None]
        places: dict[str, tuple[str, bytes]] = {}
        for key, raw in self._run("read_joins", read):
            node, _, entry = raw.partition(b"\n")
            if entry:  # an emptied entry is a dropped join
                name = node.decode(errors="replace")
                places[name] = (places[name][0] if name in places else key, entry)
        return [(key, node, entry) for node, (key, entry) in places.items()]

    def count_joins(self, generation: str, round_: int) -> int:
        # joins numbered, dropped ones included: enough to see whether the round moves
        return self._run("count_joins",
                         lambda: read_count(self._store, f"join/{generation}/{round_}/n"))

    def read_joins(self, generation: str, round_: int) -> list[tuple[str, bytes]]:
        return [(node, entry) for _, node, entry in self._numbered_joins(generation, round_)]

    def drop_joins(self, generation: str, round_: int, nodes: Iterable[str]) -> None:
        dropped = set(nodes)
        prefix = f"join/{generation}/{round_}/"

        def empty() -> None:
            count = read_count(self._store, prefix + "n")
            for i in range(1, count + 1):
                raw = read_key(self._store, f"{prefix}{i}")
                if raw is not None and raw.partition(b"\n")[0].decode(errors="replace") \
                        in dropped:
                    self._store.set(f"{prefix}{i}", b"")
        self._run("drop_joins", empty)

    def write_verdict(self, verdict: bytes) -> None:
        self._run("write_verdict", lambda: self._store.set("verdict", verdict))

    def read_verdict(self) -> bytes | None:
        return self._run("read_verdict", lambda: read_key(self._store, "verdict"))

    def beat(self, node: str, presence_port: int | None = None, pace: Pace | None = None
             ) -> None:
        value = heartbeat_value(next(self._beats), presence_port, pace)
        if node not in self._left:
            self._run("beat", lambda: self._store.set(f"hb/{node}", value))

    def _run_keys(self) -> list[str] | None:
        """This run's keys as the TCPStore names them, or None where it cannot list them."""
        keys = self._run("list_keys", lambda: list_keys(self._tcp))
        return None if keys is None else [k for k in keys if k.startswith(self._key_root)]

    def _delete(self, keys: list[str]) -> None:
        """Delete keys named as the TCPStore names them (``_run_keys``)."""
        def delete() -> None:
            for key in keys:
                self._tcp.delete_key(key)
        self._run("delete_key", delete)

    def remove_run(self) -> None:
        listed = self._run_keys()
        if listed is not None:
            self._delete(listed)
            return
        current = self.get_state()
        nodes: set[str] = set()
        if current is not None:
            nodes = RunState.from_bytes(current[0]).known_nodes()
        keys = [STATE_KEY, *(f"hb/{n}" for n in nodes)]

        def delete() -> None:
            for key in keys:
                self._store.delete_key(key)
        self._run("delete_key", delete)

    def leave(self, node: str) -> None:
        """LEFT only while the run exists: the last node out may have removed it (a check,
        then a set: a TCPStore has no transaction, and its keys end with its host anyway)."""
        self._left.add(node)

        def write() -> None:
            if self._store.check([STATE_KEY]):
                self._store.set(f"hb/{node}", LEFT)
        self._run("leave", write)

    def read_beats(self, nodes: Iterable[str]) -> dict[str, bytes | None]:
        nodes = list(nodes)
        keys = [f"hb/{n}" for n in nodes]
        if not keys:
            return {}

        def read() -> dict[str, bytes | None]:
            if self._store.check(keys):
                values = self._store.multi_get(keys)
                return {n: bytes(v) for n, v in zip(nodes, values, strict=True)}
            return {n: read_key(self._store, k) for n, k in zip(nodes, keys, strict=True)}
        return self._run("read_beats", read)

    def round_store(self, generation: str, round_: int) -> Store:
        return PrefixStore(f"round/{generation}/{round_}/", self._prefixed)

    def drop_round_stores(self, generation: str, keep_from_round: int) -> None:
        """Also the join keys of those rounds. Where the TCPStore cannot list its keys
        (torch < 2.10) they live as long as the store (the job)."""
        listed = self._run_keys()
        stale = []
        for key in listed or []:
            kind, _, rest = key[len(self._key_root):].partition("/")
            gen, _, rest = rest.partition("/")
            round_text = rest.partition("/")[0]
            if kind in ("round", "join") and round_text and (
                    gen != generation
                    or (round_text.isdigit() and int(round_text) < keep_from_round)):
                stale.append(key)
        if stale:
            self._delete(stale)

    def list_runs(self) -> list[str]:
        keys = self._run("list_keys", lambda: list_keys(self._tcp))
        if keys is None:
            raise ConfigError("listing runs on the embedded store needs torch >= 2.10 "
                              "(TCPStore.list_keys); upgrade torch, or use etcd")
        root = self._settings.key_prefix.rstrip("/") + "/"
        return sorted({k[len(root):].split("/", 1)[0] for k in keys if k.startswith(root)})

    def close(self) -> None:
        if self._owns_feed:
            self._feed.close()
        if self._joins_feed is not None:
            self._joins_feed[1].close()
            self._joins_feed = None

    def clone(self) -> C10dBackend:
        endpoint = self._settings.endpoints[0]
        with self._reaching("connect"):
            client = TCPStore(endpoint.host, self._tcp.port, is_master=False,
                              wait_for_workers=False, multi_tenant=True,
                              timeout=timedelta(seconds=self._settings.timeouts.connect))
        return C10dBackend(self._settings, client, left=self._left, feed=self._feed,
                           beats=self._beats)
