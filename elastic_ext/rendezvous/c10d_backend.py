"""The run's state on an embedded c10d TCPStore, for machines with no etcd.

The node whose address matches the endpoint hosts the store inside its agent;
the others connect to it. The host is a single point of failure: if its agent
dies, the other agents lose the store and exit after ``connect_timeout`` (use
etcd when that matters).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from datetime import timedelta

from torch.distributed import PrefixStore, Store, TCPStore
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import Token
from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname

from elastic_ext.rendezvous.backend import StoreBackend, unwrap_state, wrap_state
from elastic_ext.rendezvous.errors import StoreUnavailableError
from elastic_ext.rendezvous.liveness import LEFT
from elastic_ext.rendezvous.settings import Settings
from elastic_ext.rendezvous.state import RunState

logger = logging.getLogger(__name__)

_STORE_ERRORS = (RuntimeError, ValueError, TimeoutError)


def connect_tcp_store(settings: Settings, host_if_possible: bool = True) -> TCPStore:
    """Host the embedded store if this node should, else connect to it."""
    endpoint = settings.endpoints[0]
    timeout = timedelta(seconds=settings.timeouts.connect)
    want_host = settings.is_host
    if want_host is None:
        want_host = host_if_possible and _matches_machine_hostname(endpoint.host)
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
        return store
    raise StoreUnavailableError(
        f"cannot reach the embedded c10d store at {endpoint} within "
        f"{settings.timeouts.connect:g}s ({last}); check --rdzv-endpoint, or start the node "
        "that hosts it (the one whose address matches the endpoint)") from last


class C10dBackend(StoreBackend):
    def __init__(self, settings: Settings, store: TCPStore) -> None:
        self._settings = settings
        self._tcp = store
        self._store = PrefixStore(settings.run_prefix, store)
        self._state_key = "state"

    @property
    def name(self) -> str:
        return "c10d-embedded"

    @property
    def outages_are_transient(self) -> bool:
        return False  # the store lives in one agent; when that agent dies it is gone

    def _call(self, op: str, *args: object) -> object:
        try:
            return getattr(self._store, op)(*args)
        except _STORE_ERRORS as exc:
            raise StoreUnavailableError(
                f"the embedded c10d store at {self._settings.endpoints[0]} failed during {op} "
                f"({exc}); its host agent may have died") from exc

    def get_state(self) -> tuple[bytes, Token] | None:
        if not self._call("check", [self._state_key]):
            return None
        raw = self._call("get", self._state_key)
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
        result = self._call("compare_set", self._state_key, token or b"", new_raw)
        if result == new_raw:
            return state, new_raw, True
        if token and result == token and not self._call("check", [self._state_key]):
            return None  # the key vanished; compare_set echoes the expected value
        return self._decode(result), result, False

    def _write_beat(self, node: str, value: bytes) -> None:
        self._call("set", f"hb/{node}", value)

    def remove_run(self) -> None:
        current = self.get_state()
        nodes: set[str] = set()
        if current is not None:
            nodes = RunState.from_bytes(current[0]).known_nodes()
        for key in [self._state_key, *(f"hb/{n}" for n in nodes)]:
            self._call("delete_key", key)

    def leave(self, node: str) -> None:
        self._call("set", f"hb/{node}", LEFT)

    def read_beats(self, nodes: Iterable[str]) -> dict[str, bytes | None]:
        nodes = list(nodes)
        keys = [f"hb/{n}" for n in nodes]
        if not keys:
            return {}
        if self._call("check", keys):
            return dict(zip(nodes, self._call("multi_get", keys)))
        return {n: (self._call("get", k) if self._call("check", [k]) else None)
                for n, k in zip(nodes, keys)}

    def round_store(self, generation: str, round_: int) -> Store:
        store = PrefixStore(f"round/{generation}/{round_}/", self._store)
        return store

    def clone(self) -> C10dBackend:
        endpoint = self._settings.endpoints[0]
        client = TCPStore(endpoint.host, self._tcp.port, is_master=False,
                          wait_for_workers=False, multi_tenant=True,
                          timeout=timedelta(seconds=self._settings.timeouts.connect))
        return C10dBackend(self._settings, client)
