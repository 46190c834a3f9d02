"""The hang judge (``protocol/hang.py``), its place in the keeper's pressure, and the
workers' beacon (``worker/progress.py``): pure or single-process, an injected clock."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from elastic_ext.agent.control import AgentControl
from elastic_ext.control_channel import CONTROL_DIR_ENV
from elastic_ext.rendezvous.agent import hung_workers as hung_workers_module
from elastic_ext.rendezvous.agent.events import EventLog
from elastic_ext.rendezvous.agent.keeper import Keeper
from elastic_ext.rendezvous.protocol.hang import (
    NO_CULPRIT_WAIT_S,
    Beacon,
    Culprit,
    HangJudge,
    HangRules,
    Hung,
    culprit_of,
)
from elastic_ext.rendezvous.protocol.policy import Limits
from elastic_ext.rendezvous.protocol.pressure import Leave, RoundPressure, TellLost
from elastic_ext.rendezvous.protocol.state import Reason
from elastic_ext.worker.distributed import FLIGHT_RECORDER_DIR_ENV, flight_recorder_env
from elastic_ext.worker.progress import ProgressBeacon
from tests.support.handler_lab import FakeClock
from tests.support.memory_backend import MemoryBackend, MemoryStore

HEALTHY = Beacon(local_rank=0, pid=100, round=3, step=50, steps_in_round=50, step_s=0.06,
                 paused=False, waiting=True, where="torch/distributed/c10d.py:1 all_reduce",
                 backend="gloo", silent_s=0.1, process="S")


def watch(judge: HangJudge, beacons: list[Beacon], start: float, end: float) -> Hung | None:
    """Observe ``beacons`` every 0.1 s (torch's monitor interval) from ``start`` to ``end``:
    the first verdict, or None."""
    for tenth in range(round(start * 10), round(end * 10) + 1):
        hung = judge.observe(beacons, tenth / 10)
        if hung is not None:
            return hung
    return None


def judge_after(beacons: list[Beacon], *, seconds: float, rules: HangRules | None = None
                ) -> Hung | None:
    """The verdict of a judge that watched ``beacons`` unchanged for ``seconds``."""
    judge = HangJudge(rules or HangRules())
    judge.watch(3, 0.0)
    return watch(judge, beacons, 0.0, seconds)


def test_the_limit_is_the_floor_or_ten_step_times_and_the_startup_allowance_first() -> None:
    rules = HangRules()
    assert rules.limit(0.06, 50) == 2.0  # 10 x 0.06 s is under the 2 s floor
    assert rules.limit(0.5, 50) == 5.0
    assert rules.limit(0.06, 1) == 300.0  # the round's first steps: restore, compilation
    assert rules.limit(None, 50) == 300.0


def test_a_round_without_progress_past_the_limit_is_hung_once() -> None:
    stopped = replace(HEALTHY, process="T")
    assert judge_after([stopped], seconds=1.9) is None
    judge = HangJudge(HangRules())
    judge.watch(3, 0.0)
    hung = watch(judge, [stopped], 0.0, 2.0)
    assert hung is not None and "no training step for 2.0s" in hung.why
    assert [c.pid for c in hung.culprits] == [100] and "is stopped" in hung.why
    assert judge.observe([stopped], 9.0) is None  # once per round


def test_progress_or_a_pause_restarts_the_clock() -> None:
    judge = HangJudge(HangRules())
    judge.watch(3, 0.0)
    later = replace(HEALTHY, step=51)
    assert watch(judge, [HEALTHY], 0.0, 1.8) is None
    assert watch(judge, [later], 1.9, 3.0) is None  # a step at 1.9: progress
    assert watch(judge, [replace(later, paused=True)], 3.1, 3.8) is None
    hung = watch(judge, [later], 3.9, 10.0)  # the clock restarted at 3.8
    assert hung is not None and f"for {2.0 + NO_CULPRIT_WAIT_S:.1f}s" in hung.why


def test_beacons_of_another_round_or_none_are_not_judged() -> None:
    assert judge_after([replace(HEALTHY, round=2)], seconds=100) is None
    assert judge_after([], seconds=100) is None
    assert judge_after([HEALTHY], seconds=100, rules=HangRules(enabled=False)) is None


def test_the_slowest_local_rank_decides_progress() -> None:
    judge = HangJudge(HangRules())
    judge.watch(3, 0.0)
    slow = replace(HEALTHY, local_rank=1, step=49)
    judge.observe([HEALTHY, slow], 0.0)
    # rank 0 moves on, rank 1 does not: no step of the round completed on this node
    assert watch(judge, [replace(HEALTHY, step=51), slow], 0.1, 3.1 + NO_CULPRIT_WAIT_S)


def test_a_node_without_a_culprit_waits_longer_than_the_culprits_node() -> None:
    assert judge_after([HEALTHY], seconds=2.0) is None
    hung = judge_after([HEALTHY], seconds=2.0 + NO_CULPRIT_WAIT_S)
    assert hung is not None and not hung.culprits


@pytest.mark.parametrize(("change", "how"), [
    ({"process": "T"}, "is stopped"),
    ({"process": "t"}, "is stopped"),
    ({"process": "D"}, "cannot be killed"),
    ({"silent_s": 3.1}, "runs no Python"),
    ({"waiting": False, "where": "train.py:9 load"}, "not in a collective while its round "
                                                      "waits: at train.py:9 load"),
])
def test_what_makes_a_worker_the_culprit(change: dict[str, object], how: str) -> None:
    culprit = culprit_of(replace(HEALTHY, **change))  # type: ignore[arg-type]
    assert culprit is not None and how in culprit.how
    assert culprit.killable == (change.get("process") != "D")


@pytest.mark.parametrize("change", [
    {},  # waiting in a collective
    {"process": ""},  # gone: torch's agent sees its exit
    {"process": "Z"},
    {"backend": "nccl", "waiting": False},  # NCCL waits in a CUDA sync called from anywhere
    {"waiting": False, "paused": True},
    {"silent_s": 2.9},  # a busy machine's scheduler, not a deadlock
])
def test_what_does_not(change: dict[str, object]) -> None:
    assert culprit_of(replace(HEALTHY, **change)) is None  # type: ignore[arg-type]


def test_two_blamed_hangs_in_a_row_take_the_node_out_and_one_without_blame_resets() -> None:
    judge = HangJudge(HangRules())
    stopped = replace(HEALTHY, process="T")
    for round_, beacons, leaves in ((3, [stopped], False), (4, [HEALTHY], False),
                                    (5, [stopped], False), (6, [stopped], True)):
        judge.watch(round_, 0.0)
        assert watch(judge, [replace(b, round=round_) for b in beacons], 0.0, 10.0)
        assert judge.leave_the_job is leaves, round_


class Reports:
    def __init__(self) -> None:
        self.beacon_list: list[Beacon] = []

    def progress_reported(self, round_: int) -> bool:
        return True

    def fault_reported(self, round_: int) -> str | None:
        return None

    def setup_fault_reported(self, round_: int) -> str | None:
        return None

    def beacons(self) -> list[Beacon]:
        return self.beacon_list


def test_a_blamed_hang_leaves_for_free_and_tells_the_workers_the_peers_are_lost() -> None:
    clock, reports = FakeClock(), Reports()
    pressure = RoundPressure("me", Limits(2, 3, 1.0, None), clock)
    pressure.watch(("g", 3))
    reports.beacon_list = [replace(HEALTHY, process="T")]
    for _ in range(19):
        assert pressure.worker_report(reports) == []
        clock.sleep(0.1)
    clock.sleep(0.1)
    actions = pressure.worker_report(reports)
    assert [type(a) for a in actions] == [TellLost, Leave]
    leave = actions[1]
    assert isinstance(leave, Leave) and leave.pressure.reason is Reason.MEMBERSHIP
    assert pressure.hung is not None and pressure.hung.culprits[0].pid == 100
    assert pressure.worker_report(reports) == []  # the first reason sticks


def test_a_hang_nobody_is_blamed_for_is_charged() -> None:
    clock, reports = FakeClock(), Reports()
    pressure = RoundPressure("me", Limits(2, 3, 1.0, None), clock)
    pressure.watch(("g", 3))
    reports.beacon_list = [HEALTHY]
    while not (actions := pressure.worker_report(reports)):
        clock.sleep(0.1)
    leave = actions[-1]
    assert isinstance(leave, Leave) and leave.pressure.reason is Reason.FAILURE


def test_the_agent_reads_its_workers_beacons_with_their_process_state(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    control = AgentControl(tmp_path)
    control.publish_round(3)
    monkeypatch.setenv(CONTROL_DIR_ENV, str(tmp_path))  # the worker's view of its agent
    beacon = ProgressBeacon(tmp_path, 1, interval=0.02)
    beacon.step()
    beacon.step()
    (tmp_path / "beat-1").write_text(json.dumps(beacon._record()))
    (tmp_path / "beat-7").write_text("{not json")  # half written: skipped
    [read] = control.beacons()
    assert (read.local_rank, read.round, read.step, read.steps_in_round) == (1, 3, 2, 2)
    assert read.process in ("R", "S") and read.silent_s < 5
    control.publish_round(4)
    assert control.beacons() == []  # a new round's workers beat afresh


RANK1 = """
import datetime, sys, time
import torch.distributed as dist
dist.init_process_group("gloo", store=dist.FileStore(sys.argv[1], 2), rank=1, world_size=2,
                        timeout=datetime.timedelta(seconds=30))
time.sleep(float(sys.argv[2]))  # joined, but never takes part in rank 0's all-reduce
"""  # then it exits: rank 0's all-reduce fails (connection closed)


def test_the_beacon_sees_the_main_thread_in_a_collective_or_elsewhere(tmp_path: Path) -> None:
    """The beacon thread samples where the main thread is: in gloo's all-reduce, waiting
    for a peer that never comes, or in a blocking call of its own."""
    peer = subprocess.Popen([sys.executable, "-c", RANK1, str(tmp_path / "store"), "1.5"],
                            start_new_session=True)
    try:
        dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 2),
                                rank=0, world_size=2, timeout=timedelta(seconds=30))
        beacon = ProgressBeacon(tmp_path, 0)
        seen: list[dict[str, object]] = []
        stop = threading.Event()

        def sample() -> None:
            while not stop.wait(0.1):
                seen.append(beacon._record())

        sampler = threading.Thread(target=sample)
        sampler.start()
        try:
            with pytest.raises(Exception):  # noqa: B017 - the peer's exit, whatever its type
                dist.all_reduce(torch.ones(1))
            in_collective = list(seen)
            seen.clear()
            time.sleep(0.5)  # the worker's own blocking call
        finally:
            stop.set()
            sampler.join()
            dist.destroy_process_group()
    finally:
        os.killpg(peer.pid, signal.SIGKILL)
        peer.wait(timeout=30)
    assert in_collective and all(r["waiting"] for r in in_collective), in_collective
    assert in_collective[0]["backend"] == "gloo"
    assert seen and not any(r["waiting"] for r in seen)
    assert "test_hang.py" in str(seen[-1]["where"])


def test_a_pause_is_not_part_of_the_step_time(tmp_path: Path) -> None:
    beacon = ProgressBeacon(tmp_path, 0)
    beacon.step()
    with beacon.paused():
        assert beacon._record()["paused"] is True
        time.sleep(0.3)
    beacon.step()
    record = beacon._record()
    assert record["paused"] is False and record["step_s"] is not None
    assert float(record["step_s"]) < 0.2  # type: ignore[arg-type]


def test_the_nccl_flight_recorder_is_set_up_for_a_hangs_post_mortem_when_asked() -> None:
    """By construction on the CPU: what an NCCL group would be created with."""
    assert flight_recorder_env({}) == {}
    env = flight_recorder_env({FLIGHT_RECORDER_DIR_ENV: "/shared/fr/"})
    assert env == {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
                   "TORCH_FR_DUMP_TEMP_FILE": "/shared/fr/rank_"}


def test_time_the_agent_itself_did_not_run_does_not_count() -> None:
    """A starved machine: the agent's own observations come late, so the workers' silence
    in that time proves nothing; once it runs on time again the clock goes on."""
    judge = HangJudge(HangRules())
    judge.watch(3, 0.0)
    judge.observe([HEALTHY], 0.0)
    assert judge.observe([HEALTHY], 0.1) is None
    assert judge.observe([HEALTHY], 6.0) is None  # 5.9 s since the last: 5.4 s of it late
    judged_at = 5.4 + 2.0 + NO_CULPRIT_WAIT_S  # the limit counts from 5.4, on time
    assert watch(judge, [HEALTHY], 6.1, judged_at - 0.1) is None
    assert watch(judge, [HEALTHY], judged_at, judged_at + 0.1)


def test_the_keeper_kills_the_culprit_at_once_and_a_worker_still_there_after_the_grace(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two stand-in workers: a stopped culprit (SIGKILL now: a stopped process never acts
    on torch's SIGTERM) and one that ignores SIGTERM (killed after the stop grace)."""
    monkeypatch.setattr(hung_workers_module, "STOP_GRACE_S", 0.3)
    keeper = Keeper(MemoryBackend(MemoryStore()), "me", interval=1.0, timeout=30.0,
                    limits=Limits(1, 2, 1.0, None), control=AgentControl(tmp_path / "ctl"),
                    events=EventLog("run1", "me", "127.0.0.1", None))
    culprit, stubborn = (subprocess.Popen(["sleep", "60"], start_new_session=True)
                         for _ in range(2))
    try:
        os.kill(culprit.pid, signal.SIGSTOP)
        keeper._rounds.hung = Hung("stand-in", (Culprit(0, culprit.pid, "stopped"),),
                                   (culprit.pid, stubborn.pid))
        keeper.stop_hung_workers()
        assert culprit.wait(timeout=5) == -signal.SIGKILL
        assert stubborn.poll() is None  # its grace
        assert stubborn.wait(timeout=5) == -signal.SIGKILL
        keeper.stop_hung_workers()  # once per hang: nothing more
    finally:
        for proc in (culprit, stubborn):
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_running_outside_a_collective_blames_only_beside_a_worker_that_waits() -> None:
    """On gloo: one rank in its own loop while its neighbour waits in the collective is the
    culprit at the limit; every rank outside collectives (an evaluation not wrapped in
    ``no_hang_check``) is nobody's fault, and waits ``hang_busy`` before it is judged."""
    busy = replace(HEALTHY, waiting=False, where="train.py:9 evaluate")
    assert culprit_of(busy, peers_wait=False) is None
    hung = judge_after([busy, replace(HEALTHY, local_rank=1)], seconds=2.0)
    assert hung is not None and [c.local_rank for c in hung.culprits] == [0]
    assert judge_after([busy, replace(busy, local_rank=1)], seconds=59.0) is None
    hung = judge_after([busy, replace(busy, local_rank=1)], seconds=60.0 + NO_CULPRIT_WAIT_S)
    assert hung is not None and not hung.culprits
    assert "wrap it in ElasticLoop.no_hang_check()" in hung.why
    nccl = replace(busy, backend="nccl")  # on NCCL nothing tells a wait from work
    assert judge_after([nccl], seconds=2.0 + NO_CULPRIT_WAIT_S) is not None


def test_a_hang_nobody_here_is_to_blame_for_waits_until_a_dead_peer_would_be_judged() -> None:
    """A frozen peer node stalls every round the same way: its heartbeat verdict (free)
    must come first, or the round would be charged when the node comes back."""
    rules = HangRules(peers_judged=4.5)
    assert judge_after([HEALTHY], seconds=4.4, rules=rules) is None
    assert judge_after([HEALTHY], seconds=4.5, rules=rules) is not None
    assert judge_after([replace(HEALTHY, process="T")], seconds=2.0, rules=rules) is not None


def test_the_settings_wait_for_the_heartbeat_verdict() -> None:
    from elastic_ext.rendezvous.settings import parse_settings
    settings = parse_settings(endpoint="127.0.0.1:2379", run_id="r", min_nodes=1, max_nodes=2,
                              conf={"hang_floor": "1.5", "heartbeat_timeout": "5"})
    assert settings.hang.floor == 1.5 and settings.hang.peers_judged == 5 + 1.0 + 0.5


def test_a_worker_that_leaves_says_so_at_once(tmp_path: Path) -> None:
    """Its process may end before the next beat: the last word on file must be "paused",
    or the agent would take the silence of an exiting worker for a deadlock."""
    beacon = ProgressBeacon(tmp_path, 0, interval=60.0)  # no beat would come in time
    beacon._thread.start()
    beacon.step()
    beacon.close()
    record = json.loads((tmp_path / "beat-0").read_text())
    assert record["paused"] is True and record["step"] == 1
    beacon._thread.join(timeout=5)
    assert not beacon._thread.is_alive()
