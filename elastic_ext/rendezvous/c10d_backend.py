"""The run's state on an embedded c10d TCPStore, for machines with no etcd.

The node whose address matches the endpoint hosts the store inside its agent;
the others connect to it. The host is a single point of failure: if its agent
dies, the other agents lose the store and exit after ``connect_timeout`` (use
etcd when that matters).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Protocol, cast

from torch.distributed import PrefixStore, Store, TCPStore

from elastic_ext.rendezvous.backend import (
    STATE_KEY,
    StoreBackend,
    Token,
    heartbeat_value,
    unwrap_state,
    wrap_state,
)
from elastic_ext.rendezvous.errors import ConfigError, StoreUnavailableError
from elastic_ext.rendezvous.liveness import LEFT
from elastic_ext.rendezvous.settings import Settings
from elastic_ext.rendezvous.state import RunState
from elastic_ext.torch_compat import matches_machine_hostname

logger = logging.getLogger(__name__)

_STORE_ERRORS = (RuntimeError, ValueError, TimeoutError)


class _ByteStore(Protocol):
    """A c10d store as its binding really is: values are bytes (torch's stubs say ``str``)."""

    def set(self, key: str, value: bytes) -> None: ...
    def get(self, key: str) -> bytes: ...
    def check(self, keys: list[str]) -> bool: ...
    def compare_set(self, key: str, expected_value: bytes, desired_value: bytes) -> bytes: ...
    def multi_get(self, keys: list[str]) -> list[bytes]: ...
    def delete_key(self, key: str) -> bool: ...


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
        except _STORE_ERRORS as exc:
            last = exc
            continue
        if is_server:
            logger.info("agent %d hosts the embedded etcd-ext store on %s", os.getpid(), endpoint)
        return store, is_server
    raise StoreUnavailableError(
        f"cannot reach the embedded c10d store at {endpoint} within "
        f"{settings.timeouts.connect:g}s ({last}); check --rdzv-endpoint, or start the node "
        "that hosts it (the one whose address matches the endpoint)") from last


class C10dBackend(StoreBackend):
    """The run's keys on the embedded TCPStore; see :class:`StoreBackend` for the contract."""

    def __init__(self, settings: Settings, store: TCPStore, *, hosts_store: bool = False) -> None:
        self._settings = settings
        self._tcp = store
        self._prefixed = PrefixStore(settings.run_prefix, store)
        self._store = cast(_ByteStore, self._prefixed)
        self._hosts_store = hosts_store
        self._beats = 0

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
        except _STORE_ERRORS as exc:
            raise StoreUnavailableError(
                f"the embedded c10d store at {self._settings.endpoints[0]} failed during {op} "
                f"({exc}); its host agent may have died") from exc

    def _has(self, keys: list[str]) -> bool:
        with self._reaching("check"):
            return bool(self._store.check(keys))

    def _get(self, key: str) -> bytes:
        with self._reaching("get"):
            return bytes(self._store.get(key))

    def _set(self, key: str, value: bytes) -> None:
        with self._reaching("set"):
            self._store.set(key, value)

    def get_state(self) -> tuple[bytes, Token] | None:
        if not self._has([STATE_KEY]):
            return None
        raw = self._get(STATE_KEY)
        return self._decode(raw), raw

    @staticmethod
    def _decode(raw: bytes) -> bytes:
        # value = magic + nonce line + state; the nonce makes every write's token unique
        return unwrap_state(raw).split(b"\n", 1)[1]

    def set_state(self, state: bytes, token: Token | None = None
                  ) -> tuple[bytes, Token, bool] | None:
        if token is not None and not isinstance(token, bytes):
            current = self.get_state()
            return None if current is None else (*current, False)
        new_raw = wrap_state(os.urandom(8).hex().encode() + b"\n" + state)
        with self._reaching("compare_set"):
            result = bytes(self._store.compare_set(STATE_KEY, token or b"", new_raw))
        if result == new_raw:
            return state, new_raw, True
        if token and result == token and not self._has([STATE_KEY]):
            return None  # the key vanished; compare_set echoes the expected value
        return self._decode(result), result, False

    def beat(self, node: str, presence_port: int | None = None) -> None:
        self._beats += 1
        self._set(f"hb/{node}", heartbeat_value(self._beats, presence_port))

    def remove_run(self) -> None:
        current = self.get_state()
        nodes: set[str] = set()
        if current is not None:
            nodes = RunState.from_bytes(current[0]).known_nodes()
        with self._reaching("delete_key"):
            for key in [STATE_KEY, *(f"hb/{n}" for n in nodes)]:
                self._store.delete_key(key)

    def leave(self, node: str) -> None:
        self._set(f"hb/{node}", LEFT)

    def read_beats(self, nodes: Iterable[str]) -> dict[str, bytes | None]:
        nodes = list(nodes)
        keys = [f"hb/{n}" for n in nodes]
        if not keys:
            return {}
        if self._has(keys):
            with self._reaching("multi_get"):
                values = self._store.multi_get(keys)
            return {n: bytes(v) for n, v in zip(nodes, values, strict=True)}
        return {n: (self._get(k) if self._has([k]) else None)
                for n, k in zip(nodes, keys, strict=True)}

    def round_store(self, generation: str, round_: int) -> Store:
        return PrefixStore(f"round/{generation}/{round_}/", self._prefixed)

    def drop_round_stores(self, generation: str, keep_from_round: int) -> None:
        """A TCPStore cannot enumerate keys: round stores live as long as the store (the job)."""

    def list_runs(self) -> list[str]:
        raise ConfigError("listing runs needs etcd: the embedded store cannot enumerate keys")

    def clone(self) -> C10dBackend:
        endpoint = self._settings.endpoints[0]
        with self._reaching("connect"):
            client = TCPStore(endpoint.host, self._tcp.port, is_master=False,
                              wait_for_workers=False, multi_tenant=True,
                              timeout=timedelta(seconds=self._settings.timeouts.connect))
        return C10dBackend(self._settings, client)
