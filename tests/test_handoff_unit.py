"""State hand-off, the fast parts: who restores what, the copies kept in node memory, the
agent's markers, and the guard keeping the state before a worker leaves mid-step."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
from pathlib import Path

import pytest
import torch

from elastic_ext.agent.control import AgentControl
from elastic_ext.control_channel import CONTROL_DIR_ENV, remove_abandoned
from elastic_ext.local.processes import wait_until
from elastic_ext.worker import control
from elastic_ext.worker.preemption import GuardSettings, PreemptionGuard
from elastic_ext.worker.snapshot import LocalCopies, Snapshotter, Source
from elastic_ext.worker.snapshot.agreement import Copy, Holding, Kind, plan_restore
from elastic_ext.worker.snapshot.handoff import decode, encode
from elastic_ext.worker.snapshot.layout import payload_name

SHA = {c: c * 64 for c in "abcdef"}


def mem(step: int, sha: str = "a") -> Holding:
    return Holding(memory=Copy(step, 100, SHA[sha], 1.5))


# ------------------------------------------------------------------------------- the plan
def test_the_newest_step_any_rank_holds_wins_and_the_lowest_holder_sends_it() -> None:
    plan = plan_restore([mem(5), Holding(), mem(7, "b"), mem(7, "b")])
    assert (plan.step, plan.kind, plan.source, plan.everyone_holds) == (7, Kind.MEMORY, 2, False)


def test_a_copy_in_memory_beats_a_snapshot_of_the_same_step_and_an_older_one_loses() -> None:
    disk = Holding(disk=Copy(7, 100, SHA["c"]))
    assert plan_restore([disk, mem(7, "b")]).kind is Kind.MEMORY
    newer_disk = Holding(disk=Copy(8, 100, SHA["c"]))
    plan = plan_restore([newer_disk, mem(7, "b")])
    assert (plan.step, plan.kind, plan.source) == (8, Kind.DISK, 0)


def test_every_rank_holding_the_same_copy_loads_its_own() -> None:
    assert plan_restore([mem(7), mem(7), mem(7)]).everyone_holds
    written_later = Holding(memory=Copy(7, 100, SHA["a"], created=99.0))  # same bytes
    assert plan_restore([mem(7), written_later]).everyone_holds
    assert not plan_restore([mem(7), mem(7), mem(6)]).everyone_holds


def test_only_ranks_whose_node_lacks_the_copy_receive_it() -> None:
    assert plan_restore([mem(7), mem(7), Holding()]).receivers == (2,)
    assert plan_restore([mem(7), mem(6), Holding()]).receivers == (1, 2)
    # Disk copies are reported by a node's local rank 0; its other ranks read the file.
    on_disk = Holding(disk=Copy(8, 100, SHA["c"]), node=11)
    plan = plan_restore([on_disk, Holding(node=11), Holding(node=12), mem(7)])
    assert (plan.step, plan.kind, plan.receivers) == (8, Kind.DISK, (2, 3))
    other = Holding(disk=Copy(8, 100, SHA["d"]), node=12)  # the same step, other bytes
    assert plan_restore([on_disk, Holding(node=11), other]).receivers == (2,)


def test_holders_of_the_newest_step_that_disagree_are_not_used() -> None:
    plan = plan_restore([mem(7, "a"), mem(7, "b"), Holding(disk=Copy(5, 100, SHA["c"]))])
    assert (plan.step, plan.kind, plan.source) == (5, Kind.DISK, 2)
    assert "hold different states" in plan.warnings[0] and "rank 1: bbbb" in plan.warnings[0]


def test_a_step_kept_in_a_later_round_supersedes_the_same_step_from_an_earlier_one() -> None:
    """A node frozen in round 3 wakes holding step 7 (it completed an update the others had
    not); the others trained step 7 again in round 4, without it."""
    woke = Holding(memory=Copy(7, 100, SHA["a"], round=3))
    went_on = Holding(memory=Copy(7, 100, SHA["b"], round=4))
    plan = plan_restore([woke, went_on, went_on])
    assert (plan.step, plan.source, plan.copy) == (7, 1, went_on.memory)
    assert "ranks [0] hold step 7 from a round before 4" in plan.warnings[0]
    tied = plan_restore([Holding(memory=Copy(7, 100, SHA["a"], round=4)), went_on])
    assert tied.step is None  # the same round and different bytes: trust neither


def test_differing_snapshots_of_one_step_take_the_lowest_ranks_with_a_warning() -> None:
    plan = plan_restore([Holding(disk=Copy(5, 1, SHA["c"])), Holding(disk=Copy(5, 1, SHA["d"]))])
    assert (plan.step, plan.source) == (5, 0) and "differ between ranks" in plan.warnings[0]


def test_nothing_held_anywhere_is_a_fresh_start() -> None:
    assert plan_restore([Holding(), Holding()]).step is None


def test_a_report_survives_its_trip_through_the_all_gather_row() -> None:
    holding = Holding(memory=Copy(12, 3 << 30, SHA["f"], 1796000000.25, round=41),
                      disk=Copy(10, 7, SHA["e"], 0.0), failed=True)
    assert decode(encode(holding)) == holding
    assert decode(encode(Holding())) == Holding()


# ------------------------------------------------------------------- copies in node memory
def _tree(value: float) -> dict[str, object]:
    return {"model": {"w": torch.full((3, 2), value)}, "data": {"epoch": 0, "offset": 7}}


def test_a_node_keeps_one_step_and_writes_it_once(tmp_path: Path) -> None:
    copies = LocalCopies(tmp_path)
    first = copies.write(3, _tree(1.0))
    assert first is not None and copies.write(3, _tree(2.0)) is None  # another worker's step 3
    assert copies.write(4, _tree(4.0)) is not None
    newest = copies.newest()
    assert newest is not None and newest.step == 4
    assert not (tmp_path / payload_name(3)).exists()


def test_the_same_state_gives_the_same_bytes_on_every_rank(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = LocalCopies(tmp_path / "a").write(9, _tree(1.5))
    b = LocalCopies(tmp_path / "b").write(9, _tree(1.5))
    assert a is not None and b is not None and a.sha256 == b.sha256


@pytest.mark.parametrize("damage", ["truncate", "corrupt"])
def test_a_damaged_copy_is_skipped_with_a_warning_naming_it(tmp_path: Path, damage: str,
                                                             caplog: pytest.LogCaptureFixture
                                                             ) -> None:
    (tmp_path / "mem").mkdir()
    copies = LocalCopies(tmp_path / "mem")
    copies.write(6, _tree(6.0))
    payload = tmp_path / "mem" / payload_name(6)
    data = payload.read_bytes()
    payload.write_bytes(data[:-9] if damage == "truncate" else data[:-9] + b"X" * 9)
    disk = Snapshotter(tmp_path / "disk", local=None)
    disk.commit_now(4, {"model": {"w": torch.full((3, 2), 4.0)}})
    disk.close()
    model = torch.nn.Module()
    model.register_buffer("w", torch.zeros(3, 2))
    with caplog.at_level(logging.WARNING, logger="elastic_ext.worker.snapshot"):
        restored = Snapshotter(tmp_path / "disk", local=copies).restore({"model": model})
    assert restored is not None and (restored.step, restored.source) == (4, Source.DISK)
    assert torch.equal(model.get_buffer("w"), torch.full((3, 2), 4.0))
    assert str(payload) in caplog.text


def test_a_lone_worker_restores_its_newer_copy_in_memory(tmp_path: Path) -> None:
    (tmp_path / "mem").mkdir()
    copies = LocalCopies(tmp_path / "mem")
    snapshots = Snapshotter(tmp_path / "disk", local=copies)
    linear = torch.nn.Linear(2, 2)
    snapshots.commit_now(4, {"model": linear})
    with torch.no_grad():
        linear.weight.fill_(9.0)
    assert snapshots.keep_local(5, {"model": linear, "data": {"offset": 5}}) is not None
    fresh = torch.nn.Linear(2, 2)
    restored = snapshots.restore({"model": fresh})
    snapshots.close()
    assert restored is not None and (restored.step, restored.source) == (5, Source.LOCAL)
    assert restored.state["data"] == {"offset": 5} and torch.equal(fresh.weight, linear.weight)
    assert restored.bytes == copies.newest().size  # type: ignore[union-attr]


def test_without_an_agent_nothing_is_kept(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(CONTROL_DIR_ENV, raising=False)
    snapshots = Snapshotter(None)
    assert snapshots.local is None and snapshots.keep_local(1, {"x": 1}) is None
    assert snapshots.restore({}) is None


# --------------------------------------------------------------------------- the agent's side
def test_a_kept_copy_records_the_round_its_workers_trained_in(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    agent = AgentControl(tmp_path / "ctl")
    monkeypatch.setenv(CONTROL_DIR_ENV, str(agent.path))
    agent.publish_round(5)
    copies = LocalCopies.of_this_node()
    assert copies is not None and copies.directory == agent.path / "state"
    kept = copies.write(9, _tree(9.0))
    assert kept is not None and kept.round == 5
    newest = copies.newest()
    assert newest is not None and newest.round == 5


def test_the_agent_gives_its_workers_a_state_directory_and_says_when_it_restarts_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    agent = AgentControl(tmp_path / "ctl")
    monkeypatch.setenv(CONTROL_DIR_ENV, str(agent.path))
    assert control.local_state_dir() == agent.path / "state"
    agent.publish_round(3)
    assert control.leaving_reason() is None
    agent.publish_leaving(3, "membership")
    assert control.leaving_reason() == "membership"
    agent.publish_round(4)
    assert control.leaving_reason() is None


def test_an_agent_removes_what_a_killed_agent_left_in_node_memory(tmp_path: Path) -> None:
    gone = subprocess.Popen(["true"])  # a pid that is gone
    gone.wait()
    left = tmp_path / f"elastic-ext-ctl-{gone.pid}-x1"
    (left / "state").mkdir(parents=True)
    (left / "state" / "snapshot-0000000001.snap").write_bytes(b"x" * 100)
    live = tmp_path / f"elastic-ext-ctl-{os.getpid()}-x2"
    live.mkdir()
    other = tmp_path / "unrelated"
    other.mkdir()
    assert remove_abandoned(tmp_path) == [left]
    assert not left.exists() and live.exists() and other.exists()


def test_a_framework_resume_dir_of_a_dead_worker_goes_and_control_dirs_stay(
        tmp_path: Path) -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()
    resume = tmp_path / f"elastic-ext-resume-{gone.pid}-ab"
    resume.mkdir()
    control = tmp_path / f"elastic-ext-ctl-{gone.pid}-cd"
    control.mkdir()
    live = tmp_path / f"elastic-ext-resume-{os.getpid()}-ef"
    live.mkdir()
    assert remove_abandoned(tmp_path, "elastic-ext-resume-") == [resume]
    assert control.exists() and live.exists()


def test_the_default_agent_directory_is_in_node_memory_and_goes_with_the_agent(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CONTROL_DIR_ENV, raising=False)
    agent = AgentControl()
    try:
        if Path("/dev/shm").is_dir():
            assert agent.path.parent == Path("/dev/shm")
        assert agent.path.name.startswith(f"elastic-ext-ctl-{os.getpid()}-")
        assert os.environ[CONTROL_DIR_ENV] == str(agent.path)
    finally:
        agent.close()
    assert not agent.path.exists() and CONTROL_DIR_ENV not in os.environ


# ------------------------------------------------------------------------------ the guard
@pytest.fixture
def agent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AgentControl:
    ctl = AgentControl(tmp_path / "ctl")
    monkeypatch.setenv(CONTROL_DIR_ENV, str(ctl.path))
    ctl.publish_round(1)
    return ctl


def test_a_stop_from_an_agent_restarting_the_round_needs_no_durable_snapshot(
        agent: AgentControl) -> None:
    guard = PreemptionGuard()
    assert guard.agree() == guard.agree()  # nothing signalled: no stop, no restart
    guard._on_signal(signal.SIGTERM, None)
    assert not guard.agree().restart  # a SIGTERM without the agent's word is a real stop
    agent.publish_leaving(1, "membership")
    agreed = guard.agree()
    assert agreed.stop and agreed.restart
    stopping = PreemptionGuard()
    agent.publish_preemption("the whole job stops")
    assert stopping.agree().stop and not stopping.agree().restart  # a job's stop is real


def test_a_peer_fault_keeps_the_state_before_the_worker_holds(agent: AgentControl) -> None:
    calls: list[tuple[str, str]] = []
    guard = PreemptionGuard(GuardSettings(hold_timeout_s=5),
                            keep_state=lambda why: calls.append((why, guard.phase.value)))

    def agent_stops_it() -> None:  # as the agent does once it reads the report
        wait_until(lambda: (agent.path / "fault-1").exists() or None, timeout=5,
                   what="the worker's fault report")
        guard._note(signal.SIGTERM)

    stopper = threading.Thread(target=agent_stops_it, daemon=True)
    stopper.start()
    code = guard.failure_exit_code(RuntimeError("Connection reset by peer"))
    stopper.join(10)
    assert code == 128 + signal.SIGTERM
    assert calls == [("a collective failed", "committing")]  # the watchdog leaves it alone


def test_the_state_is_kept_once_and_a_second_caller_waits_for_the_first() -> None:
    started, release = threading.Event(), threading.Event()
    calls: list[str] = []

    def keep(why: str) -> None:
        calls.append(why)
        started.set()
        release.wait(5)

    guard = PreemptionGuard(keep_state=keep)
    first = threading.Thread(target=guard._keep, args=("watchdog",))
    first.start()
    started.wait(5)
    second_done = threading.Event()

    def second_keep() -> None:
        guard._keep("main")
        second_done.set()

    second = threading.Thread(target=second_keep)
    second.start()
    assert not second_done.wait(0.2)  # blocked until the first keep ends
    release.set()
    first.join(5)
    second.join(5)
    assert second_done.is_set() and calls == ["watchdog"]


def test_a_node_memory_too_small_for_the_state_keeps_nothing_and_says_so(
        small_tmpfs: Path, caplog: pytest.LogCaptureFixture) -> None:
    copies = LocalCopies(small_tmpfs)
    assert copies.write(1, {"w": torch.zeros(100, 100)}) is not None  # 40 KB fits
    with caplog.at_level(logging.WARNING, logger="elastic_ext.worker.snapshot"):
        assert copies.write(2, {"w": torch.zeros(400, 400)}) is None  # 640 KB does not
    assert f"could not keep the state of step 2 in {small_tmpfs}" in caplog.text
    assert "No space left on device" in caplog.text
    assert not [name for name in os.listdir(small_tmpfs) if name.endswith(".tmp")]
    newest = copies.newest()
    assert newest is not None and newest.step == 1  # the older step is still there


# ------------------------------------------------------------------ preemption notices
def test_a_notice_goes_to_the_agent_and_the_stop_it_publishes_stops_running_and_later_workers(
        agent: AgentControl) -> None:
    previous = signal.getsignal(signal.SIGUSR2)
    try:
        signal.signal(signal.SIGUSR2, signal.SIG_IGN)  # as torchrun-node.sh leaves it
        assert agent.catch_preemption()
        running = PreemptionGuard()
        assert not running.agree().stop
        os.kill(os.getpid(), signal.SIGUSR2)  # to the agent's process (this one, here)
        assert agent.notice() == "SIGUSR2 to the agent"
        assert not running.agree().stop  # the agent settles it with the others' first
        agent.publish_preemption("the whole job stops")
        agreed = running.agree()
        assert agreed.stop and not agreed.restart and running.signalled == signal.SIGUSR2
        later = PreemptionGuard().install()  # a worker that starts after the stop
        try:
            assert later.signalled == signal.SIGUSR2 and later.preempted_exit_code() == 0
        finally:
            later.uninstall()
    finally:
        signal.signal(signal.SIGUSR2, previous)


def test_a_workers_own_notice_goes_to_its_agent_and_does_not_stop_the_job(
        agent: AgentControl) -> None:
    guard = PreemptionGuard().install()
    try:
        os.kill(os.getpid(), signal.SIGUSR2)
        wait_until(agent.notice, timeout=5, what="the notice passed on")
        assert agent.notice() == "SIGUSR2 to a worker"
        assert not guard.agree().stop and guard.signalled is None
    finally:
        guard.uninstall()


def test_the_agent_leaves_someone_elses_sigusr2_handler_alone(agent: AgentControl) -> None:
    previous = signal.getsignal(signal.SIGUSR2)

    def theirs(signum: int, frame: object) -> None: ...
    try:
        signal.signal(signal.SIGUSR2, theirs)
        assert not agent.catch_preemption()
        assert signal.getsignal(signal.SIGUSR2) is theirs
    finally:
        signal.signal(signal.SIGUSR2, previous)


def test_a_worker_reports_the_first_step_of_each_round_once(agent: AgentControl) -> None:
    assert not agent.progress_reported(1)
    guard = PreemptionGuard()
    guard.agree()
    assert agent.progress_reported(1)
    (agent.path / "progress-1").unlink()
    guard.agree()  # once per round: not written again
    assert not agent.progress_reported(1)
    agent.publish_round(2)
    guard.agree()
    assert agent.progress_reported(2)


def test_a_workers_rng_streams_continue_after_a_hand_off_and_a_new_slot_is_seeded(
        tmp_path: Path) -> None:
    """What the next worker of a slot draws is what the kept one would have drawn; a slot
    with nothing kept (a new node, a dead one's rank) gets a stream of its own, the same
    for the same step, rank and run."""
    import random

    import numpy as np

    from elastic_ext.worker.snapshot.rng import continue_worker_rng, keep_worker_rng

    torch.manual_seed(3)
    random.seed(3)
    np.random.seed(3)
    torch.rand(5)  # the stream moved on from its seed
    keep_worker_rng(tmp_path, 7, local_rank=0)
    expected = (torch.rand(4), random.random(), float(np.random.rand()))
    torch.manual_seed(0)  # the next worker's generators, as its script seeds them
    random.seed(0)
    np.random.seed(0)
    assert continue_worker_rng(tmp_path, 7, 0, 2, "run")
    assert torch.equal(torch.rand(4), expected[0]) and random.random() == expected[1]
    assert float(np.random.rand()) == expected[2]

    def seeded(step: int, local_rank: int, rank: int) -> torch.Tensor:
        assert not continue_worker_rng(tmp_path, step, local_rank, rank, "run")
        return torch.rand(4)

    assert not torch.equal(seeded(7, 1, 2), seeded(7, 1, 3))  # a stream per rank
    assert torch.equal(seeded(7, 1, 2), seeded(7, 1, 2))  # reproducible
    assert not torch.equal(seeded(8, 0, 2), expected[0])  # kept with step 7, not 8
    keep_worker_rng(tmp_path, 8, local_rank=0)  # the slot keeps one step
    assert [p.name for p in tmp_path.glob("rng-*")] == ["rng-0000000008-local0.pt"]
    (tmp_path / "rng-0000000008-local0.pt").write_bytes(b"damaged")
    assert not continue_worker_rng(tmp_path, 8, 0, 2, "run")  # seeded instead, said so
