"""An in-memory ``StoreBackend`` for fast, deterministic tests of the handler and the keeper.

It is held to the same contract tests as etcd and the embedded store
(``tests/test_backend_contract.py``), so what the in-process tests prove with it holds
for the real stores as far as the contract goes; the real-store tests stay for the rest.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterable, Iterator
from datetime import timedelta

from torch.distributed import HashStore, Store

from elastic_ext.rendezvous.errors import StoreUnavailableError
from elastic_ext.rendezvous.protocol.clock import Clock
from elastic_ext.rendezvous.protocol.liveness import LEFT
from elastic_ext.rendezvous.protocol.pace import Pace
from elastic_ext.rendezvous.stores.contract import StoreBackend, Token, poll_until
from elastic_ext.rendezvous.stores.wire import (
    HEAD_KEY,
    SEAT_DIR,
    STATE_KEY,
    head_and_seats,
    heartbeat_value,
    unwrap_state,
    wrap_state,
)


class MemoryStore:
    """The shared "server": versioned keys, the rounds' stores, and a switch that takes it down."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.keys: dict[str, tuple[bytes, int]] = {}
        self.revision = 0
        self.down = False
        self.round_stores: dict[str, Store] = {}
        self.state_listeners: dict[str, list[Callable[[], None]]] = {}  # run prefix -> callbacks

    def check_up(self) -> None:
        if self.down:
            raise StoreUnavailableError("the in-memory store is down (test)")

    def put(self, key: str, value: bytes) -> int:
        self.revision += 1
        self.keys[key] = (value, self.revision)
        return self.revision

    def plant(self, key: str, raw: bytes) -> None:
        """Write ``raw`` under ``key`` as a foreign program would."""
        with self.lock:
            self.put(key, raw)


class MemoryBackend(StoreBackend):
    """One run's keys in a :class:`MemoryStore`; tokens are revisions, as on etcd."""

    def __init__(self, store: MemoryStore, run_prefix: str = "/elastic-ext/run1/", *,
                 transient: bool = True, left: set[str] | None = None,
                 beats: Iterator[int] | None = None) -> None:
        self.store = store
        self._left: set[str] = set() if left is None else left  # shared with clones
        self._prefix = run_prefix
        self._transient = transient
        self._beats = itertools.count(1) if beats is None else beats  # shared with clones

    @property
    def name(self) -> str:
        return "memory"

    @property
    def outages_are_transient(self) -> bool:
        return self._transient

    def get_state(self) -> tuple[bytes, Token] | None:
        with self.store.lock:
            self.store.check_up()
            found = self.store.keys.get(self._prefix + STATE_KEY)
        if found is None:
            return None
        return unwrap_state(found[0]), found[1]

    def set_state(self, state: bytes, token: Token | None = None
                  ) -> tuple[bytes, Token, bool] | None:
        key = self._prefix + STATE_KEY
        with self.store.lock:
            self.store.check_up()
            found = self.store.keys.get(key)
            valid = token is None or (isinstance(token, int) and not isinstance(token, bool))
            current_revision = None if found is None else found[1]
            written = valid and token == current_revision
            if written:
                head, seats = head_and_seats(state)
                for name, seat in seats.items():  # before the state, as etcd's closer does
                    self.store.put(self._prefix + SEAT_DIR + name, seat)
                revision = self.store.put(key, wrap_state(state))
                # in the state's transaction: its revision (empty for bytes that are no state)
                self.store.keys[self._prefix + HEAD_KEY] = (head or b"", revision)
                listeners = list(self.store.state_listeners.get(self._prefix, ()))
        if written:
            for listener in listeners:  # as a watch would, once the write is done
                listener()
            return state, revision, True
        if found is None:
            return None
        return unwrap_state(found[0]), found[1], False

    @property
    def keeps_heads(self) -> bool:
        return True

    def head_after(self, version: object | None) -> tuple[bytes, Token] | None:
        with self.store.lock:
            self.store.check_up()
            found = self.store.keys.get(self._prefix + HEAD_KEY)
        return found if found is not None and found[0] else super().head_after(version)

    def wait_for_state(self, token: Token | None, timeout: float, clock: Clock
                       ) -> bool | tuple[bytes, Token]:
        """On the state's version, as etcd's watch of the head: no read of the state."""
        def changed() -> bool:
            return self.state_version() != token
        return poll_until(changed, timeout, clock)

    def read_seat(self, generation: str, round_: int, node: str) -> bytes | None:
        with self.store.lock:
            self.store.check_up()
            found = self.store.keys.get(f"{self._prefix}{SEAT_DIR}{generation}/{round_}/{node}")
        return None if found is None else found[0]

    def read_seats(self, generation: str, round_: int) -> list[tuple[str, bytes]]:
        prefix = f"{self._prefix}{SEAT_DIR}{generation}/{round_}/"
        with self.store.lock:
            self.store.check_up()
            return [(k[len(prefix):], v) for k, (v, _) in self.store.keys.items()
                    if k.startswith(prefix)]

    def on_state_change(self, callback: Callable[[], None]) -> None:
        with self.store.lock:
            self.store.state_listeners.setdefault(self._prefix, []).append(callback)

    def state_version(self) -> object | None:
        with self.store.lock:
            self.store.check_up()
            found = self.store.keys.get(self._prefix + STATE_KEY)
        return None if found is None else found[1]

    def _join_prefix(self, generation: str, round_: int) -> str:
        return f"{self._prefix}join/{generation}/{round_}/"

    def join(self, generation: str, round_: int, node: str, entry: bytes) -> int:
        prefix = self._join_prefix(generation, round_)
        with self.store.lock:
            self.store.check_up()
            self.store.put(prefix + node, entry)
            return sum(1 for k in self.store.keys if k.startswith(prefix))

    def count_joins(self, generation: str, round_: int) -> int:
        prefix = self._join_prefix(generation, round_)
        with self.store.lock:
            self.store.check_up()
            return sum(1 for k in self.store.keys if k.startswith(prefix))

    def read_joins(self, generation: str, round_: int) -> list[tuple[str, bytes]]:
        prefix = self._join_prefix(generation, round_)
        with self.store.lock:
            self.store.check_up()
            found = sorted((rev, k[len(prefix):], v) for k, (v, rev) in self.store.keys.items()
                           if k.startswith(prefix))
        return [(node, value) for _, node, value in found]

    def drop_joins(self, generation: str, round_: int, nodes: Iterable[str]) -> None:
        prefix = self._join_prefix(generation, round_)
        with self.store.lock:
            self.store.check_up()
            for node in nodes:
                self.store.keys.pop(prefix + node, None)

    def write_verdict(self, verdict: bytes) -> None:
        with self.store.lock:
            self.store.check_up()
            self.store.put(self._prefix + "verdict", verdict)

    def read_verdict(self) -> bytes | None:
        with self.store.lock:
            self.store.check_up()
            return (self.store.keys.get(self._prefix + "verdict") or (None, 0))[0]

    def beat(self, node: str, presence_port: int | None = None, pace: Pace | None = None
             ) -> None:
        count = next(self._beats)
        if node not in self._left:
            self._put_beat(node, heartbeat_value(count, presence_port, pace))

    def _put_beat(self, node: str, value: bytes) -> None:
        with self.store.lock:
            self.store.check_up()
            self.store.put(f"{self._prefix}hb/{node}", value)

    def leave(self, node: str) -> None:
        self._left.add(node)
        with self.store.lock:  # only while the run exists, as etcd's transaction does
            self.store.check_up()
            if self._prefix + STATE_KEY in self.store.keys:
                self.store.put(f"{self._prefix}hb/{node}", LEFT)

    def read_beats(self, nodes: Iterable[str]) -> dict[str, bytes | None]:
        with self.store.lock:
            self.store.check_up()
            return {n: (self.store.keys.get(f"{self._prefix}hb/{n}") or (None, 0))[0]
                    for n in nodes}

    def remove_run(self) -> None:
        with self.store.lock:
            self.store.check_up()
            for key in [k for k in self.store.keys if k.startswith(self._prefix)]:
                del self.store.keys[key]
            for key in [k for k in self.store.round_stores if k.startswith(self._prefix)]:
                del self.store.round_stores[key]

    def round_store(self, generation: str, round_: int) -> Store:
        with self.store.lock:
            self.store.check_up()
            key = f"{self._prefix}store/{generation}/{round_}"
            if key not in self.store.round_stores:
                store = HashStore()
                store.set_timeout(timedelta(seconds=30))
                self.store.round_stores[key] = store
            return self.store.round_stores[key]

    def drop_round_stores(self, generation: str, keep_from_round: int) -> None:
        with self.store.lock:
            self.store.check_up()
            for key in list(self.store.round_stores):
                if not key.startswith(f"{self._prefix}store/"):
                    continue
                gen, round_text = key[len(f"{self._prefix}store/"):].split("/")
                if gen != generation or int(round_text) < keep_from_round:
                    del self.store.round_stores[key]
            for kind in ("join/", SEAT_DIR):  # the join keys and seats too, as etcd's
                for key in [k for k in self.store.keys if k.startswith(self._prefix + kind)]:
                    gen, round_text = key[len(self._prefix + kind):].split("/")[:2]
                    if gen != generation or int(round_text) < keep_from_round:
                        del self.store.keys[key]

    def list_runs(self) -> list[str]:
        with self.store.lock:
            self.store.check_up()
            prefix = "/".join(self._prefix.rstrip("/").split("/")[:-1]) + "/"
            return sorted({k[len(prefix):].split("/", 1)[0] for k in self.store.keys
                           if k.startswith(prefix)})

    def clone(self) -> MemoryBackend:
        return MemoryBackend(self.store, self._prefix, transient=self._transient,
                             left=self._left, beats=self._beats)
