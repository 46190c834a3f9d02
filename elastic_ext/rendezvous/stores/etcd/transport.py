"""etcd's v3 HTTP/JSON gateway: a POST or a GET on a kept-alive connection, and a watch
stream on a connection of its own.

Why not ``requests`` (or ``etcd3gw`` over it): at scale every agent's keeper makes a
request a second, and ``requests`` spends about 0.5 ms of CPU on each where
``http.client`` spends about 0.1 ms (measured here, benchmarks/scale.py): with 1,024
agents that is the difference between a store that keeps up and one that does not. The
version probe and the watch streams went through ``requests`` too, until a profile of
forked agents (one process each, as on real machines) found the first ``requests`` call
of each process, a session per thread, about a fifth of an agent's CPU for its first
round. The unary calls are spoken by hand (``http11.py``: one send a request, no e-mail
parser for the answer's headers); the rare watch streams use ``http.client``.

Each thread has its own connection per endpoint (a connection serves one request at a
time); a connection that failed is dropped, and the next call opens another.
"""

from __future__ import annotations

import http.client
import json
import ssl
import threading
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

from elastic_ext.rendezvous.settings import Endpoint, Settings
from elastic_ext.rendezvous.stores.etcd.http11 import Connection, ProtocolError


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

    def _new_connection(self, endpoint: Endpoint, timeout: float) -> http.client.HTTPConnection:
        if self._settings.scheme == "https":
            return http.client.HTTPSConnection(endpoint.host, endpoint.port, timeout=timeout,
                                               context=self._context())
        return http.client.HTTPConnection(endpoint.host, endpoint.port, timeout=timeout)

    def _connection(self, endpoint: Endpoint) -> Connection:
        pool: dict[str, Connection] = self._local.__dict__.setdefault("pool", {})
        key = str(endpoint)
        conn = pool.get(key)
        if conn is None:
            context = self._context() if self._settings.scheme == "https" else None
            conn = pool[key] = Connection(endpoint.host, endpoint.port, context, key)
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
        body = json.dumps(payload, separators=(",", ":"))
        return self._ask(endpoint, "POST", "/v3" + path, body, _headers(token), timeout)

    def get(self, endpoint: Endpoint, path: str, timeout: float | None = None) -> Reply:
        """GET ``path`` at ``endpoint`` (etcd's ``/version``); raises as ``post`` does."""
        return self._ask(endpoint, "GET", path, None, {}, timeout)

    def _ask(self, endpoint: Endpoint, method: str, url: str, body: str | None,
             headers: dict[str, str], timeout: float | None) -> Reply:
        conn = self._connection(endpoint)
        try:
            status, answer = conn.ask(method, url, (body or "").encode(), headers,
                                      timeout if timeout is not None
                                      else self._settings.timeouts.request)
            return Reply(status, answer)
        except ssl.SSLError as exc:
            self._drop(endpoint)
            raise TlsFailed(str(exc)) from exc
        except (OSError, ProtocolError) as exc:
            self._drop(endpoint)
            raise ConnectionFailed(f"{type(exc).__name__}: {exc}") from exc

    def stream(self, endpoint: Endpoint, path: str, payload: dict[str, Any],
               token: str | None, connect_timeout: float, idle_timeout: float
               ) -> Generator[bytes, None, None]:
        """POST ``payload`` to ``/v3<path>`` on a connection of its own and yield each
        non-empty line of the answer as it arrives (a watch stream), until the stream ends
        or nothing came for ``idle_timeout`` seconds (then it just ends).

        Raises:
            ConnectionFailed: no answer, a broken stream, or an HTTP status other than 200.
            TlsFailed: the TLS handshake or the certificate check failed.
        """
        conn = self._new_connection(endpoint, connect_timeout)
        try:
            conn.request("POST", "/v3" + path, body=json.dumps(payload, separators=(",", ":")),
                         headers=_headers(token))
            response = conn.getresponse()
            if response.status != 200:
                raise ConnectionFailed(f"HTTP {response.status} "
                                       f"{response.read()[:200].decode(errors='replace')}")
            if conn.sock is not None:
                conn.sock.settimeout(idle_timeout)
            while True:
                try:
                    line = response.readline()
                except TimeoutError:
                    return  # idle: the caller reads again and watches anew
                if not line:
                    return
                if line.strip():
                    yield line
        except ssl.SSLError as exc:
            raise TlsFailed(str(exc)) from exc
        except (OSError, http.client.HTTPException) as exc:
            raise ConnectionFailed(f"{type(exc).__name__}: {exc}") from exc
        finally:
            conn.close()


def _headers(token: str | None) -> dict[str, str]:
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = token
    return headers
