"""Broken and hostile inputs that need a live process or server to show their error.

The pure ones (conf values, endpoints, state parsing) are in test_settings.py and
test_state.py; docs/errors.md lists every case with the test that covers it.
"""

from __future__ import annotations

import http.server
import socketserver
import threading
import time

import pytest

from elastic_ext.local.etcd import start_cluster
from elastic_ext.net import free_port
from elastic_ext.rendezvous.errors import CorruptStateError, StoreUnavailableError
from elastic_ext.rendezvous.protocol.state import MAX_STATE_BYTES
from elastic_ext.rendezvous.stores.etcd.backend import EtcdBackend
from tests.support.agents import ALLREDUCE_JOB, torchrun
from tests.support.stores import plant_etcd_state, settings_for


@pytest.mark.etcd
@pytest.mark.timeout(120)
def test_etcd_without_the_v3_gateway_is_named_as_such(processes, tmp_path):
    etcd = start_cluster(processes, tmp_path, size=1,
                         extra_args=["--enable-grpc-gateway=false", "--enable-v2=true"])
    backend = EtcdBackend(settings_for(etcd.members[0].endpoint))
    with pytest.raises(StoreUnavailableError, match="does not serve the v3 API's HTTP gateway"):
        backend.get_state()


@pytest.mark.timeout(60)
def test_a_port_that_is_not_etcd_is_reported_as_not_etcd():
    class Html(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"<html>hello</html>")
        do_POST = do_GET

        def log_message(self, *args):
            pass
    with socketserver.TCPServer(("127.0.0.1", 0), Html) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        endpoint = f"127.0.0.1:{server.server_address[1]}"
        began = time.monotonic()
        with pytest.raises(StoreUnavailableError, match=f"no etcd answered at http://{endpoint}"):
            EtcdBackend.connect(settings_for(endpoint))
        # at once: an answer that is not etcd's is not asked again (a slow one is)
        assert time.monotonic() - began < 2.0
        server.shutdown()


@pytest.mark.timeout(60)
def test_an_oversized_state_value_is_refused_by_the_agent(processes, etcd):
    endpoint = etcd.members[0].endpoint
    settings = settings_for(endpoint, "big")
    backend = EtcdBackend(settings)
    plant_etcd_state(settings, b"elastic-ext/1\n" + b" " * (MAX_STATE_BYTES + 10))
    with pytest.raises(CorruptStateError, match="over the"):
        from elastic_ext.rendezvous.protocol.state import RunState
        current = backend.get_state()
        assert current is not None
        RunState.from_bytes(current[0])
    p = torchrun(processes, "big", endpoint=endpoint, run_id="big", nnodes="1:1",
                 script=[str(ALLREDUCE_JOB)], conf="join_timeout=10")
    assert p.wait(timeout=60) != 0 and "over the 1048576 limit" in p.output()


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_zero_nodes_is_refused_before_anything_waits(processes):
    p = torchrun(processes, "zero", endpoint=f"127.0.0.1:{free_port()}", run_id="z", nnodes="0:2",
                 script=[str(ALLREDUCE_JOB)])
    assert p.wait(timeout=40) != 0
    assert "min_nodes must be > 0" in p.output()


@pytest.mark.timeout(60)
def test_negative_timeout_on_the_command_line_names_the_key(processes, etcd):
    p = torchrun(processes, "neg", endpoint=etcd.members[0].endpoint, run_id="neg", nnodes="1:1",
                 script=[str(ALLREDUCE_JOB)], conf="last_call_timeout=-1")
    assert p.wait(timeout=40) != 0
    assert "--rdzv-conf last_call_timeout='-1' must be a finite number >= 0" in p.output()
