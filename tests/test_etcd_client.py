"""The etcd v3 client against real etcd servers: transactions, endpoint lists, failover."""

from __future__ import annotations

import threading
import time

import pytest

from elastic_ext.rendezvous.errors import ConfigError, StoreUnavailableError
from elastic_ext.rendezvous.stores.etcd.client import EtcdClient
from elastic_ext.rendezvous.stores.etcd.round_store import add
from tests.support.stores import settings_for

pytestmark = pytest.mark.etcd


def test_compare_and_swap_on_mod_revision_with_create_if_absent(etcd):
    client = EtcdClient(settings_for(etcd.members[0].endpoint))
    ok, kv = client.compare_and_swap("/t/k", b"v1", None)
    assert ok and kv is not None
    again, current = client.compare_and_swap("/t/k", b"other", None)
    assert not again and current is not None and current.value == b"v1"
    ok2, kv2 = client.compare_and_swap("/t/k", b"v2", kv.mod_revision)
    stale, now = client.compare_and_swap("/t/k", b"v3", kv.mod_revision)
    assert ok2 and kv2 is not None and not stale and now is not None
    assert now.value == b"v2" and now.mod_revision == kv2.mod_revision


def test_concurrent_increments_by_compare_and_swap_lose_nothing(etcd):
    client = EtcdClient(settings_for(etcd.members[0].endpoint))

    def bump():
        for _ in range(25):
            add(client, "/t/counter", 1)
    threads = [threading.Thread(target=bump) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    counter = client.get("/t/counter")
    assert counter is not None and counter.value == b"100"


def test_a_dead_endpoint_in_the_list_is_skipped(etcd):
    from elastic_ext.net import free_port
    dead = f"127.0.0.1:{free_port()}"
    client = EtcdClient(settings_for(f"{dead},{etcd.members[0].endpoint}"))
    assert client.compare_and_swap("/t/x", b"1", None)[0]


def test_unreachable_endpoints_fail_within_the_deadline_naming_them():
    from elastic_ext.net import free_port
    dead = f"127.0.0.1:{free_port()}"
    client = EtcdClient(settings_for(dead, connect_timeout="1"))
    started = time.monotonic()
    with pytest.raises(StoreUnavailableError, match=dead):
        client.get("/t/x")
    assert time.monotonic() - started < 5


def test_server_version_check_refuses_something_that_is_not_etcd(processes, tmp_path):
    import http.server
    import socketserver

    class NotEtcd(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b'{"etcdserver": "3.2.0", "etcdcluster": "3.2.0"}')

        def log_message(self, *args):
            pass
    with socketserver.TCPServer(("127.0.0.1", 0), NotEtcd) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        client = EtcdClient(settings_for(f"127.0.0.1:{server.server_address[1]}"))
        with pytest.raises(ConfigError, match="3.2.0.*needs the v3 API"):
            client.server_version()
        server.shutdown()


def test_a_version_answer_late_once_is_asked_again_not_a_failed_start():
    """1,024 agents starting at once: a busy etcd answered some agents' version check
    after the request timeout, and those agents failed to start."""
    import http.server
    import socketserver

    asked: list[float] = []

    class SlowOnce(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            asked.append(time.monotonic())
            if len(asked) == 1:
                time.sleep(2.0)  # past request_timeout=1
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b'{"etcdserver": "3.4.23", "etcdcluster": "3.4.0"}')

        def log_message(self, *args):
            pass
    with socketserver.ThreadingTCPServer(("127.0.0.1", 0), SlowOnce) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        client = EtcdClient(settings_for(f"127.0.0.1:{server.server_address[1]}",
                                         request_timeout="1", connect_timeout="10"))
        assert client.server_version() == "3.4.23"
        assert len(asked) == 2
        server.shutdown()


def test_compare_and_swap_succeeds_again_within_5s_after_the_leader_is_killed(etcd_cluster):
    client = EtcdClient(settings_for(etcd_cluster.endpoints))
    ok, kv = client.compare_and_swap("/t/lead", b"0", None)
    assert ok and kv is not None
    leader = etcd_cluster.leader()
    etcd_cluster.stop_member(leader)
    killed = time.monotonic()
    revision = kv.mod_revision
    while True:
        current = client.get("/t/lead")
        assert current is not None
        ok, kv = client.compare_and_swap("/t/lead", b"1", current.mod_revision)
        if ok:
            break
    elapsed = time.monotonic() - killed
    assert kv is not None and kv.mod_revision > revision
    assert elapsed < 5.0, f"first CAS after the leader kill took {elapsed:.2f}s"
