"""The run's state on an embedded c10d TCPStore, for machines with no etcd.

**One endpoint** (``c10d://host:port``): the node whose address matches it hosts the
store inside its agent; the others connect to it. That host is a single point of
failure: when its agent dies the store dies with it, the other agents' next store
operation fails at once, and they exit.

**Several endpoints** (``c10d://node1:29400,node2:29400,node3:29400``) are candidate
hosts, in order, and the store survives its host: ``c10d_placement`` finds the current
host and moves the run's store when it dies; the backend follows it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import TypeVar, cast

from torch.distributed import PrefixStore, Store, TCPStore

from elastic_ext.rendezvous.backend import (
    STATE_KEY,
    STATE_POLL_S,
    StoreBackend,
    Token,
    heartbeat_value,
    wrap_state,
)
from elastic_ext.rendezvous.c10d_placement import (
    STORE_ERRORS,
    ByteStore,
    Placement,
    connect_tcp_store,
    decode_state,
    read_key,
)
from elastic_ext.rendezvous.clock import Clock
from elastic_ext.rendezvous.errors import ConfigError, StoreUnavailableError
from elastic_ext.rendezvous.liveness import LEFT
from elastic_ext.rendezvous.settings import Endpoint, Settings
from elastic_ext.rendezvous.state import RunState

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

_STATE_SEQ = "state_seq"  # counts state writes, so waiters need not read the state


class C10dBackend(StoreBackend):
    """The run's keys on the embedded TCPStore; see :class:`StoreBackend` for the contract.

    With one endpoint it holds one TCPStore; with several it shares a ``Placement``
    with its clones and follows the store when it moves.
    """

    def __init__(self, settings: Settings, store: TCPStore, *, hosts_store: bool = False,
                 placement: Placement | None = None, owner: bool = False) -> None:
        self._settings = settings
        self._placement = placement
        self._owner = owner  # the backend ``connect`` returned: it releases the server
        self._epoch = placement.epoch if placement is not None else 0
        self._hosts_store = hosts_store
        self._beats = 0
        self._seq_at: tuple[bytes, int] = (b"", -1)  # a state read and the write count before it
        self._attach(store)

    def _attach(self, store: TCPStore) -> None:
        self._tcp = store
        self._prefixed = PrefixStore(self._settings.run_prefix, store)
        self._store = cast(ByteStore, self._prefixed)

    @classmethod
    def connect(cls, settings: Settings, *, may_host: bool = True) -> C10dBackend:
        """Host the embedded store if this node should (and ``may_host``), else connect to it;
        with several candidates, find the current store or host it (module docstring).

        Raises:
            StoreUnavailableError: the store could not be hosted or reached in time.
        """
        if len(settings.endpoints) == 1:
            store, hosting = connect_tcp_store(settings, host_if_possible=may_host)
            return cls(settings, store, hosts_store=hosting)
        placement = Placement(settings, may_host=may_host)
        with placement.lock:
            store = placement.move(leaving=None)
            return cls(settings, store, placement=placement, owner=True)

    @property
    def name(self) -> str:
        return "c10d-embedded"

    @property
    def outages_are_transient(self) -> bool:
        # One endpoint: the store lives in one agent and dies with it. Several: it moves.
        return self._placement is not None

    @property
    def hosts_store(self) -> bool:
        if self._placement is not None:
            return self._placement.server is not None
        return self._hosts_store

    def _where(self) -> Endpoint:
        placement = self._placement
        return self._settings.endpoints[placement.at if placement is not None else 0]

    @contextmanager
    def _reaching(self, op: str) -> Iterator[None]:
        """Turn the TCPStore's errors into the contract's ``StoreUnavailableError``."""
        try:
            yield
        except STORE_ERRORS as exc:
            raise StoreUnavailableError(
                f"the embedded c10d store at {self._where()} failed during {op} "
                f"({exc}); its host agent may have died") from exc

    def _run(self, op: str, call: Callable[[], _T]) -> _T:
        """``call`` on the store; with several candidates, once more where the store went
        if it failed (``StoreUnavailableError`` when it went nowhere within the timeout)."""
        placement = self._placement
        if placement is None:
            with self._reaching(op):
                return call()
        self._follow()
        try:
            return call()
        except STORE_ERRORS as exc:
            self._reconnect(str(exc))
        with self._reaching(op):
            return call()

    def _follow(self) -> None:
        """Reconnect if another backend of this agent moved the store since we last looked."""
        placement = self._placement
        if placement is not None and self._epoch != placement.epoch:
            self._reconnect("")

    def _reconnect(self, why: str) -> None:
        """A new connection to the store: where another backend of this agent found it, or
        here, or, if it is gone, where the search finds it. Only one thread searches."""
        placement = self._placement
        assert placement is not None
        with placement.lock, self._reaching("reconnect"):
            if self._epoch == placement.epoch and placement.server is not None:
                store = placement.client_here()  # we serve it: only our connection broke
            else:
                store = placement.connect_current(why or "it does not answer")
            self._attach(store)
            self._epoch = placement.epoch

    def _saw(self, raw: bytes) -> None:
        if self._placement is not None:
            self._placement.last_state = raw

    def get_state(self) -> tuple[bytes, Token] | None:
        def read() -> tuple[bytes, Token] | None:
            seq = self._store.add(_STATE_SEQ, 0)  # before the state: a write after bumps it
            raw = read_key(self._store, STATE_KEY)
            if raw is None:
                return None
            state = decode_state(raw)
            self._saw(raw)
            self._seq_at = (raw, seq)
            return state, raw
        return self._run("get_state", read)

    def wait_for_state(self, token: Token | None, timeout: float, clock: Clock
                       ) -> bool | tuple[bytes, Token]:
        """Looks at the counter of state writes every ``STATE_POLL_S``, not the state."""
        if token is None or self._seq_at[0] != token:
            return super().wait_for_state(token, timeout, clock)  # reads the state itself
        seq = self._seq_at[1]
        deadline = clock.monotonic() + timeout
        while clock.monotonic() < deadline:
            try:
                if self._run("state_version", lambda: self._store.add(_STATE_SEQ, 0)) != seq:
                    return True
            except StoreUnavailableError:
                return True
            clock.sleep(min(STATE_POLL_S, max(0.0, deadline - clock.monotonic())))
        return False

    def set_state(self, state: bytes, token: Token | None = None
                  ) -> tuple[bytes, Token, bool] | None:
        if token is not None and not isinstance(token, bytes):
            current = self.get_state()
            return None if current is None else (*current, False)
        new_raw = wrap_state(os.urandom(8).hex().encode() + b"\n" + state)

        def write() -> tuple[bytes, Token, bool] | None:
            result = bytes(self._store.compare_set(STATE_KEY, token or b"", new_raw))
            if result == new_raw:
                self._saw(new_raw)
                self._seq_at = (new_raw, self._store.add(_STATE_SEQ, 1))  # wakes waiters
                return state, new_raw, True
            if token and result == token and not self._store.check([STATE_KEY]):
                return None  # the key vanished; compare_set echoes the expected value
            decoded = decode_state(result)
            self._saw(result)
            return decoded, result, False
        return self._run("set_state", write)

    def state_version(self) -> object | None:
        return self._run("state_version", lambda: self._store.add(_STATE_SEQ, 0))

    def join(self, generation: str, round_: int, node: str, entry: bytes) -> int:
        # A TCPStore cannot list keys: joins are numbered by an atomic counter.
        prefix = f"join/{generation}/{round_}/"

        def write() -> int:
            position = self._store.add(prefix + "n", 1)
            self._store.set(f"{prefix}{position}", node.encode() + b"\n" + entry)
            return position
        return self._run("join", write)

    def _numbered_joins(self, generation: str, round_: int) -> list[tuple[str, str, bytes]]:
        """(key, node, entry) of every join of the round, in order; a node that joined
        twice keeps its first place and its last entry."""
        prefix = f"join/{generation}/{round_}/"

        def read() -> list[tuple[str, bytes]]:
            count = self._store.add(prefix + "n", 0)
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
                         lambda: self._store.add(f"join/{generation}/{round_}/n", 0))

    def read_joins(self, generation: str, round_: int) -> list[tuple[str, bytes]]:
        return [(node, entry) for _, node, entry in self._numbered_joins(generation, round_)]

    def drop_joins(self, generation: str, round_: int, nodes: Iterable[str]) -> None:
        dropped = set(nodes)
        prefix = f"join/{generation}/{round_}/"

        def empty() -> None:
            count = self._store.add(prefix + "n", 0)
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

    def beat(self, node: str, presence_port: int | None = None) -> None:
        self._beats += 1
        value = heartbeat_value(self._beats, presence_port)
        self._run("beat", lambda: self._store.set(f"hb/{node}", value))

    def remove_run(self) -> None:
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
        self._run("leave", lambda: self._store.set(f"hb/{node}", LEFT))

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
        try:
            self._follow()
        except StoreUnavailableError as exc:  # its operations will fail as torch's do
            logger.warning("etcd-ext: %s", exc)
        return PrefixStore(f"round/{generation}/{round_}/", self._prefixed)

    def drop_round_stores(self, generation: str, keep_from_round: int) -> None:
        """A TCPStore cannot enumerate keys: round stores live as long as the store (the job)."""

    def list_runs(self) -> list[str]:
        raise ConfigError("listing runs needs etcd: the embedded store cannot enumerate keys")

    def clone(self) -> C10dBackend:
        placement = self._placement
        if placement is not None:
            with placement.lock, self._reaching("connect"):
                return C10dBackend(self._settings, placement.connect_current(),
                                   placement=placement)
        endpoint = self._settings.endpoints[0]
        with self._reaching("connect"):
            client = TCPStore(endpoint.host, self._tcp.port, is_master=False,
                              wait_for_workers=False, multi_tenant=True,
                              timeout=timedelta(seconds=self._settings.timeouts.connect))
        return C10dBackend(self._settings, client)

    def close(self) -> None:
        """With several candidates, the backend ``connect`` returned stops serving the
        store if this agent hosts it (the other agents move; this agent is leaving); with
        one endpoint the store lives as long as the process, as before."""
        if self._placement is not None and self._owner:
            with self._placement.lock:
                self._placement.server = None
