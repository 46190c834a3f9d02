"""Prometheus metrics of an agent (``--rdzv-conf metrics_port``): scraped over HTTP from an
agent in this process, then from real torchrun agents on etcd."""

from __future__ import annotations

import socket
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from torch.distributed.elastic.rendezvous import RendezvousParameters, rendezvous_handler_registry

from elastic_ext.jsonlines import read_json_lines
from elastic_ext.local.job import JobSpec, LocalJob, wait_for_step
from elastic_ext.local.processes import wait_until
from elastic_ext.net import free_port
from elastic_ext.rendezvous.agent import keeper as keeper_module
from elastic_ext.rendezvous.agent.events import EventKind
from elastic_ext.rendezvous.agent.handler import EtcdExtRendezvousHandler
from elastic_ext.rendezvous.agent.prometheus import AgentMetrics, MeasuredBackend
from elastic_ext.rendezvous.errors import ConfigError, StoreUnavailableError
from elastic_ext.rendezvous.protocol.pace import Pace
from tests.support.memory_backend import MemoryBackend, MemoryStore

LOOP_JOB = str(Path(__file__).parent / "support" / "loop_job.py")

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(port: int) -> Samples:
    """Every sample ``/metrics`` serves, keyed by (name, sorted labels)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[tuple[EtcdExtRendezvousHandler, int]]:
    """An agent made by torch's registry with metrics on any free port, after one round."""
    events = tmp_path / "events.jsonl"
    params = RendezvousParameters(
        backend="etcd-ext", endpoint=f"c10d://127.0.0.1:{free_port('127.0.0.1')}",
        run_id="prom", min_nodes=1, max_nodes=1, local_addr="127.0.0.1",
        events_file=str(events), metrics_port="0")
    handler = rendezvous_handler_registry.create_handler(params)
    assert isinstance(handler, EtcdExtRendezvousHandler)
    handler.next_rendezvous()
    port = read_json_lines(events)[0]["metrics_port"]
    try:
        yield handler, port
    finally:
        handler.shutdown()
    with pytest.raises(OSError):  # the server went with the agent
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


def test_an_agent_serves_its_round_budget_and_store_requests(agent) -> None:
    _, port = agent
    samples = scrape(port)
    assert value(samples, "elastic_ext_round", run_id="prom") == 1
    assert value(samples, "elastic_ext_members", run_id="prom") == 1
    assert value(samples, "elastic_ext_rounds_total", run_id="prom", reason="start") == 1
    assert value(samples, "elastic_ext_restarts_used", run_id="prom") == 0
    assert value(samples, "elastic_ext_restarts_left", run_id="prom") == float("inf")
    assert value(samples, "elastic_ext_last_round_close_timestamp_seconds", run_id="prom") > 0
    for operation in ("get_state", "set_state", "beat", "keeper_read"):
        assert value(samples, "elastic_ext_store_request_duration_seconds_count",
                     run_id="prom", operation=operation) >= 1


def test_failed_requests_and_peer_heartbeats_are_counted() -> None:
    metrics = AgentMetrics("run1")
    store = MemoryStore()
    backend = MeasuredBackend(MemoryBackend(store), metrics)
    backend.beat("peer")
    store.down = True
    with pytest.raises(StoreUnavailableError):
        backend.get_state()
    get = metrics.registry.get_sample_value
    assert get("elastic_ext_store_request_errors_total",
               {"run_id": "run1", "operation": "get_state"}) == 1
    assert get("elastic_ext_store_request_duration_seconds_count",
               {"run_id": "run1", "operation": "beat"}) == 1
    metrics.watch_peers(lambda: {"peer-a": 0.5, "peer-b": 2.75})
    assert get("elastic_ext_peer_heartbeat_age_seconds", {"run_id": "run1", "peer": "peer-b"}) \
        == 2.75
    metrics.on_event(EventKind.NODE_DEAD, {"peer": "peer-b"})
    metrics.on_event(EventKind.BUDGET_SPENT, {"note": "spent"})
    assert get("elastic_ext_nodes_lost_total", {"run_id": "run1", "how": "dead"}) == 1
    assert get("elastic_ext_restarts_left", {"run_id": "run1"}) == 0


def test_this_nodes_pace_and_the_stragglers_it_named_are_served() -> None:
    metrics = AgentMetrics("run1")
    get = metrics.registry.get_sample_value
    run = {"run_id": "run1"}
    assert get("elastic_ext_step_seconds", run) is None  # nothing known: no sample, not 0
    pace: Pace | None = Pace(0.25)  # no DDP: a step time, no own time
    metrics.watch_pace(lambda: pace)
    assert get("elastic_ext_step_seconds", run) == 0.25
    assert get("elastic_ext_own_step_seconds", run) is None
    pace = Pace(0.25, 0.1)
    assert get("elastic_ext_own_step_seconds", run) == 0.1  # read when scraped
    pace = None  # between rounds
    assert get("elastic_ext_step_seconds", run) is None
    slow = {"peer": "b", "own_s": 0.3, "others_s": 0.1, "step_s": 0.3, "gain": 1.2}
    metrics.on_event(EventKind.SLOW, {**slow, "dropped": False})
    metrics.on_event(EventKind.SLOW, {**slow, "dropped": False})
    metrics.on_event(EventKind.SLOW, {**slow, "dropped": True})
    assert get("elastic_ext_stragglers_total", {**run, "action": "warn"}) == 2
    assert get("elastic_ext_stragglers_total", {**run, "action": "drop"}) == 1


def test_an_agent_serves_the_pace_its_keeper_reads(agent, monkeypatch: pytest.MonkeyPatch
                                                    ) -> None:
    """The agent torch's registry builds wires its keeper's pace to the metrics."""
    _, port = agent
    monkeypatch.setattr(keeper_module, "node_pace", lambda beacons: Pace(0.2, 0.05))

    def served() -> Samples | None:
        samples = scrape(port)
        return samples if ("elastic_ext_step_seconds", (("run_id", "prom"),)) in samples \
            else None
    samples = wait_until(served, 10, what="the keeper's next tick")
    assert value(samples, "elastic_ext_step_seconds", run_id="prom") == 0.2
    assert value(samples, "elastic_ext_own_step_seconds", run_id="prom") == 0.05


def test_a_busy_port_and_a_missing_library_are_refused_naming_the_fix(
        monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ConfigError, match=f"metrics_port={port}: cannot serve.*0 for any"):
            AgentMetrics("run1").serve(port)
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    params = RendezvousParameters(backend="etcd-ext", endpoint="c10d://127.0.0.1:1",
                                  run_id="x", min_nodes=1, max_nodes=1, metrics_port="0")
    with pytest.raises(ConfigError, match=r"pip install 'elastic-ext\[metrics\]'"):
        rendezvous_handler_registry.create_handler(params)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_real_agents_on_etcd_serve_their_peers_heartbeat_ages(tmp_path: Path) -> None:
    metrics = tmp_path / "m.jsonl"
    spec = JobSpec(command=[LOOP_JOB, str(metrics), "100000", "0.05", "0"], store="etcd",
                   nnodes="2:2", run_id="prom", max_restarts=1, rdzv_conf="metrics_port=0")
    with LocalJob(spec, tmp_path).start(2) as job:
        wait_for_step(metrics, after=0, world_size=2, timeout=90)
        started = [node.events(EventKind.STARTED)[0] for node in job.nodes]
        ports = [int(event["metrics_port"]) for event in started]
        ids = [str(event["node"]) for event in started]
        for port, me, peer in ((ports[0], ids[0], ids[1]), (ports[1], ids[1], ids[0])):
            samples = scrape(port)
            assert value(samples, "elastic_ext_members", run_id="prom") == 2
            assert value(samples, "elastic_ext_restarts_left", run_id="prom") == 1
            age = value(samples, "elastic_ext_peer_heartbeat_age_seconds", run_id="prom",
                        peer=peer)
            assert 0 <= age < 3.0  # the peer is alive: its counter moved within the timeout
            assert ("elastic_ext_peer_heartbeat_age_seconds",
                    (("peer", me), ("run_id", "prom"))) not in samples
