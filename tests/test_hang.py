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
from elastic_ext.rendezvous.protocol.hang import (
    NO_CULPRIT_WAIT_S,
    Beacon,
    HangJudge,
    HangRules,
    culprit_of,
)
from elastic_ext.rendezvous.protocol.policy import Limits
from elastic_ext.rendezvous.protocol.pressure import Leave, RoundPressure, TellLost
from elastic_ext.rendezvous.protocol.state import Reason
from elastic_ext.worker.distributed import FLIGHT_RECORDER_DIR_ENV, flight_recorder_env
from elastic_ext.worker.progress import ProgressBeacon
from tests.support.handler_lab import FakeClock

HEALTHY = Beacon(local_rank=0, pid=100, round=3, step=50, steps_in_round=50, step_s=0.06,
                 paused=False, waiting=True, where="torch/distributed/c10d.py:1 all_reduce",
                 backend="gloo", silent_s=0.1, process="S")


def judge_after(beacons: list[Beacon], *, seconds: float, rules: HangRules | None = None
                ) -> object:
    """The verdict of a judge that saw ``beacons`` at 0 and again ``seconds`` later."""
    judge = HangJudge(rules or HangRules())
    judge.watch(3, 0.0)
    assert judge.observe(beacons, 0.0) is None
    return judge.observe(beacons, seconds)


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
    judge.observe([stopped], 0.0)
    hung = judge.observe([stopped], 2.0)
    assert hung is not None and "no training step for 2.0s" in hung.why
    assert [c.pid for c in hung.culprits] == [100] and "is stopped" in hung.why
    assert judge.observe([stopped], 9.0) is None  # once per round


def test_progress_or_a_pause_restarts_the_clock() -> None:
    judge = HangJudge(HangRules())
    judge.watch(3, 0.0)
    judge.observe([HEALTHY], 0.0)
    assert judge.observe([replace(HEALTHY, step=51)], 1.9) is None  # a step: progress
    assert judge.observe([replace(HEALTHY, step=51)], 3.0) is None  # 1.1 s since
    assert judge.observe([replace(HEALTHY, step=51, paused=True)], 3.8) is None
    assert judge.observe([replace(HEALTHY, step=51)], 5.7 + NO_CULPRIT_WAIT_S) is None
    assert judge.observe([replace(HEALTHY, step=51)], 5.9 + NO_CULPRIT_WAIT_S) is not None


def test_beacons_of_another_round_or_none_are_not_judged() -> None:
    assert judge_after([replace(HEALTHY, round=2)], seconds=100) is None
    assert judge_after([], seconds=100) is None
    assert judge_after([HEALTHY], seconds=100, rules=HangRules(enabled=False)) is None


def test_the_slowest_local_rank_decides_progress() -> None:
    judge = HangJudge(HangRules())
    judge.watch(3, 0.0)
    judge.observe([HEALTHY, replace(HEALTHY, local_rank=1, step=49)], 0.0)
    # rank 0 moves on, rank 1 does not: no step of the round completed on this node
    assert judge.observe([replace(HEALTHY, step=51), replace(HEALTHY, local_rank=1, step=49)],
                         3.1 + NO_CULPRIT_WAIT_S) is not None


def test_a_node_without_a_culprit_waits_longer_than_the_culprits_node() -> None:
    assert judge_after([HEALTHY], seconds=2.0) is None
    hung = judge_after([HEALTHY], seconds=2.0 + NO_CULPRIT_WAIT_S)
    assert hung is not None and not hung.culprits  # type: ignore[attr-defined]


@pytest.mark.parametrize(("change", "how"), [
    ({"process": "T"}, "is stopped"),
    ({"process": "t"}, "is stopped"),
    ({"process": "D"}, "cannot be killed"),
    ({"silent_s": 3.0}, "runs no Python"),
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
])
def test_what_does_not(change: dict[str, object]) -> None:
    assert culprit_of(replace(HEALTHY, **change)) is None  # type: ignore[arg-type]


def test_two_blamed_hangs_in_a_row_take_the_node_out_and_one_without_blame_resets() -> None:
    judge = HangJudge(HangRules())
    stopped = replace(HEALTHY, process="T")
    for round_, beacons, leaves in ((3, [stopped], False), (4, [HEALTHY], False),
                                    (5, [stopped], False), (6, [stopped], True)):
        judge.watch(round_, 0.0)
        beacons = [replace(b, round=round_) for b in beacons]
        judge.observe(beacons, 0.0)
        assert judge.observe(beacons, 10.0) is not None
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
    assert pressure.worker_report(reports) == []
    clock.sleep(2.5)
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
    pressure.worker_report(reports)
    clock.sleep(2.0 + NO_CULPRIT_WAIT_S + 0.1)
    leave = pressure.worker_report(reports)[-1]
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
"""


def test_the_beacon_sees_the_main_thread_in_a_collective_or_elsewhere(tmp_path: Path) -> None:
    """The beacon thread samples where the main thread is: in gloo's all-reduce, waiting
    for a peer that never comes, or in a blocking call of its own."""
    peer = subprocess.Popen([sys.executable, "-c", RANK1, str(tmp_path / "store"), "6"],
                            start_new_session=True)
    try:
        dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 2),
                                rank=0, world_size=2, timeout=timedelta(seconds=1.5))
        beacon = ProgressBeacon(tmp_path, 0)
        seen: list[dict[str, object]] = []
        stop = threading.Event()

        def sample() -> None:
            while not stop.wait(0.1):
                seen.append(beacon._record())

        sampler = threading.Thread(target=sample)
        sampler.start()
        try:
            with pytest.raises(Exception):  # noqa: B017 - gloo's timeout, whatever its type
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
