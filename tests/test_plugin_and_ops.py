"""The plugin as torch's registry loads it, and ``elastic-ext status`` / ``list``, in-process
against real stores: an embedded TCPStore hosted by the handler itself, and a real etcd."""

from __future__ import annotations

import argparse
import io
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters, rendezvous_handler_registry

from elastic_ext import ops
from elastic_ext.jsonlines import read_json_lines
from elastic_ext.net import free_port
from elastic_ext.rendezvous.errors import StoreUnavailableError
from elastic_ext.rendezvous.etcd_backend import EtcdBackend
from elastic_ext.rendezvous.factory import open_backend
from elastic_ext.rendezvous.handler import EtcdExtRendezvousHandler
from elastic_ext.rendezvous.state import NodeInfo, Phase, RunState
from tests.support.stores import settings_for


@pytest.fixture
def embedded_agent(tmp_path: Path) -> Iterator[tuple[EtcdExtRendezvousHandler, str, Path]]:
    """A handler made by torch's registry on an embedded store it hosts, after one round."""
    endpoint = f"127.0.0.1:{free_port('127.0.0.1')}"
    events = tmp_path / "events.jsonl"
    params = RendezvousParameters(backend="etcd-ext", endpoint=f"c10d://{endpoint}", run_id="job7",
                                  min_nodes=1, max_nodes=1, local_addr="127.0.0.1",
                                  events_file=str(events), heartbeat_interval="0.1",
                                  heartbeat_timeout="1")
    handler = rendezvous_handler_registry.create_handler(params)
    assert isinstance(handler, EtcdExtRendezvousHandler)
    handler.next_rendezvous()
    try:
        yield handler, endpoint, events
    finally:
        handler.shutdown()


def status(*argv: str) -> tuple[int, str]:
    parser = argparse.ArgumentParser()
    name = argv[0]
    ops.add_arguments(parser, name)
    args = parser.parse_args(argv[1:])
    args.command = name
    out = io.StringIO()
    return ops.run(args, out), out.getvalue()


def test_torchs_registry_builds_the_handler_with_the_injected_backend_name(embedded_agent) -> None:
    handler, _, events = embedded_agent
    assert handler.get_backend() == "etcd-ext" and handler.get_run_id() == "job7"
    started = [e for e in read_json_lines(events) if e["event"] == "started"]
    assert started[0]["store"] == "c10d-embedded" and started[0]["hosts_store"] is True


def test_status_reports_the_round_and_the_members_of_a_live_run(embedded_agent) -> None:
    handler, endpoint, _ = embedded_agent
    code, text = status("status", "--endpoint", f"c10d://{endpoint}", "--run-id", "job7", "--json")
    assert code == 0
    report = json.loads(text)
    assert (report["round"], report["phase"], report["status"]) == (1, "closed", "active")
    assert [m["node"] for m in report["members"]] == [handler.node_id]
    assert report["members"][0]["rank"] == 0 and report["members"][0]["heartbeat_age_s"] < 5
    code, text = status("status", "--endpoint", f"c10d://{endpoint}", "--run-id", "job7")
    assert code == 0 and "round 1 (closed), status active" in text and handler.node_id in text
    code, text = status("status", "--endpoint", f"c10d://{endpoint}", "--run-id", "other")
    assert code == 0 and "run other: no state" in text


def test_list_on_the_embedded_store_says_it_needs_etcd(embedded_agent, capsys) -> None:
    _, endpoint, _ = embedded_agent
    code, _ = status("list", "--endpoint", f"c10d://{endpoint}")
    assert code == 2 and "listing runs needs etcd" in capsys.readouterr().err


def test_operator_commands_never_host_the_embedded_store(capsys) -> None:
    endpoint = f"127.0.0.1:{free_port('127.0.0.1')}"
    with pytest.raises(StoreUnavailableError, match=f"embedded c10d store at {endpoint}"):
        open_backend(settings_for(f"c10d://{endpoint}", connect_timeout="0.5"), may_host=False)
    code, _ = status("status", "--endpoint", f"c10d://{endpoint}", "--run-id", "x",
                     "--rdzv-conf", "connect_timeout=0.5")
    assert code == 2 and "cannot reach the embedded c10d store" in capsys.readouterr().err


def test_status_and_list_on_etcd(etcd) -> None:
    endpoint = etcd.members[0].endpoint
    for run_id in ("job-a", "job-b"):
        backend = EtcdBackend(settings_for(endpoint, run_id))
        state = RunState("gen", 2, Phase.OPEN, {"n1": NodeInfo("10.0.0.1", 29500)})
        assert backend.set_state(state.to_bytes()) is not None
        backend.beat("n1")
    code, text = status("list", "--endpoint", endpoint, "--json")
    assert code == 0 and json.loads(text) == ["job-a", "job-b"]
    code, text = status("status", "--endpoint", endpoint, "--run-id", "job-b", "--json")
    report = json.loads(text)
    assert code == 0 and (report["round"], report["phase"]) == (2, "open")
    assert report["members"] == [{"node": "n1", "address": "10.0.0.1:29500",
                                  "heartbeat_age_s": report["members"][0]["heartbeat_age_s"],
                                  "left": False, "rank": None}]
