"""A small etcd v3 client over etcd's HTTP/JSON gateway.

Why the gateway: etcd 3.4+ serves it by default, and speaking it needs no
grpcio/protobuf, whose pins break ML stacks (and broke the old ``etcd3`` package).
Every call goes through ``etcd/transport.py`` (``http.client``: kept alive per thread, a
watch stream on a connection of its own). Added here: rotation over several endpoints,
user/password auth with re-login when the token expires, TLS from our own settings
(never a machine-wide CA bundle), and the transactions the rendezvous needs.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import closing, contextmanager
from typing import Any

from tenacity import Retrying, retry_if_exception_type, stop_after_delay, wait_exponential

from elastic_ext.rendezvous.errors import ConfigError, StoreAuthError, StoreUnavailableError
from elastic_ext.rendezvous.settings import Settings
from elastic_ext.rendezvous.stores.etcd.latency import StoreLatency
from elastic_ext.rendezvous.stores.etcd.transport import (
    ConnectionFailed,
    GatewayConnections,
    TlsFailed,
)
from elastic_ext.rendezvous.stores.etcd.wire import (
    KeyValue,
    b64,
    batches,
    op_put,
    op_range,
    prefix_end,
    range_reply,
)

logger = logging.getLogger(__name__)

MIN_SERVER_VERSION = (3, 4)

MIN_REQUEST_S = 0.05
"""The shortest a request is given, however close its caller's deadline (``within``)."""


class _Transient(Exception):
    """An endpoint failed in a way the next endpoint (or a retry) may not."""


class _TokenExpired(Exception):
    pass


_TRANSIENT_STATUS = {408, 500, 503, 504}  # timeouts, an unavailable or failing member


class EtcdClient:
    """Thread-safe: each thread gets its own connections."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._gateway = GatewayConnections(settings)
        self._lock = threading.Lock()
        self._current = 0  # index of the endpoint that answered last
        self._token: str | None = None
        self._latency = [StoreLatency(settings.timeouts.request, settings.timeouts.connect,
                                      time.monotonic) for _ in settings.endpoints]
        self._local = threading.local()  # a thread's deadline (``within``)

    @contextmanager
    def within(self, seconds: float) -> Iterator[None]:
        """Every call this thread makes inside gives up ``seconds`` from now, its retries
        and a request the load gave a longer timeout included: a caller's own timeout (the
        round store's, which torch's agent waits on) holds whatever the load."""
        outer: float | None = getattr(self._local, "deadline", None)
        mine = time.monotonic() + seconds
        self._local.deadline = mine if outer is None else min(outer, mine)
        try:
            yield
        finally:
            self._local.deadline = outer

    def _left(self) -> float | None:
        """Seconds to this thread's deadline (``within``); None without one."""
        deadline: float | None = getattr(self._local, "deadline", None)
        return None if deadline is None else deadline - time.monotonic()

    def latency(self) -> StoreLatency:
        """How fast the endpoint that answered last answers this agent: each endpoint its
        own, so that a silent one does not slow the others' failover (``etcd/latency.py``)."""
        return self._latency[self._current]

    # -- plumbing ----------------------------------------------------------------------
    def _post_once(self, index: int, path: str, payload: dict[str, Any],
                   auth: bool = True) -> dict[str, Any]:
        endpoint = self._settings.endpoints[index]
        latency = self._latency[index]
        timeout, left = latency.request_timeout(), self._left()
        if left is not None:
            timeout = max(MIN_REQUEST_S, min(timeout, left))
        sent = time.monotonic()
        try:
            reply = self._gateway.post(endpoint, path, payload, self._token if auth else None,
                                       timeout=timeout)
        except TlsFailed as exc:
            raise StoreAuthError(f"TLS handshake with etcd at {endpoint} failed ({exc}); check "
                                 "--rdzv-conf cacert / cert / key") from exc
        except ConnectionFailed as exc:  # a timeout counts as an answer that slow
            latency.record(time.monotonic() - sent)
            raise _Transient(f"{endpoint}: {exc}") from exc
        latency.record(time.monotonic() - sent)
        if reply.status == 200:
            try:
                return reply.json()
            except ValueError as exc:  # not JSON: not an etcd gateway
                raise StoreUnavailableError(
                    f"{endpoint} did not answer like etcd's v3 gateway ({exc}); is this an "
                    "etcd >= 3.4 client URL?") from exc
        detail = reply.body.decode(errors="replace")
        if reply.status in _TRANSIENT_STATUS:
            raise _Transient(f"{endpoint}: HTTP {reply.status} {detail.strip()}")
        if "invalid auth token" in detail or "auth: revision" in detail:
            raise _TokenExpired(detail)
        if "permission denied" in detail or "authentication failed" in detail \
                or "user name is empty" in detail or "user name not found" in detail:
            raise StoreAuthError(
                f"etcd at {endpoint} refused the request ({detail.strip()}); check "
                "--rdzv-conf user / password_env / password_file and that the user's "
                "role may read and write the run's key prefix")
        if "etcdserver: request timed out" in detail or "leader changed" in detail \
                or "no leader" in detail:
            raise _Transient(f"{endpoint}: {detail}")
        if "404 page not found" in detail:
            raise StoreUnavailableError(
                f"etcd at {endpoint} does not serve the v3 API's HTTP gateway ({path}: 404). "
                "etcd-ext needs etcd >= 3.4 with its gRPC gateway enabled (the default; "
                "check for --enable-grpc-gateway=false)")
        raise StoreUnavailableError(f"etcd at {endpoint} answered HTTP {reply.status} "
                                    f"{detail.strip()}")

    def _authenticate(self, index: int) -> None:
        if not self._settings.user:
            raise StoreAuthError("etcd asks for authentication: set --rdzv-conf user=... and "
                                 "its password through password_env or password_file")
        reply = self._post_once(index, "/auth/authenticate",
                                {"name": self._settings.user,
                                 "password": self._settings.password or ""}, auth=False)
        self._token = reply.get("token")

    def call(self, path: str, payload: dict[str, Any],
             deadline: float | None = None) -> dict[str, Any]:
        """POST to the first endpoint that answers, rotating and retrying until ``deadline``."""
        endpoints = self._settings.endpoints
        errors: list[str] = []

        def attempt() -> dict[str, Any]:
            index = self._current
            try:
                if self._settings.user and self._token is None:
                    self._authenticate(index)
                try:
                    return self._post_once(index, path, payload)
                except _TokenExpired:
                    self._token = None
                    self._authenticate(index)
                    return self._post_once(index, path, payload)
            except _Transient as exc:
                errors.append(str(exc))
                with self._lock:
                    if self._current == index:
                        self._current = (index + 1) % len(endpoints)
                raise

        limit = deadline if deadline is not None else self._settings.timeouts.connect
        left = self._left()
        if left is not None:
            limit = min(limit, left)
        began = time.monotonic()
        try:  # the usual case, without building a retry loop: at 256 forked agents on etcd
            # a round change cost each agent 20.9 ms of CPU with one per call, 17.9 without
            return attempt()
        except _Transient:
            pass
        first_wait = self.latency().first_retry_wait()  # waits and timeouts follow the load
        retrying = Retrying(
            stop=stop_after_delay(max(0.0, limit - (time.monotonic() - began))),
            wait=wait_exponential(multiplier=first_wait, max=max(0.5, 4 * first_wait)),
            retry=retry_if_exception_type(_Transient), reraise=True)
        try:
            return retrying(attempt)
        except _Transient as exc:
            tried = ", ".join(str(ep) for ep in endpoints)
            raise StoreUnavailableError(
                f"no etcd endpoint answered within {self._settings.timeouts.connect:g}s "
                f"(tried {tried}; last error: {errors[-1] if errors else exc}). Check "
                "--rdzv-endpoint, that etcd is running, and firewalls") from exc

    # -- the operations the rendezvous needs -------------------------------------------
    def server_version(self) -> str:
        """Fails clearly on something that is not an etcd >= 3.4 serving the v3 gateway.
        Every endpoint is asked again until ``connect_timeout``: at a large job's start a
        busy etcd answers some agents late, and one slow answer must not end an agent."""
        last: list[Exception] = []

        def ask_each() -> str:
            slow = False
            for index, ep in enumerate(self._settings.endpoints):
                try:
                    reply = self._gateway.get(ep, "/version")
                    version = reply.json()["etcdserver"] if reply.status == 200 else None
                except TlsFailed as exc:
                    raise StoreAuthError(f"TLS handshake with etcd at {ep} failed ({exc}); "
                                         "check --rdzv-conf cacert / cert / key") from exc
                except ConnectionFailed as exc:  # slow, or not up
                    last.append(exc)
                    slow = True
                    continue
                except (ValueError, KeyError) as exc:  # it answered, and not as etcd
                    last.append(exc)
                    continue
                if not isinstance(version, str):
                    last.append(ValueError(f"HTTP {reply.status} from {ep}/version"))
                    continue
                parts = tuple(int(p) for p in version.split(".")[:2] if p.isdigit())
                if parts < MIN_SERVER_VERSION:
                    raise ConfigError(f"etcd at {ep} is version {version}; etcd-ext needs the "
                                      "v3 API of etcd >= 3.4 (its HTTP gateway)")
                self._current = index
                return version
            if slow:
                raise _Transient(str(last[-1]))
            raise StoreUnavailableError(
                f"no etcd answered at {self._settings.describe_endpoints()} ({last[-1]}); "
                "check --rdzv-endpoint and that etcd is running")

        retrying = Retrying(stop=stop_after_delay(self._settings.timeouts.connect),
                            wait=wait_exponential(multiplier=0.1, max=1.0),
                            retry=retry_if_exception_type(_Transient), reraise=True)
        try:
            return retrying(ask_each)
        except _Transient as exc:
            raise StoreUnavailableError(
                f"no etcd answered at {self._settings.describe_endpoints()} ({last[-1]}); "
                "check --rdzv-endpoint and that etcd is running") from exc

    def get(self, key: str) -> KeyValue | None:
        kvs, _ = self.read_range(key)
        return kvs[0] if kvs else None

    def get_prefix(self, prefix: str) -> list[KeyValue]:
        return self.read_range(prefix, prefix=True)[0]

    def put(self, key: str, value: bytes, lease: int | None = None) -> int:
        payload: dict[str, Any] = {"key": b64(key), "value": b64(value)}
        if lease:
            payload["lease"] = str(lease)
        return int(self.call("/kv/put", payload)["header"]["revision"])

    def delete_prefix(self, prefix: str) -> None:
        raw = prefix.encode()
        self.call("/kv/deleterange", {"key": b64(raw), "range_end": b64(prefix_end(raw))})

    def delete(self, key: str) -> None:
        self.call("/kv/deleterange", {"key": b64(key)})

    def compare_and_swap(self, key: str, value: bytes, mod_revision: int | None,
                         lease: int | None = None, also: Sequence[dict[str, Any]] = ()
                         ) -> tuple[bool, KeyValue | None]:
        """Write ``value`` iff the key is at ``mod_revision`` (None: iff it does not exist),
        and with it the operations ``also`` (``etcd.wire.op_put``, ``op_delete``).

        One transaction; returns (succeeded, the key as it is now).
        """
        compare: dict[str, Any] = {"key": b64(key), "target": "MOD" if mod_revision else "CREATE",
                                   "result": "EQUAL"}
        if mod_revision:
            compare["mod_revision"] = str(mod_revision)
        else:
            compare["create_revision"] = "0"
        put: dict[str, Any] = {"key": b64(key), "value": b64(value)}
        if lease:
            put["lease"] = str(lease)
        txn = {"compare": [compare], "success": [{"request_put": put}, *also],
               "failure": [{"request_range": {"key": b64(key)}}]}
        reply = self.call("/kv/txn", txn)
        if reply.get("succeeded"):
            return True, KeyValue(key.encode(), value, int(reply["header"]["revision"]))
        for response in reply.get("responses") or []:
            kvs = (response.get("response_range") or {}).get("kvs") or []
            if kvs:
                return False, KeyValue.from_reply(kvs[0])
        return False, None

    def put_if_exists(self, key: str, value: bytes, guard: str) -> bool:
        """Write ``value`` iff the key ``guard`` exists, in one transaction; whether it did."""
        compare = {"key": b64(guard), "target": "VERSION", "result": "GREATER", "version": "0"}
        txn = {"compare": [compare],
               "success": [{"request_put": {"key": b64(key), "value": b64(value)}}]}
        return bool(self.call("/kv/txn", txn).get("succeeded"))

    def multi_get(self, keys: Sequence[str]) -> list[KeyValue | None]:
        """Each of ``keys``, None where absent: one transaction per ``MAX_TXN_OPS`` keys
        (torch's rank 0 reads every agent's key at once)."""
        found = [range_reply(r)[0] for batch in batches(keys)
                 for r in self.txn([op_range(k) for k in batch])]
        return [kvs[0] if kvs else None for kvs in found]

    def multi_put(self, items: Sequence[tuple[str, bytes]]) -> None:
        """Atomic up to ``MAX_TXN_OPS`` items; more go in one transaction per batch."""
        for batch in batches(items):
            self.txn([op_put(k, v) for k, v in batch])

    def txn(self, operations: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """Run ``operations`` (``op_put``, ``op_range``, ``op_delete``) in one transaction,
        atomically and in one round trip; their replies, in order."""
        if not operations:
            return []
        reply = self.call("/kv/txn", {"success": list(operations)})
        return list(reply.get("responses") or [])

    def revision_of(self, key: str) -> int | None:
        """The key's ``mod_revision`` without its value; None if it does not exist."""
        reply = self.call("/kv/range", {"key": b64(key), "keys_only": True})
        kvs = reply.get("kvs") or []
        return int(kvs[0]["mod_revision"]) if kvs else None

    def watch(self, key: str, start_revision: int, idle_timeout: float,
              stop: threading.Event, *, prefix: bool = False,
              on_created: Callable[[], None] | None = None
              ) -> Iterator[tuple[int, bytes, KeyValue | None]]:
        """Each change of ``key`` (``prefix``: of the keys under it) from ``start_revision``
        on (0: from now), as (revision, key, new value or None when deleted or its lease
        expired), through one watch stream of the gateway; ``on_created`` is called once
        etcd has the watch in place. Ends when the stream ends, nothing came for
        ``idle_timeout`` seconds, or ``stop`` is set. A start in the past costs etcd a
        look through its history for every such watch, at every change, until it caught up.

        Raises:
            StoreUnavailableError: the watch could not be opened or broke.
        """
        endpoint = self._settings.endpoints[self._current]
        create: dict[str, Any] = {"key": b64(key), "start_revision": str(start_revision)}
        if prefix:
            create["range_end"] = b64(prefix_end(key.encode()))
        lines = self._gateway.stream(endpoint, "/watch", {"create_request": create},
                                     self._token, self.latency().request_timeout(),
                                     idle_timeout)
        try:
            with closing(lines):
                for line in lines:
                    if stop.is_set():
                        return
                    result = json.loads(line).get("result") or {}
                    if result.get("canceled") or result.get("compact_revision"):
                        return  # the caller reads the key again and watches anew
                    if result.get("created") and on_created is not None:
                        on_created()
                    for event in result.get("events") or []:
                        kv = KeyValue.from_reply(event["kv"])
                        yield kv.mod_revision, kv.key, \
                            None if event.get("type") == "DELETE" else kv
        except (ConnectionFailed, TlsFailed, ValueError, KeyError, TypeError) as exc:
            raise StoreUnavailableError(f"watch of {key} at {endpoint} failed: {exc}") from exc

    def read_range(self, key: str, *, prefix: bool = False) -> tuple[list[KeyValue], int]:
        """The key (with ``prefix``: every key under it) and the store's revision when it
        was read: where a watch of the same keys starts."""
        payload = {"key": b64(key)}
        if prefix:
            payload["range_end"] = b64(prefix_end(key.encode()))
        reply = self.call("/kv/range", payload)
        return ([KeyValue.from_reply(kv) for kv in reply.get("kvs") or []],
                int(reply["header"]["revision"]))

    def lease_grant(self, ttl: int) -> tuple[int, int]:
        """A new lease: (its id, the TTL etcd granted; never less than the cluster's minimum,
        1.5 election timeouts rounded up: 2 s with etcd's defaults)."""
        reply = self.call("/lease/grant", {"TTL": str(ttl), "ID": "0"})
        return int(reply["ID"]), int(reply.get("TTL", ttl))

    def lease_keepalive(self, lease: int) -> int:
        """Renew ``lease``; its TTL again, or 0 when the lease is gone (expired or revoked:
        etcd answers a keep-alive of an unknown lease with TTL 0, not with an error). Not a
        write: the leader answers it without Raft. The gateway cannot hold etcd's
        keep-alive stream open (etcd-io/etcd#8237), so each is one request."""
        reply = self.call("/lease/keepalive", {"ID": str(lease)})
        return int((reply.get("result") or reply).get("TTL", 0))

    def lease_revoke(self, lease: int) -> None:
        """Ends the lease and deletes the keys attached to it."""
        self.call("/lease/revoke", {"ID": str(lease)})
