"""The chaos harness's pure parts: the scenario parser, triggers, invariants and the report.

No process is started here; every rule is checked on made-up event lists.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any, cast

import pytest

from elastic_ext.chaos import cli, matrix
from elastic_ext.chaos.inject import InjectionError, Injector
from elastic_ext.chaos.invariants import (
    CONSISTENT,
    HARNESS,
    LAST_STEP,
    LEFTOVERS,
    LOST_STEPS,
    SAME_PARAMS,
    FaultRecord,
    NodeOutcome,
    Observation,
    check,
    listening_ports,
)
from elastic_ext.chaos.netns import LabPlan, exec_prefix
from elastic_ext.chaos.reference import cache_key, trainer_args
from elastic_ext.chaos.report import summary
from elastic_ext.chaos.runner import RunResult, trigger_met
from elastic_ext.chaos.scenario import Action, ScenarioError, Trigger, parse
from elastic_ext.chaos.throttle import DutyCycle
from elastic_ext.jsonlines import JsonLinesTail
from elastic_ext.local.job import JobSpec, LocalJob, Node
from elastic_ext.local.processes import Proc, ProcessSet, wait_until
from elastic_ext.ops.runlog import durable_snapshots, split_segments, step_rate
from elastic_ext.rendezvous.agent.events import EventKind, EventLog

pytestmark = pytest.mark.timeout(60)


# ---------------------------------------------------------------------------- scenarios
def test_the_issue_example_parses() -> None:
    text = """
    # the example of issue 5
    nodes = 3
    nnodes = 2:3
    store = etcd
    etcd-members = 3
    steps = 200
    rdzv-conf = heartbeat_timeout=3,last_call_timeout=1

    at step 30: kill node 1
    at step 50: start node
    after 5s: freeze node 2 for 20s
    at step 80: kill etcd leader
    at step 100: preempt all
    when stopped: start all
    """
    scenario = parse(text, "tour")
    assert scenario.settings.nodes == 3 and scenario.settings.etcd_members == 3
    assert scenario.settings.rdzv_conf == "heartbeat_timeout=3,last_call_timeout=1"
    assert [f.describe() for f in scenario.faults] == [
        "at step 30: kill node 1", "at step 50: start node", "after 5s: freeze node 2 for 20s",
        "at step 80: kill etcd leader", "at step 100: preempt all", "when stopped: start all"]
    assert scenario.faults[2].action == Action("freeze", "2", duration=20.0)
    assert scenario.faults[0].line == 10
    assert scenario.network == "loopback" and not scenario.needs_tmpfs


@pytest.mark.parametrize("line, trigger, action", [
    ("at step 7: kill worker rank0", Trigger("step", 7), Action("kill-worker", "rank0")),
    ("when world 2: kill node all", Trigger("world", 2), Action("kill-node", "all")),
    ("when recovered: start 2 nodes", Trigger("recovered"), Action("start-node", count=2)),
    ("after 1.5s: kill etcd all for 20s", Trigger("after", 1.5),
     Action("kill-etcd", "all", duration=20.0)),
    ("AT  STEP 3 :  Fill Disk", Trigger("step", 3), Action("fill-disk")),
    ("at step 3: partition node other for 2s", Trigger("step", 3),
     Action("partition", "other", duration=2.0)),
])
def test_each_trigger_and_action(line: str, trigger: Trigger, action: Action) -> None:
    scenario = parse(f"etcd-members = 3\n{line}\n")
    assert scenario.faults[0].trigger == trigger
    assert scenario.faults[0].action == action


@pytest.mark.parametrize("text, message", [
    ("colour = blue", "unknown setting 'colour'"),
    ("nodes = 0", "nodes = '0': must be at least 1"),
    ("nnodes = 3:2", "needs 1 <= MIN <= MAX"),
    ("at step 3: explode", "unknown action 'explode'"),
    ("sometime: kill node 1", "unknown trigger 'sometime'"),
    ("at step 3: kill node 1\nnodes = 2", "settings must come before the first fault"),
    ("at step 3: kill etcd follower", "needs etcd-members = 3"),
    ("store = embedded\nat step 3: kill etcd leader", "kill etcd needs store = etcd"),
    ("at step 3: freeze node all for 2s", "freeze needs one node"),
    ("at step 3: freeze node 1", "unknown action"),  # a freeze must end
    ("network = loopback\nat step 3: partition node 1 for 2s", "a partition needs network = netns"),
    ("nodes = 4", "more than nnodes MAX"),
    ("at step 3: start 0 nodes", "must be at least 1"),
    ("just words", "expected 'key = value' or 'TRIGGER: ACTION'"),
])
def test_errors_name_the_line_and_say_why(text: str, message: str) -> None:
    with pytest.raises(ScenarioError, match="line|scenario:") as info:
        parse(text)
    assert message in str(info.value)


def test_overrides_are_validated_again() -> None:
    scenario = matrix.scenario("etcd-leader")
    assert scenario.with_settings({"steps": "50"}).settings.steps == 50
    with pytest.raises(ScenarioError, match="etcd-members"):
        matrix.scenario("etcd-follower").with_settings({"etcd-members": "1"})


def test_every_built_in_scenario_parses_and_the_groups_are_known() -> None:
    for name in matrix.SCENARIOS:
        scenario = matrix.scenario(name)
        assert scenario.faults, name
        assert scenario.settings.timeout <= 420
    assert set(matrix.CI) <= set(matrix.GROUPS["full"]) <= set(matrix.SCENARIOS)
    assert matrix.scenario("partition").network == "netns"
    assert matrix.scenario("disk-full").needs_tmpfs


# ----------------------------------------------------------------------------- triggers
def ev(kind: str, step: int, t: float, world: int = 2, **extra: Any) -> dict[str, Any]:
    return {"event": kind, "step": step, "world_size": world, "restart": 0, "time": t, **extra}


def test_triggers_count_only_what_happened_after_the_previous_fault() -> None:
    events = [ev("start", 0, 0.0, resumed_from=None), ev("step", 1, 1.0), ev("step", 2, 2.0),
              ev("start", 0, 5.0, world=3, resumed_from=2), ev("step", 3, 6.0, world=3)]
    assert trigger_met(Trigger("step", 2), events, since=0.0, now=9, stopped=False)
    assert not trigger_met(Trigger("step", 2), events[:3], since=2.5, now=9, stopped=False)
    assert trigger_met(Trigger("step", 3), events, since=2.5, now=9, stopped=False)
    assert trigger_met(Trigger("world", 3), events, since=0.0, now=9, stopped=False)
    assert not trigger_met(Trigger("world", 3), events[:3], since=0.0, now=9, stopped=False)
    assert trigger_met(Trigger("recovered"), events, since=4.0, now=9, stopped=False)
    assert not trigger_met(Trigger("recovered"), events, since=5.5, now=9, stopped=False)
    assert trigger_met(Trigger("after", 2), [], since=4.0, now=6.0, stopped=False)
    assert not trigger_met(Trigger("after", 2), [], since=4.0, now=5.9, stopped=False)
    assert trigger_met(Trigger("stopped"), [], since=0, now=0, stopped=True)


def test_the_metrics_tail_waits_for_whole_lines(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    tail = JsonLinesTail(path)
    tail.poll()
    path.write_text(json.dumps(ev("start", 0, 0.0)) + "\n" + '{"event": "st')
    tail.poll()
    assert [e["event"] for e in tail.events] == ["start"]
    with open(path, "a") as f:
        f.write('ep", "step": 1, "world_size": 2, "time": 1.0}\n[1, 2]\n')
    assert [e["event"] for e in tail.poll()] == ["step"]  # only what is new; a list is no record
    assert [e["event"] for e in tail.events] == ["start", "step"]
    assert tail.poll() == []


# --------------------------------------------------------------------------- invariants
def clean_run(steps: int = 6, world: int = 2) -> list[dict[str, Any]]:
    events = [ev("start", 0, 0.0, world, resumed_from=None)]
    events += [ev("step", s, float(s), world, loss=1.0 / s) for s in range(1, steps + 1)]
    events += [ev("snapshot", steps, steps + 0.1, world),
               ev("done", steps, steps + 0.2, world, params_sha256="a" * 64)]
    return events


def observe(events: list[dict[str, Any]], **kw: Any) -> Observation:
    kw.setdefault("steps", 6)
    kw.setdefault("reference_sha", "a" * 64)
    return Observation(events=tuple(events), **kw)


def broken(obs: Observation) -> list[str]:
    return [v.invariant for v in check(obs).violations]


def test_an_uninterrupted_run_passes() -> None:
    verdict = check(observe(clean_run(), nodes=(NodeOutcome("node0", 0, False),)))
    assert verdict.ok, verdict.violations
    assert verdict.params_check.startswith("equal")
    assert verdict.final_step == 6 and verdict.lost_steps == 0


def crash_run(resumed_from: int | None, crash: bool,
              snapshot_logged: bool = True) -> list[dict[str, Any]]:
    """Steps 1-7, a snapshot of 5, a restart at t=20 resuming from ``resumed_from``, done at 10."""
    events = ([ev("start", 0, 0.0, resumed_from=None)]
              + [ev("step", s, float(s)) for s in range(1, 8)])
    if snapshot_logged:
        events.insert(6, ev("snapshot", 5, 5.5))
    base = resumed_from or 0
    events.append(ev("start", base, 20.0, resumed_from=resumed_from))
    events += [ev("step", s, 20.0 + s) for s in range(base + 1, 11)]
    events.append(ev("done", 10, 40.0, params_sha256="b" * 64))
    return events


FAULT = FaultRecord(7.5, "kill node other", "kill-node", crash=True)
PREEMPT = FaultRecord(7.5, "preempt all", "preempt")


def test_a_crash_may_lose_the_steps_after_the_last_snapshot() -> None:
    verdict = check(observe(crash_run(5, crash=True), steps=10, faults=(FAULT,),
                            reference_sha="b" * 64))
    assert verdict.ok, verdict.violations
    assert verdict.lost_steps == 2
    assert verdict.restarts[0].crash_allowed and verdict.restarts[0].downtime == pytest.approx(19.0)


def test_a_preemption_may_lose_nothing() -> None:
    verdict = check(observe(crash_run(5, crash=False), steps=10, faults=(PREEMPT,),
                            reference_sha="b" * 64))
    assert [v.invariant for v in verdict.violations] == [LOST_STEPS]
    assert "after preempt all resumed from step 5: steps 6-7 lost though no node crashed" in \
        verdict.violations[0].message


def test_resuming_from_an_older_snapshot_than_the_newest_loses_too_much() -> None:
    events = crash_run(None, crash=True)
    assert LOST_STEPS in broken(observe(events, steps=10, faults=(FAULT,), reference_sha="b" * 64))


def test_a_snapshot_seen_on_disk_counts_when_its_event_was_never_logged() -> None:
    events = crash_run(5, crash=True, snapshot_logged=False)
    assert CONSISTENT in broken(observe(events, steps=10, faults=(FAULT,), reference_sha="b" * 64))
    assert check(observe(events, steps=10, faults=(FAULT,), snapshots_seen=((5, 5.6),),
                         reference_sha="b" * 64)).ok
    assert durable_snapshots(events, [(5, 5.6)]) == [(5, 5.6)]


def test_gaps_repeats_and_a_missing_done_are_reported() -> None:
    events = clean_run()
    gap = [e for e in events if not (e["event"] == "step" and e["step"] == 3)]
    assert CONSISTENT in broken(observe(gap))
    no_done = [e for e in events if e["event"] != "done"]
    assert broken(observe(no_done, reference_sha=None)) == [LAST_STEP]
    stray = [ev("step", 1, -1.0)] + events
    assert CONSISTENT in broken(observe(stray))


def test_a_world_size_change_skips_the_params_check() -> None:
    events = crash_run(5, crash=True)
    second = max(i for i, e in enumerate(events) if e["event"] == "start")
    for e in events[second:]:
        e["world_size"] = 3
    verdict = check(observe(events, steps=10, faults=(FAULT,), reference_sha="c" * 64))
    assert verdict.ok, verdict.violations
    assert verdict.params_check.startswith("not applicable")


def test_different_parameters_nodes_leftovers_and_harness_errors() -> None:
    obs = observe(clean_run(), reference_sha="f" * 64,
                  nodes=(NodeOutcome("node0", 1, False), NodeOutcome("node1", None, False),
                         NodeOutcome("node2", -9, True)),
                  leftovers=("pid 12 of node0: python -m trainer",), bound_ports=(4242,),
                  errors=("timed out after 300s waiting for every node to exit",))
    messages = [str(v) for v in check(obs).violations]
    assert messages[0].startswith(HARNESS)
    assert any(m.startswith(SAME_PARAMS) for m in messages)
    assert f"{LAST_STEP}: node0 exited with status 1" in messages
    assert f"{LAST_STEP}: node1 was still running when the scenario ended" in messages
    assert not any("node2" in m for m in messages)  # we killed it
    assert sum(m.startswith(LEFTOVERS) for m in messages) == 2


def test_split_segments_and_listening_ports() -> None:
    segments, stray = split_segments(crash_run(5, crash=True))
    assert not stray and [s.resumed_from for s in segments] == [None, 5]
    assert segments[1].steps == tuple(range(6, 11)) and segments[1].end == "done"
    tcp = ("  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  "
           "timeout inode\n"
           "   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000 0 0 1 1\n"
           "   1: 0100007F:1F91 0100007F:1F90 01 00000000:00000000 00:00000000 00000000 0 0 2 1\n")
    assert listening_ports(tcp) == {8080}


# ------------------------------------------------------------------------- small helpers
def test_a_node_reads_its_rank_store_ports_and_hosting_from_its_agents_events(
        tmp_path: Path) -> None:
    path = tmp_path / "events" / "node0.jsonl"
    node = Node("node0", cast(Proc, None), events_file=path)
    assert ((node.group_rank(), node.hosts_store(), node.workers_store_ports())
            == (None, False, set()))
    log = EventLog("chaos", "node0-id", "127.0.0.1", path)
    log.emit(EventKind.STARTED, "started", store="c10d-embedded", hosts_store=True)
    for round_, rank, port in ((1, 0, 44395), (2, 1, 44396)):
        log.emit(EventKind.JOINED, "joined", round=round_, rank=rank, world_size=2,
                 master_addr="127.0.0.1", master_port=port)
    log.close()
    assert (node.group_rank(), node.hosts_store(), node.workers_store_ports()) == (
        1, True, {44395, 44396})


def test_lab_plan() -> None:
    plan = LabPlan(7)
    assert ((plan.subnet, plan.store_address, plan.node_address(2))
            == ("10.201.7.0/24", "10.201.7.1", "10.201.7.12"))
    assert plan.namespaces(2) == ["eec7-sw", "eec7-n0", "eec7-n1"]
    assert exec_prefix("eec7-n0") == ("ip", "netns", "exec", "eec7-n0")
    with pytest.raises(ValueError):
        LabPlan(255)


def test_the_reference_cache_key_ignores_paths_and_the_delay(tmp_path: Path) -> None:
    def args(delay: float, where: str, seed: int = 3) -> list[str]:
        return trainer_args(module="trainer", steps=10, global_batch_size=12, seed=seed,
                            snapshot_every=5, model_size="tiny", step_delay=delay,
                            metrics=tmp_path / where / "m", snapshot_dir=tmp_path / where / "s")
    assert cache_key(args(0.05, "a"), 2) == cache_key(args(0.0, "b"), 2)
    assert cache_key(args(0.05, "a"), 2) != cache_key(args(0.05, "a"), 3)
    assert cache_key(args(0.05, "a"), 2) != cache_key(args(0.05, "a", seed=4), 2)


def test_step_rate_bins() -> None:
    centres, rates = step_rate([0.0, 0.2, 0.4, 1.1, 3.0], window=1.0)
    assert rates == [3.0, 1.0, 0.0, 1.0]
    assert centres[0] == pytest.approx(0.5)
    assert step_rate([]) == ([], [])


# ---------------------------------------------------------------------------- report
def fake_result(tmp_path: Path) -> RunResult:
    scenario = parse("nodes = 2\nsteps = 10\nat step 7: kill node other\n", "fake")
    obs = observe(crash_run(5, crash=True), steps=10, faults=(FAULT,), reference_sha="b" * 64,
                  nodes=(NodeOutcome("node0", 0, False), NodeOutcome("node1", -9, True)))
    return RunResult(scenario, tmp_path, started=-1.0, ended=45.0, verdict=check(obs),
                     observation=obs)


def test_the_json_summary(tmp_path: Path) -> None:
    data = summary(fake_result(tmp_path))
    json.dumps(data)
    assert data["result"] == "pass" and data["lost_steps"] == 2
    assert data["faults"][0]["t"] == pytest.approx(8.5)
    assert data["restarts"][0]["resumed_from"] == 5 and data["restarts"][0]["after_crash"]
    assert [r["world_size"] for r in data["rounds"]] == [2, 2]


def test_the_timeline_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from elastic_ext.chaos.report import write_report

    written = write_report(fake_result(tmp_path), tmp_path / "report")
    assert written["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(written["json"].read_text())["scenario"] == "fake"


# ------------------------------------------------------------------------------- cli
def parse_cli(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser, "chaos")
    return parser.parse_args(argv)


def test_cli_list_show_and_usage_errors(tmp_path: Path) -> None:
    out = io.StringIO()
    assert cli.run(parse_cli("--list"), out) == cli.EXIT_OK
    assert "kill-rank0" in out.getvalue() and "full" in out.getvalue()
    out = io.StringIO()
    assert cli.run(parse_cli("--show", "preempt"), out) == cli.EXIT_OK
    assert "preempt all" in out.getvalue()
    bad = tmp_path / "bad.scn"
    bad.write_text("at step 3: dance\n")
    out = io.StringIO()
    assert cli.run(parse_cli(str(bad)), out) == cli.EXIT_USAGE
    assert "bad line 1" in out.getvalue() and "unknown action 'dance'" in out.getvalue()
    out = io.StringIO()
    assert cli.run(parse_cli("no-such-thing"), out) == cli.EXIT_USAGE
    out = io.StringIO()
    assert cli.run(parse_cli("kill-node", "--set", "steps"), out) == cli.EXIT_USAGE


def test_docs_name_every_setting_scenario_and_action() -> None:
    from elastic_ext.chaos.scenario import SETTINGS

    docs = (Path(__file__).parent.parent / "docs" / "chaos.md").read_text()
    for key in SETTINGS:
        assert f"`{key}`" in docs, key
    for name in matrix.SCENARIOS:
        assert f"`{name}`" in docs, name
    for words in ("kill worker T", "kill node T", "freeze node T for Ds", "partition node T for Ds",
                  "preempt all", "start N nodes", "fill disk [for Ds]", "when recovered",
                  "when stopped"):
        assert words in docs, words
    assert " ".join(matrix.CI) in docs


# ------------------------------------------------------------------------- the slow fault
@pytest.mark.parametrize("line, action", [
    ("slow node other", Action("slow", "other", fraction=1 / 3, period=0.03)),
    ("slow node 1 to 1/4 every 50ms for 20s",
     Action("slow", "1", duration=20.0, fraction=0.25, period=0.05)),
    ("slow node rank0 to 40% every 0.1s", Action("slow", "rank0", fraction=0.4, period=0.1)),
    ("slow node 2 to .5", Action("slow", "2", fraction=0.5, period=0.03)),
])
def test_the_slow_fault_parses_with_its_defaults_and_describes_itself_back(
        line: str, action: Action) -> None:
    fault = parse(f"at step 3: {line}\n").faults[0]
    assert fault.action == action and not fault.action.crash
    assert parse(fault.describe() + "\n").faults[0].action == action


@pytest.mark.parametrize("line, message", [
    ("slow node all", "slow needs one node"),
    ("slow node 1 to 3/2", "between 0 and 1"),
    ("slow node 1 to 0%", "between 0 and 1"),
    ("slow node 1 to 1/0", "denominator"),
    ("slow node 1 every 2ms", "too short"),
])
def test_a_bad_slow_fault_names_its_line(line: str, message: str) -> None:
    with pytest.raises(ScenarioError, match="line 1") as info:
        parse(f"at step 3: {line}\n")
    assert message in str(info.value)


BUSY = "import time\nwhile True:\n    pass\n"


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def state_of(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


@pytest.mark.slow
@pytest.mark.quiet  # the cycle's thread must run every 20 ms: alone, not beside 2 workers
def test_the_duty_cycle_runs_its_processes_a_fraction_of_the_time_then_lets_them_go(
        processes: ProcessSet) -> None:
    """A busy process throttled to a quarter gets at most about that much CPU (less on a
    busy machine), is stopped most of the time, and runs freely once the cycle stops; a pid
    the lookup stops naming is continued at the end too. Quiet: beside two other xdist
    workers on 2 cores the cycle's thread went unscheduled for 0.1-0.3 s (two CI runs)."""
    first = processes.spawn("busy-1", [sys.executable, "-c", BUSY])
    second = processes.spawn("busy-2", [sys.executable, "-c", BUSY])
    named = [first.pid]
    cycle = DutyCycle(lambda: list(named), fraction=0.25, period=0.02, refresh=0.1).start()
    try:
        wait_until(lambda: cycle.cycles >= 3, 5, what="three cycles")
        named[:] = [second.pid]
        wait_until(lambda: second.pid in cycle.pids(), 5, what="the second process throttled")
        before, began = cpu_seconds(second.pid), time.monotonic()
        states = []
        while time.monotonic() - began < 1.0:
            states.append(state_of(second.pid))
            time.sleep(0.003)  # sampling the state, not waiting for it
        share = (cpu_seconds(second.pid) - before) / (time.monotonic() - began)
        assert share < 0.5, f"a process throttled to 25% ran {share:.0%} of the time"
        assert states.count("T") > len(states) / 2, "".join(states)
    finally:
        cycles = cycle.stop()
    assert cycles >= 3 and not cycle.running
    assert cycle.pids() == {first.pid, second.pid}

    def running(pid: int) -> bool:
        return state_of(pid) != "T"

    for pid in (first.pid, second.pid):
        wait_until(partial(running, pid), 2, what=f"{pid} continued")
    before = cpu_seconds(second.pid)
    wait_until(lambda: cpu_seconds(second.pid) > before + 0.05, 5, what="the process to run")


def test_the_slow_fault_throttles_the_nodes_workers_not_its_agent(processes: ProcessSet,
                                                                   tmp_path: Path) -> None:
    """``Injector`` finds the node's workers as the other faults do (torchrun gives them
    ``RANK``) and, with warm starts, the processes their beacons name (forked by the
    warm-start server, without ``RANK``), but never a process of another node a stale
    beacon names; it leaves the agent alone, and the undo speeds the node up for good."""
    control = tmp_path / "control"
    control.mkdir()
    stranger = processes.spawn("stranger", [sys.executable, "-c", BUSY])
    agent = processes.spawn("agent", [sys.executable, "-c", (
        "import os, subprocess, sys, time\n"
        f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], env={{"
        f"**os.environ, 'RANK': '1', 'ELASTIC_EXT_CONTROL_DIR': {str(control)!r}}})\n"
        f"forked = subprocess.Popen([sys.executable, '-c', {BUSY!r}])\n"
        f"open({str(control / 'forked')!r}, 'w').write(str(forked.pid))\n"
        "time.sleep(60)\n")])
    node = Node("node0", agent)
    job = LocalJob(JobSpec(command=["-m", "trainer"]), tmp_path)
    job.nodes.append(node)
    launcher = wait_until(lambda: next(iter(node.worker_pids()), None), 10, what="a worker")

    def forked_pid() -> str | None:
        written = control / "forked"
        return written.read_text() if written.exists() else None

    forked = int(wait_until(forked_pid, 10, what="the forked pid"))
    (control / "beat-0").write_text(json.dumps({"pid": forked}))
    (control / "beat-1").write_text(json.dumps({"pid": stranger.pid}))  # a reused pid
    injector = Injector(job, initial_nodes=1, snapshot_dir=tmp_path)
    fault = parse("at step 1: slow node 0 to 1/5 every 20ms\n").faults[0]
    record, undo = injector.inject(fault)
    try:
        assert record.verb == "slow" and not record.crash, record
        assert f"{launcher}, {forked}" in record.detail or f"{forked}, {launcher}" in \
            record.detail, record.detail
        assert undo is not None and undo.due == math.inf and "node0" in injector.impaired
        wait_until(lambda: state_of(forked) == "T", 2, what="the forked worker stopped")
        assert injector.slowed["node0"].pids() == {launcher, forked}
        with pytest.raises(InjectionError, match="already slowed"):
            injector.inject(fault)
    finally:
        detail = undo.run() if undo is not None else ""
    assert "node0 at full speed" in detail and not injector.slowed
    assert "node0" not in injector.impaired
    assert wait_until(lambda: state_of(forked) != "T", 2, what="the worker continued")
