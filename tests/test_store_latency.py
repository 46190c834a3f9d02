"""Request timeouts and retry waits that follow etcd's measured answer time
(``stores/etcd/latency.py``): a slow store is waited for, not asked again and again."""

from __future__ import annotations

import http.server
import socketserver
import threading
import time
from collections.abc import Iterator

import pytest

from elastic_ext.rendezvous.stores.etcd.client import EtcdClient
from elastic_ext.rendezvous.stores.etcd.latency import (
    FIRST_WAIT_S,
    HALF_LIFE_S,
    TIMEOUT_MULTIPLE,
    StoreLatency,
)
from tests.support.stores import settings_for


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_timeout_is_the_configured_one_while_the_store_answers_fast() -> None:
    latency = StoreLatency(2.0, 15.0, _Clock())
    latency.record(0.01)
    assert latency.request_timeout() == 2.0
    assert latency.first_retry_wait() == FIRST_WAIT_S


def test_a_slow_answer_lengthens_the_timeout_and_the_retry_waits_up_to_the_ceiling() -> None:
    latency = StoreLatency(2.0, 15.0, _Clock())
    latency.record(1.5)
    assert latency.request_timeout() == pytest.approx(TIMEOUT_MULTIPLE * 1.5)
    assert latency.first_retry_wait() == pytest.approx(0.75)
    latency.record(10.0)  # a request given up after its timeout counts as that slow
    assert latency.request_timeout() == 15.0


def test_the_slowest_answer_is_forgotten_by_halves_so_the_agent_speeds_up_again() -> None:
    clock = _Clock()
    latency = StoreLatency(0.5, 15.0, clock)
    latency.record(2.0)
    clock.now += HALF_LIFE_S
    assert latency.slowest == pytest.approx(1.0)
    latency.record(0.1)  # a faster answer does not erase the slow one at once
    assert latency.slowest == pytest.approx(1.0)
    clock.now += 4 * HALF_LIFE_S
    assert latency.request_timeout() == 0.5


class _SlowGateway(http.server.BaseHTTPRequestHandler):
    """etcd's gateway answering every range read after ``delay`` seconds."""

    delay = 1.2
    asked: list[float] = []

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        type(self).asked.append(time.monotonic())
        time.sleep(self.delay)
        body = b'{"header": {"revision": "7"}, "kvs": []}'
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def slow_gateway() -> Iterator[str]:
    _SlowGateway.asked = []
    with socketserver.ThreadingTCPServer(("127.0.0.1", 0), _SlowGateway) as server:
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
        yield f"127.0.0.1:{server.server_address[1]}"
        server.shutdown()


def test_a_store_slower_than_the_request_timeout_is_waited_for_not_asked_again_and_again(
        slow_gateway: str) -> None:
    """Before, every request outlasting ``request_timeout`` was dropped and sent again until
    ``connect_timeout``: a 1.2 s store with a 0.5 s timeout was asked ~15 times in 10 s and
    never answered."""
    client = EtcdClient(settings_for(slow_gateway, request_timeout="0.5",
                                     connect_timeout="10"))
    began = time.monotonic()
    assert client.get("/t/k") is None
    assert len(_SlowGateway.asked) == 2  # one given up at 0.5 s, one waited for (2 s)
    assert time.monotonic() - began < 4.0
    assert client.latency().request_timeout() >= 2.0
    asked = len(_SlowGateway.asked)
    assert client.get("/t/k") is None  # the next request waits from the start
    assert len(_SlowGateway.asked) == asked + 1
