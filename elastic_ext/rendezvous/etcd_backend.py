"""The run's state on etcd through the v3 API.

Layout under ``<key_prefix>/<run_id>/``: ``state`` (the JSON state, written by
compare-and-swap on ``mod_revision``, create-if-absent the first time), ``hb/<node>``
(heartbeat counters, on each agent's lease so they expire) and
``store/<generation>/<round>/`` (the round's c10d store for torch's agent).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable
from datetime import timedelta

from torch.distributed import Store

from elastic_ext.rendezvous.backend import (
    STATE_KEY,
    StoreBackend,
    Token,
    heartbeat_value,
    unwrap_state,
    wrap_state,
)
from elastic_ext.rendezvous.errors import StoreUnavailableError
from elastic_ext.rendezvous.etcd_client import EtcdClient
from elastic_ext.rendezvous.etcd_store import EtcdV3Store
from elastic_ext.rendezvous.liveness import LEFT
from elastic_ext.rendezvous.settings import Settings

logger = logging.getLogger(__name__)


class EtcdBackend(StoreBackend):
    """The run's keys on an etcd cluster; see :class:`StoreBackend` for the contract."""

    def __init__(self, settings: Settings, client: EtcdClient | None = None) -> None:
        self._settings = settings
        self._client = client or EtcdClient(settings)
        self._prefix = settings.run_prefix
        self._state_key = self._prefix + STATE_KEY
        self._lease: int | None = None
        self._beats = 0
        self._lease_refreshed = 0.0
        self._lease_ttl = max(10, math.ceil(4 * settings.timeouts.heartbeat))

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

    def beat(self, node: str, presence_port: int | None = None) -> None:
        self._beats += 1
        self._put_beat(node, heartbeat_value(self._beats, presence_port))

    def _put_beat(self, node: str, value: bytes) -> None:
        # Heartbeat keys hang on this agent's lease, so a dead agent's key disappears.
        now = time.monotonic()
        if self._lease is None:
            self._lease = self._client.lease_grant(self._lease_ttl)
            self._lease_refreshed = now
        elif now - self._lease_refreshed > self._lease_ttl / 3:
            self._client.lease_keepalive(self._lease)
            self._lease_refreshed = now
        try:
            self._client.put(f"{self._prefix}hb/{node}", value, lease=self._lease)
        except StoreUnavailableError as exc:
            if "lease not found" not in str(exc):
                raise
            self._lease = None  # expired while etcd was out of reach: take a new one
            self._put_beat(node, value)

    def remove_run(self) -> None:
        self._client.delete_prefix(self._prefix)

    def leave(self, node: str) -> None:
        self._client.put(f"{self._prefix}hb/{node}", LEFT)

    def read_beats(self, nodes: Iterable[str]) -> dict[str, bytes | None]:
        hb_prefix = f"{self._prefix}hb/"
        found = {kv.key.decode()[len(hb_prefix):]: kv.value
                 for kv in self._client.get_prefix(hb_prefix)}
        return {node: found.get(node) for node in nodes}

    def round_store(self, generation: str, round_: int) -> Store:
        return EtcdV3Store(self._client, f"{self._prefix}store/{generation}/{round_}/",
                           timeout=timedelta(seconds=max(60.0, self._settings.timeouts.join)))

    def drop_round_stores(self, generation: str, keep_from_round: int) -> None:
        prefix = f"{self._prefix}store/"
        stale: set[tuple[str, str]] = set()
        for kv in self._client.get_prefix(prefix):
            parts = kv.key.decode()[len(prefix):].split("/")
            if len(parts) >= 2:
                stale.add((parts[0], parts[1]))
        for gen, round_text in stale:
            if gen != generation or (round_text.isdigit() and int(round_text) < keep_from_round):
                self._client.delete_prefix(f"{prefix}{gen}/{round_text}/")

    def list_runs(self) -> list[str]:
        prefix = self._settings.key_prefix.rstrip("/") + "/"
        return sorted({kv.key.decode()[len(prefix):].split("/", 1)[0]
                       for kv in self._client.get_prefix(prefix)})

    def clone(self) -> EtcdBackend:
        return EtcdBackend(self._settings, self._client)  # the client is thread-safe
