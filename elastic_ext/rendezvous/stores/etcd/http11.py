"""One kept-alive HTTP/1.1 connection, spoken by hand: a request in one send, an answer
read without the e-mail parser.

Every keeper makes a request a second, so its CPU is what an idle agent costs. Profiled,
``http.client`` spent as much on itself as on the socket: a request in two sends (its
headers, then its body: two system calls, and a small second segment that Nagle's
algorithm may hold for the peer's delayed acknowledgement) and each answer's headers
through ``email.parser``. etcd's gateway (Go's ``net/http``) answers with a status line,
a few headers, and a body of ``Content-Length`` bytes or in chunks; an HTTP/1.0 server
without a length ends its body by closing (the tests' stand-ins do).
"""

from __future__ import annotations

import socket
import ssl
from typing import BinaryIO

MAX_LINE = 64 * 1024
"""The longest status or header line read; a longer one is no gateway's."""


class ProtocolError(Exception):
    """The answer is not HTTP as the gateway speaks it (the connection is not reused)."""


class Connection:
    """Not thread-safe: one per thread and endpoint (``transport.GatewayConnections``).

    Raises ``OSError`` (refused, reset, timed out, closed) or ``ProtocolError``; after
    either the caller closes it and opens another.
    """

    def __init__(self, host: str, port: int, context: ssl.SSLContext | None,
                 authority: str) -> None:
        """``authority``: the ``Host`` header (``host:port``, an IPv6 host in brackets)."""
        self._host, self._port, self._context, self._authority = host, port, context, authority
        self._sock: socket.socket | None = None
        self._file: BinaryIO | None = None

    def ask(self, method: str, target: str, body: bytes, headers: dict[str, str],
            timeout: float) -> tuple[int, bytes]:
        """Send one request and read its answer: (status, body)."""
        sock, file = self._open(timeout)
        head = [f"{method} {target} HTTP/1.1", f"Host: {self._authority}",
                *(f"{name}: {value}" for name, value in headers.items())]
        if body or method == "POST":
            head.append(f"Content-Length: {len(body)}")
        sock.sendall("\r\n".join(head).encode("latin-1") + b"\r\n\r\n" + body)
        status_line = _line(file)
        parts = status_line.split(None, 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/") or not parts[1].isdigit():
            raise ProtocolError(f"not an HTTP status line: {status_line[:80]!r}")
        fields: dict[bytes, bytes] = {}
        while line := _line(file).rstrip(b"\r\n"):
            name, _, value = line.partition(b":")
            fields[name.strip().lower()] = value.strip()
        status = int(parts[1])
        answer = b"" if status in (204, 304) or status < 200 else _body(file, fields)
        if parts[0] == b"HTTP/1.0" or fields.get(b"connection", b"").lower() == b"close" \
                or b"content-length" not in fields and b"transfer-encoding" not in fields:
            self.close()
        return status, answer

    def _open(self, timeout: float) -> tuple[socket.socket, BinaryIO]:
        if self._sock is None or self._file is None:
            sock = socket.create_connection((self._host, self._port), timeout=timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._context is not None:
                sock = self._context.wrap_socket(sock, server_hostname=self._host)
            self._sock, self._file = sock, sock.makefile("rb")
        self._sock.settimeout(timeout)
        return self._sock, self._file

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._sock is not None:
            self._sock.close()
        self._sock = self._file = None


def _line(file: BinaryIO) -> bytes:
    line = file.readline(MAX_LINE + 1)
    if not line:
        raise ConnectionResetError("the server closed the connection")
    if len(line) > MAX_LINE:
        raise ProtocolError("a line longer than 64 KiB")
    return line


def _body(file: BinaryIO, fields: dict[bytes, bytes]) -> bytes:
    """The body after ``fields``: by its length, in chunks, or up to the close."""
    if fields.get(b"transfer-encoding", b"").lower() == b"chunked":
        chunks = []
        while size := _chunk_size(_line(file)):
            chunks.append(_exactly(file, size))
            _line(file)  # the CRLF after the chunk
        while _line(file).strip():  # trailers, up to the empty line
            pass
        return b"".join(chunks)
    if b"content-length" in fields:
        return _exactly(file, int(fields[b"content-length"]))
    return file.read()


def _chunk_size(line: bytes) -> int:
    try:
        return int(line.split(b";")[0].strip(), 16)
    except ValueError:
        raise ProtocolError(f"not a chunk size: {line[:40]!r}") from None


def _exactly(file: BinaryIO, size: int) -> bytes:
    data = file.read(size)
    if len(data) != size:
        raise ConnectionResetError("the server closed the connection within a body")
    return data
