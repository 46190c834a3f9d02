"""The plugin as torch's registry loads it, and ``elastic-ext status`` / ``list``, in-process
against real stores: an embedded TCPStore hosted by the handler itself, and a real etcd."""

from __future__ import annotations

import argparse
import io
import json
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters, rendezvous_handler_registry

from elastic_ext.jsonlines import read_json_lines
from elastic_ext.local.processes import wait_until
from elastic_ext.net import free_port
from elastic_ext.ops import status as ops
from elastic_ext.rendezvous.agent.handler import EtcdExtRendezvousHandler
from elastic_ext.rendezvous.errors import StoreUnavailableError
from elastic_ext.rendezvous.protocol.pace import Pace
from elastic_ext.rendezvous.protocol.state import NodeInfo, Phase, RunState
from elastic_ext.rendezvous.protocol.straggler import StragglerRules
from elastic_ext.rendezvous.stores.etcd.backend import EtcdBackend
from elastic_ext.rendezvous.stores.open import open_backend
from tests.support.memory_backend import MemoryBackend, MemoryStore
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


def test_list_on_the_embedded_store_names_its_runs(embedded_agent) -> None:
    _, endpoint, _ = embedded_agent  # torch >= 2.10: a TCPStore lists its keys
    assert status("list", "--endpoint", f"c10d://{endpoint}") == (0, "job7\n")


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
                                  "lease_held": False, "left": False, "rank": None,
                                  "step_s": None, "own_s": None, "slow": False}]
    # a job with heartbeat_mode=lease: its heartbeat is the agent's lease, held, no age (issue 27)
    code, text = status("status", "--endpoint", endpoint, "--run-id", "job-b", "--json",
                        "--rdzv-conf", "heartbeat_mode=lease")
    member = json.loads(text)["members"][0]
    assert code == 0 and member["heartbeat_age_s"] is None and member["lease_held"] is True
    code, text = status("status", "--endpoint", endpoint, "--run-id", "job-b",
                        "--rdzv-conf", "heartbeat_mode=lease")
    assert code == 0 and "lease held" in text


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def watch_in_thread(argv: list[str], out: io.StringIO) -> threading.Thread:
    parser = argparse.ArgumentParser()
    ops.add_arguments(parser, "status")
    args = parser.parse_args(argv)
    args.command = "status"
    thread = threading.Thread(target=ops.run, args=(args, out), daemon=True)
    thread.start()
    return thread


def put_state(backend: EtcdBackend, state: RunState) -> None:
    current = backend.get_state()
    assert backend.set_state(state.to_bytes(), current[1] if current else None) is not None


def test_status_watch_streams_json_and_lists_the_events_it_saw_on_etcd(etcd) -> None:
    endpoint = etcd.members[0].endpoint
    backend = EtcdBackend(settings_for(endpoint, "job-w"))
    state = RunState("gen", 1, Phase.CLOSED, {"n1": NodeInfo("10.0.0.1", 29500)},
                     order=("n1",), note="round 1 closed with 1 nodes (start)")
    put_state(backend, state)
    out = io.StringIO()
    thread = watch_in_thread(["--endpoint", endpoint, "--run-id", "job-w", "--watch", "--json",
                              "--interval", "0.1", "--count", "30"], out)
    wait_until(lambda: out.getvalue().count("\n") >= 1, timeout=10, what="a first refresh")
    put_state(backend, RunState("gen", 2, Phase.OPEN, {"n1": NodeInfo("10.0.0.1", 29500)},
                                note="round 2 opened by n1 (membership)"))
    thread.join(timeout=30)
    assert not thread.is_alive()
    reports = [json.loads(line) for line in out.getvalue().splitlines()]
    assert len(reports) == 30 and reports[0]["round"] == 1 and reports[-1]["round"] == 2
    assert [e["event"] for e in reports[-1]["recent_events"]] == [
        "round 1 closed with 1 nodes (start)", "round 2 opened by n1 (membership)"]
    assert reports[-1]["time"] > reports[0]["time"]


def test_status_watch_redraws_in_place_on_a_terminal_and_survives_an_outage(etcd) -> None:
    member = etcd.members[0]
    backend = EtcdBackend(settings_for(member.endpoint, "job-t"))
    put_state(backend, RunState("gen", 1, Phase.CLOSED, {"n1": NodeInfo("10.0.0.1", 29500)},
                                order=("n1",), note="round 1 closed with 1 nodes (start)"))
    out = Terminal()
    thread = watch_in_thread(["--endpoint", member.endpoint, "--run-id", "job-t", "--watch",
                              "--interval", "0.1", "--count", "12", "--rdzv-conf",
                              "connect_timeout=0.3,request_timeout=0.1"], out)
    wait_until(lambda: out.getvalue().count(ops.CLEAR_SCREEN) >= 2, timeout=10,
               what="two refreshes")
    etcd.stop_member(member)
    thread.join(timeout=60)
    assert not thread.is_alive()
    frames = out.getvalue().split(ops.CLEAR_SCREEN)[1:]
    assert len(frames) == 12 and "round 1 (closed), status active" in frames[0]
    assert "the store did not answer" in frames[-1]
    assert "round 1 closed with 1 nodes (start)" in frames[-1]  # still listed while it is down


def test_status_shows_rounds_without_progress_and_nodes_left_out() -> None:
    state = RunState(generation="g", round=5, phase=Phase.CLOSED,
                     members={"a": NodeInfo("h", 1), "b": NodeInfo("h", 2)}, order=("a", "b"),
                     progress_round=2, excluded={"c": "not reachable from a, b, though the "
                                                      "store was"})
    report = ops.describe(state, {}, now=0.0, snapshot_step=None)
    assert report["rounds_without_progress"] == 2  # rounds 3 and 4 ended before a step
    text = ops.render(report, "r", "etcd://x")
    assert "rounds in a row that ended before a training step: 2" in text
    assert "left out: c: not reachable from a, b" in text
    trained = ops.describe(replace(state, progress_round=5), {}, now=0.0, snapshot_step=None)
    assert "rounds in a row" not in ops.render(trained, "r", "etcd://x")
    # a node that left on a notice, or a straggler left out (straggler=drop), and why
    dropped = ops.describe(replace(state, leaving={"d": "a straggler (3.0x the others' own "
                                                        "step time)"}), {}, now=0.0,
                           snapshot_step=None)
    assert dropped["left_the_job"] == {"d": "a straggler (3.0x the others' own step time)"}
    assert "left the job: d: a straggler (3.0x" in ops.render(dropped, "r", "etcd://x")


def paced_run() -> MemoryBackend:
    """A closed round of a, b and c (c's own step work 2.8x the others'), d waiting: each
    node's heartbeat carries its pace, as the agents' keepers put it."""
    backend = MemoryBackend(MemoryStore())
    info = NodeInfo("h", 1)
    state = RunState(generation="g", round=3, phase=Phase.CLOSED,
                     members={n: info for n in "abc"}, order=("a", "b", "c"),
                     waiting={"d": info})
    backend.set_state(state.to_bytes())
    for node, pace in (("a", Pace(0.3, 0.1)), ("b", Pace(0.3, 0.1)), ("c", Pace(0.3, 0.28)),
                       ("d", None)):
        backend.beat(node, pace=pace)
    return backend


def test_status_shows_each_nodes_pace_and_marks_the_slow_one_by_the_jobs_margin() -> None:
    backend = paced_run()
    report = ops.read_report(backend, None, StragglerRules(margin=1.5))
    members = {n["node"]: n for n in report["members"]}
    assert (members["a"]["step_s"], members["a"]["own_s"], members["a"]["slow"]) == (
        0.3, 0.1, False)
    assert members["c"]["own_s"] == 0.28 and members["c"]["slow"] is True
    assert report["waiting"][0]["step_s"] is None and report["waiting"][0]["slow"] is False
    assert (report["slow_nodes"], report["straggler_margin"]) == (["c"], 1.5)
    lines = ops.render(report, "r", "mem").splitlines()
    row = {line.split()[1]: line for line in lines if line.startswith(("  0 ", "  1 ", "  2 "))}
    assert row["a"].split()[-2:] == ["0.300s", "0.100s"]
    assert row["c"].split()[-3:] == ["0.300s", "0.280s", "slow"]
    assert next(line for line in lines if line.startswith("  wait")).split()[-2:] == ["-", "-"]
    assert "  slow: own step work over 1.5x the other nodes' median (straggler_margin)" in lines
    relaxed = ops.read_report(backend, None, StragglerRules(margin=3.0))
    assert relaxed["slow_nodes"] == [] and "slow" not in ops.render(relaxed, "r", "mem")


def test_status_marks_no_node_slow_while_the_round_is_open_or_the_node_leaves() -> None:
    backend = paced_run()
    current = backend.get_state()
    assert current is not None
    state, beats = RunState.from_bytes(current[0]), backend.read_beats("abcd")
    leaving = replace(state, leaving={"c": "a preemption notice"})
    assert ops.describe(leaving, beats, 0.0, None)["slow_nodes"] == []
    opened = replace(state, phase=Phase.OPEN, order=())
    report = ops.describe(opened, beats, 0.0, None)
    assert report["slow_nodes"] == [] and report["members"][2]["own_s"] == 0.28


def test_status_takes_the_straggler_margin_from_the_jobs_rdzv_conf(embedded_agent) -> None:
    _, endpoint, _ = embedded_agent
    code, text = status("status", "--endpoint", f"c10d://{endpoint}", "--run-id", "job7",
                        "--rdzv-conf", "straggler_margin=2.5", "--json")
    report = json.loads(text)
    assert code == 0 and report["straggler_margin"] == 2.5
    assert report["members"][0]["step_s"] is None  # no workers: no pace yet
