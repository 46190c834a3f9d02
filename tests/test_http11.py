"""The hand-spoken HTTP/1.1 connection (``stores/etcd/http11.py``) against crafted answers:
each framing the gateway or a stand-in uses, a connection the server closes, and an answer
that is not HTTP."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest

from elastic_ext.rendezvous.stores.etcd.http11 import Connection, ProtocolError


class Server:
    """Answers each request on a connection with the next of ``answers`` (raw bytes); a
    None next closes the connection. Records the requests it read."""

    def __init__(self, answers: list[bytes | None]) -> None:
        self.answers = list(answers)
        self.requests: list[bytes] = []
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while self.answers:
            conn, _ = self.sock.accept()
            with conn:
                while self.answers:
                    request = conn.recv(65536)
                    if not request:
                        break
                    self.requests.append(request)
                    answer = self.answers.pop(0)
                    if answer is not None:
                        conn.sendall(answer)
                    if answer is None or self.answers and self.answers[0] is None:
                        if answer is not None:
                            self.answers.pop(0)
                        break


@pytest.fixture
def serve() -> Iterator[type[Server]]:
    yield Server


def ask(server: Server, conn: Connection | None = None) -> tuple[int, bytes]:
    conn = conn or Connection("127.0.0.1", server.port, None, f"127.0.0.1:{server.port}")
    return conn.ask("POST", "/v3/kv/range", b'{"key":"YQ=="}', {"X-A": "1"}, timeout=5.0)


def test_a_request_goes_in_one_send_and_a_length_framed_answer_is_read(serve) -> None:
    server = serve([b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    b"Content-Length: 7\r\n\r\n{\"a\":1}"])
    assert ask(server) == (200, b'{"a":1}')
    request = server.requests[0]
    assert request.startswith(b"POST /v3/kv/range HTTP/1.1\r\nHost: 127.0.0.1:")
    assert b"\r\nX-A: 1\r\nContent-Length: 14\r\n\r\n{\"key\":\"YQ==\"}" in request


def test_a_chunked_answer_is_joined_and_the_connection_kept(serve) -> None:
    server = serve([b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                    b"4\r\n{\"a\"\r\n3;ext=1\r\n:1}\r\n0\r\nTrailer: x\r\n\r\n",
                    b"HTTP/1.1 404 Not Found\r\nContent-Length: 3\r\n\r\nno\n"])
    conn = Connection("127.0.0.1", server.port, None, "h")
    assert ask(server, conn) == (200, b'{"a":1}')
    assert ask(server, conn) == (404, b"no\n")  # the same connection
    assert len(server.requests) == 2


def test_an_http_1_0_answer_without_a_length_ends_at_the_close(serve) -> None:
    server = serve([b"HTTP/1.0 200 OK\r\nServer: x\r\n\r\n{\"etcdserver\": \"3.4.23\"}", None])
    assert ask(server) == (200, b'{"etcdserver": "3.4.23"}')


def test_a_kept_alive_connection_the_server_closed_fails_clearly(serve) -> None:
    """The caller drops it and asks again on a new one (``transport.GatewayConnections``)."""
    server = serve([b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}", None,
                    b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}"])
    conn = Connection("127.0.0.1", server.port, None, "h")
    assert ask(server, conn) == (200, b"{}")  # then the server closes, idle
    with pytest.raises(OSError):
        ask(server, conn)
    conn.close()
    assert ask(server, conn) == (200, b"{}")  # reopened


@pytest.mark.parametrize("answer", [b"SSH-2.0-OpenSSH_9.6\r\n\r\n",
                                    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"])
def test_an_answer_that_is_not_http_is_a_protocol_error(serve, answer: bytes) -> None:
    server = serve([answer, None])
    with pytest.raises(ProtocolError):
        ask(server)
