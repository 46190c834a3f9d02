"""One POST to etcd's v3 HTTP/JSON gateway, on a kept-alive ``http.client`` connection.

Why not ``requests`` (or ``etcd3gw`` over it) for these calls: at scale every agent's
keeper makes two requests a second, and ``requests`` spends about 0.5 ms of CPU on each
where ``http.client`` spends about 0.1 ms (measured here, benchmarks/scale.py): with
1,024 agents that is the difference between a store that keeps up and one that does
not. ``requests`` stays for the rare calls that gain from it (the version probe, watch
streams: ``etcd/client.py``).

Each thread has its own connection per endpoint (``http.client`` connections are not
thread-safe); a connection that failed is dropped, and the next call opens another.
"""

from __future__ import annotations

import http.client
import json
import ssl
import threading
from dataclasses import dataclass
from typing import Any

from elastic_ext.rendezvous.settings import Endpoint, Settings


@dataclass
class Reply:
    """What the gateway answered: the HTTP status and the body (JSON when status is 200)."""

    status: int
    body: bytes

    def json(self) -> dict[str, Any]:
        """The body as a JSON object. Raises ``ValueError`` when it is none."""
        doc = json.loads(self.body)
        if not isinstance(doc, dict):
            raise ValueError(f"expected a JSON object, got {type(doc).__name__}")
        return doc


class ConnectionFailed(Exception):
    """No answer: refused, reset, timed out or closed (the next endpoint may answer)."""


class TlsFailed(Exception):
    """The TLS handshake or the certificate check failed (retrying will not help)."""


class GatewayConnections:
    """Thread-safe: the connections are per thread."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._local = threading.local()
        self._ssl: ssl.SSLContext | None = None
        self._ssl_lock = threading.Lock()

    def _context(self) -> ssl.SSLContext:
        with self._ssl_lock:
            if self._ssl is None:
                tls = self._settings.tls
                context = ssl.create_default_context(cafile=tls.cacert or None)
                if tls.cert and tls.key:
                    context.load_cert_chain(tls.cert, tls.key)
                self._ssl = context
            return self._ssl

    def _connection(self, endpoint: Endpoint, timeout: float) -> http.client.HTTPConnection:
        pool: dict[str, http.client.HTTPConnection] = self._local.__dict__.setdefault("pool", {})
        key = str(endpoint)
        conn = pool.get(key)
        if conn is not None:
            conn.timeout = timeout  # the next connect's
            if conn.sock is not None:
                conn.sock.settimeout(timeout)
        else:
            if self._settings.scheme == "https":
                conn = http.client.HTTPSConnection(endpoint.host, endpoint.port, timeout=timeout,
                                                   context=self._context())
            else:
                conn = http.client.HTTPConnection(endpoint.host, endpoint.port, timeout=timeout)
            pool[key] = conn
        return conn

    def _drop(self, endpoint: Endpoint) -> None:
        conn = self._local.__dict__.get("pool", {}).pop(str(endpoint), None)
        if conn is not None:
            conn.close()

    def post(self, endpoint: Endpoint, path: str, payload: dict[str, Any],
             token: str | None = None, timeout: float | None = None) -> Reply:
        """POST ``payload`` as JSON to ``/v3<path>`` at ``endpoint``, given up after
        ``timeout`` seconds without an answer (default: ``request_timeout``).

        Raises:
            ConnectionFailed: no answer (the connection is dropped).
            TlsFailed: the TLS handshake or the certificate check failed.
        """
        headers = {"Content-Type": "application/json"}
        if token:
            headers["Authorization"] = token
        body = json.dumps(payload, separators=(",", ":"))
        conn = self._connection(endpoint, timeout if timeout is not None
                                else self._settings.timeouts.request)
        try:
            conn.request("POST", "/v3" + path, body=body, headers=headers)
            response = conn.getresponse()
            return Reply(response.status, response.read())
        except ssl.SSLError as exc:
            self._drop(endpoint)
            raise TlsFailed(str(exc)) from exc
        except (OSError, http.client.HTTPException) as exc:
            self._drop(endpoint)
            raise ConnectionFailed(f"{type(exc).__name__}: {exc}") from exc
