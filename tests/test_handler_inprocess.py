"""The handler and the keeper, in-process, against the in-memory backend and simulated time.

Every branch of the orchestration that the torchrun tests reach only after minutes of
real agents runs here in milliseconds and deterministically: other nodes are played by
writing their state and heartbeats into the store, time passes only when the handler
sleeps or a test advances it, and the keeper ticks when the test says so.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket

import pytest
from torch.distributed import HashStore
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.elastic.rendezvous.api import RendezvousClosedError, RendezvousTimeoutError

from elastic_ext.control_channel import CONTROL_DIR_ENV
from elastic_ext.rendezvous.agent import handler as handler_module
from elastic_ext.rendezvous.agent.head_path import CLOSER_REQUESTS
from elastic_ext.rendezvous.agent.join_session import OLD_ROUND_GRACE_S
from elastic_ext.rendezvous.agent.presence import PresenceListener
from elastic_ext.rendezvous.errors import (
    JobFinishedError,
    NodeExcludedError,
    NodeLeftError,
    RestartBudgetExhaustedError,
    StoreUnavailableError,
)
from elastic_ext.rendezvous.protocol.joins import JoinEntry
from elastic_ext.rendezvous.protocol.state import NodeInfo, Phase, Reason, Status
from elastic_ext.worker.control import (
    peer_lost,
    preemption_requested,
    report_done,
    report_notice,
    report_peer_failure,
    report_progress,
    report_setup_failure,
)
from tests.support.handler_lab import (
    ME,
    FakeStarter,
    Lab,
    closed_round,
    join_with_peer,
)
from tests.support.memory_backend import MemoryBackend


# -- rounds ------------------------------------------------------------------------------
def test_a_lone_node_starts_a_generation_and_joins_its_first_round(make_lab) -> None:
    lab = make_lab()
    info = lab.handler.next_rendezvous()
    assert (info.rank, info.world_size) == (0, 1) and isinstance(info.store, HashStore)
    assert lab.handler.get_backend() == "etcd-ext" and lab.handler.num_nodes_waiting() == 0
    state = lab.state()
    assert (state.round, state.phase, state.order) == (1, Phase.CLOSED, (ME,))
    assert [e["event"] for e in lab.events()] == ["started", "state", "state", "joined"]
    joined = lab.events("joined")[0]
    assert (joined["round"], joined["rank"], joined["world_size"]) == (1, 0, 1)
    assert joined["master_port"] == state.members[ME].port


def test_two_nodes_close_the_round_at_max_and_the_first_is_rank_0(make_lab) -> None:
    lab = make_lab(nnodes=(2, 2))
    join_with_peer(lab)
    assert lab.state().order == ("peer", ME)


def test_below_the_minimum_the_node_times_out_with_a_message_naming_the_fix(make_lab) -> None:
    lab = make_lab(nnodes=(2, 3), join_timeout="5")
    with pytest.raises(RendezvousTimeoutError, match="1 node\\(s\\) joined, --nnodes needs at "
                                                      "least 2.*raise --rdzv-conf join_timeout"):
        lab.handler.next_rendezvous()
    assert 5.0 <= lab.clock.now - 1000.0 < 5.2  # the deadline, in simulated time


# -- store outages -----------------------------------------------------------------------
def outage(lab: Lab, seconds: float) -> float:
    """Take the store down for ``seconds`` of the lab's time; when it comes back."""
    lab.store.down = True
    ends = lab.clock.now + seconds

    def come_back() -> None:
        if lab.clock.now >= ends:
            lab.store.down = False
    lab.clock.on_sleep.append(come_back)
    return ends


def test_an_etcd_outage_during_a_rendezvous_is_waited_out(make_lab) -> None:
    lab = make_lab()
    lab.handler.next_rendezvous()
    outage_ends = outage(lab, 4.0)
    info = lab.handler.next_rendezvous()  # a restart while the store is down
    assert info.world_size == 1 and lab.state().round == 2
    assert lab.clock.now >= outage_ends


def test_an_outage_longer_than_the_join_timeout_fails_the_rendezvous(make_lab) -> None:
    lab = make_lab(join_timeout="5")
    lab.handler.next_rendezvous()
    lab.store.down = True
    with pytest.raises(StoreUnavailableError):
        lab.handler.next_rendezvous()
    assert lab.clock.now - 1000.0 >= 5.0


def test_a_store_slow_at_the_first_heartbeat_is_waited_for_until_the_join_timeout(
        make_lab) -> None:
    """1,024 agents starting at once: etcd answered an agent's version check, then not its
    first heartbeat within connect_timeout, and the agent failed to start."""
    lab = make_lab(join_timeout="30")
    back_at = outage(lab, 20.0)
    assert lab.handler.next_rendezvous().world_size == 1
    assert lab.clock.now >= back_at
    late = make_lab(join_timeout="5")
    late.store.down = True
    with pytest.raises(StoreUnavailableError):
        late.handler.next_rendezvous()
    assert 5.0 <= late.clock.now - 1000.0 < 5.2
    embedded = make_lab(transient=False)
    embedded.store.down = True
    with pytest.raises(StoreUnavailableError):
        embedded.handler.next_rendezvous()
    assert embedded.clock.now == 1000.0


def test_losing_the_embedded_store_ends_the_rendezvous_at_once(make_lab) -> None:
    lab = make_lab(transient=False)
    lab.handler.next_rendezvous()
    lab.store.down = True
    started = lab.clock.now
    with pytest.raises(StoreUnavailableError, match="down"):
        lab.handler.next_rendezvous()
    assert lab.clock.now == started


# -- the keeper ----------------------------------------------------------------------------
def test_a_peer_whose_heartbeat_stops_is_dead_after_the_timeout_and_costs_nothing(
        make_lab) -> None:
    lab = make_lab(nnodes=(1, 2))
    join_with_peer(lab)
    lab.advance(2.5, beating=("peer",))
    assert lab.handler.num_nodes_waiting() == 0
    assert set(lab.keeper.peer_silence()) == {"peer"}
    lab.advance(3.0)  # the peer stops beating
    assert lab.handler.num_nodes_waiting() == 1
    assert lab.keeper.pressure.reason is Reason.MEMBERSHIP
    assert lab.events("node_dead")[0]["peer"] == "peer"
    info = lab.handler.next_rendezvous()
    assert (info.rank, info.world_size) == (0, 1)
    assert lab.state().restarts == 0  # a death is free
    assert lab.events("restart")[0]["why"] == "dead or hung: peer"
    lab.advance(0.5)
    assert lab.keeper.peer_silence() == {}  # the metrics show the current round's peers


def test_a_blind_observer_judges_nobody_for_the_time_it_could_not_see(make_lab) -> None:
    lab = make_lab(nnodes=(1, 2))
    join_with_peer(lab)
    lab.advance(1.0, beating=("peer",))
    lab.store.down = True
    lab.advance(10.0)  # the store is down: nobody can beat, nobody is judged
    lab.store.down = False
    lab.advance(2.5)  # the peer has not beaten yet, but only 2.5 s were observed
    assert lab.handler.num_nodes_waiting() == 0 and not lab.events("node_dead")
    lab.advance(1.0)
    assert lab.handler.num_nodes_waiting() == 1


def test_a_workers_fault_report_makes_the_agent_leave_the_round(
        make_lab, monkeypatch: pytest.MonkeyPatch) -> None:
    lab = make_lab(nnodes=(1, 2))
    join_with_peer(lab)
    monkeypatch.setenv(CONTROL_DIR_ENV, str(lab.control.path))
    assert report_peer_failure("rank 1: RuntimeError: Connection reset by peer")
    lab.advance(0.5, beating=("peer",))
    assert lab.handler.num_nodes_waiting() == 1
    assert lab.keeper.pressure.why == "a worker reported a peer fault"


def test_a_fault_report_is_acted_on_at_the_agents_next_poll_not_the_next_tick(
        make_lab, monkeypatch: pytest.MonkeyPatch) -> None:
    lab = make_lab(nnodes=(1, 2))
    join_with_peer(lab)
    monkeypatch.setenv(CONTROL_DIR_ENV, str(lab.control.path))
    assert report_peer_failure("rank 1: RuntimeError: Connection reset by peer")
    assert lab.handler.num_nodes_waiting() == 1  # no keeper tick in between
    leaving = lab.events("leaving_round")
    assert [(e["round"], e["reason"]) for e in leaving] == [(1, "failure")]


@pytest.mark.parametrize("kind", ["setup fault", "peer fault"])
def test_a_dead_warm_start_server_costs_no_restart_unlike_an_unexplained_peer_fault(
        make_lab, monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    lab = make_lab(nnodes=(1, 2))
    join_with_peer(lab)
    monkeypatch.setenv(CONTROL_DIR_ENV, str(lab.control.path))
    report = report_setup_failure if kind == "setup fault" else report_peer_failure
    assert report("rank 1: the warm-start server died")
    assert lab.handler.num_nodes_waiting() == 1

    def peer_rejoins() -> None:  # the peer restarts its workers too: same membership
        lab.peer.beat("peer")
        state = lab.state()
        if state.phase is Phase.OPEN and "peer" not in state.members:
            lab.put_state(dataclasses.replace(
                state, members={**state.members, "peer": NodeInfo("127.0.0.1", 30000)}))
    lab.clock.on_sleep.append(peer_rejoins)
    info = lab.handler.next_rendezvous()
    assert info.world_size == 2
    # An unexplained fault with unchanged membership is a worker failure: charged.
    assert lab.state().restarts == (0 if kind == "setup fault" else 1)


def test_a_stop_for_a_dead_peer_tells_the_workers_not_to_wait_for_a_step_boundary(
        make_lab, monkeypatch: pytest.MonkeyPatch) -> None:
    lab = make_lab(nnodes=(1, 2))
    join_with_peer(lab)
    monkeypatch.setenv(CONTROL_DIR_ENV, str(lab.control.path))
    lab.advance(1.0, beating=("peer",))
    assert not peer_lost()
    lab.advance(3.0)  # the peer stops beating: dead
    assert lab.handler.num_nodes_waiting() == 1 and peer_lost()
    lab.handler.next_rendezvous()
    assert not peer_lost()  # a new round starts clean


def test_a_dead_peer_is_reported_to_the_workers_even_after_a_newer_round_came_first(
        make_lab, monkeypatch: pytest.MonkeyPatch) -> None:
    lab = make_lab(nnodes=(1, 3))
    lab.peer.beat("peer")
    lab.peer.beat("frozen")
    lab.put_state(closed_round(("peer", "frozen"), round_=1))
    lab.put_state(dataclasses.replace(lab.state(), phase=Phase.OPEN, order=()))
    lab.handler.next_rendezvous()  # me, peer and frozen in round 1 ... as played below
    monkeypatch.setenv(CONTROL_DIR_ENV, str(lab.control.path))
    lab.advance(1.0, beating=("peer", "frozen"))
    current = lab.state()
    lab.put_state(dataclasses.replace(current, round=current.round + 1, phase=Phase.OPEN,
                                      order=(), previous=current.order,
                                      members={"peer": current.members["peer"]}))
    lab.advance(0.5, beating=("peer",))  # the peer opened a round before we judged
    assert "replaced" in lab.keeper.pressure.why and not peer_lost()
    lab.advance(3.0, beating=("peer",))
    assert not peer_lost()  # "peer" watches everyone: we go by its verdict
    lab.publish_verdict("peer", {"frozen"})  # its clock finds "frozen" dead
    lab.advance(0.5, beating=("peer",))
    assert peer_lost()
    lab.clock.on_sleep.append(lambda: lab.peer.beat("peer"))
    lab.handler.next_rendezvous()  # the round without "frozen"
    lab.advance(3.5, beating=("peer",))  # "frozen" still silent, judged dead again
    assert not peer_lost()  # but it is not in this round: a stop here may save


def test_a_newcomer_to_a_running_job_asks_to_join_once_its_workers_can_start_warm(
        make_lab) -> None:
    starter = FakeStarter(ready_after=2.0)
    lab = make_lab(nnodes=(1, 3), starter=starter)
    starter.clock = lab.clock
    lab.peer.beat("peer")
    lab.put_state(closed_round(("peer",)))  # a job that trains without us
    began = lab.clock.now
    asked_at: list[float] = []
    lab.clock.on_sleep.append(lambda: lab.peer.beat("peer"))
    lab.clock.on_sleep.append(lab.keeper.tick)  # the peer stays alive in our eyes
    lab.clock.on_sleep.append(lambda: asked_at.append(lab.clock.now)
                              if ME in lab.state().waiting and not asked_at else None)
    with pytest.raises(RendezvousTimeoutError):
        lab.handler.next_rendezvous()  # nobody plays the peer's restart: we only wait
    assert starter.waits == [60.0]
    assert asked_at and asked_at[0] >= began + 2.0  # it asked only after its starter was ready
    lab.handler.shutdown()
    assert starter.closed


def test_nodes_starting_a_job_together_do_not_wait_for_their_starters(make_lab) -> None:
    starter = FakeStarter(ready_after=2.0)
    lab = make_lab(starter=starter)
    starter.clock = lab.clock
    lab.handler.next_rendezvous()
    assert starter.waits == []


def _refused_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])  # closed on exit: connections are refused


@pytest.mark.parametrize("peer_agent", ["gone", "alive"])
def test_a_round_waits_for_a_silent_member_only_while_someone_listens_at_its_port(
        make_lab, monkeypatch: pytest.MonkeyPatch, peer_agent: str) -> None:
    lab = make_lab(nnodes=(1, 2))
    listener = PresenceListener()
    port = _refused_port() if peer_agent == "gone" else listener.port
    lab.peer.beat("peer", port)
    lab.put_state(dataclasses.replace(closed_round(("peer",)), phase=Phase.OPEN, order=()))
    lab.handler.next_rendezvous()
    lab.peer.beat("peer", port)
    lab.keeper.tick()  # the keeper reads the peer's presence port from its heartbeat
    monkeypatch.setenv(CONTROL_DIR_ENV, str(lab.control.path))
    assert report_peer_failure("rank 1: RuntimeError: Connection reset by peer")
    assert lab.handler.num_nodes_waiting() == 1
    before = lab.clock.now
    info = lab.handler.next_rendezvous()  # the peer never rejoins
    listener.close()
    assert (info.rank, info.world_size) == (0, 1)
    waited = lab.clock.now - before
    if peer_agent == "gone":
        assert waited < 0.5, waited  # no last call for a node whose agent is gone
    else:
        assert waited >= 1.0, waited  # last_call_timeout for a live agent's rejoin


def test_a_fault_report_while_the_store_is_down_still_releases_the_workers(
        make_lab, monkeypatch: pytest.MonkeyPatch) -> None:
    lab = make_lab(nnodes=(1, 2))
    join_with_peer(lab)
    lab.store.down = True
    lab.advance(1.0)
    assert lab.handler.num_nodes_waiting() == 0
    monkeypatch.setenv(CONTROL_DIR_ENV, str(lab.control.path))
    assert report_peer_failure("rank 1: RuntimeError: Connection reset by peer")
    lab.advance(0.5)
    assert lab.handler.num_nodes_waiting() == 1
    assert "while the store is unreachable" in lab.keeper.pressure.why


def test_a_newer_round_makes_a_running_agent_restart_and_join_it(make_lab) -> None:
    lab = make_lab(nnodes=(1, 2))
    lab.handler.next_rendezvous()
    lab.peer.beat("peer")
    lab.put_state(dataclasses.replace(lab.state(), round=2, phase=Phase.OPEN, order=(),
                                      members={"peer": NodeInfo("127.0.0.1", 30001)},
                                      previous=(ME,)))
    lab.advance(0.5, beating=("peer",))
    assert lab.handler.num_nodes_waiting() == 1
    assert lab.keeper.pressure.why == "round 2 (open) replaced round 1"
    info = lab.handler.next_rendezvous()
    assert (info.rank, info.world_size) == (0, 2)  # the old member keeps its rank
    assert lab.state().round == 2 and lab.state().restarts == 0


def test_a_node_waiting_to_join_makes_the_agents_restart_when_there_is_room(make_lab) -> None:
    lab = make_lab(nnodes=(1, 2))
    lab.handler.next_rendezvous()
    lab.peer.beat("late")
    lab.put_state(dataclasses.replace(lab.state(),
                                      waiting={"late": NodeInfo("127.0.0.1", 30002)}))
    lab.advance(0.5, beating=("late",))
    assert lab.handler.num_nodes_waiting() == 1
    assert lab.keeper.pressure.why == "waiting to join: late"


# -- the restart budget and closing --------------------------------------------------------
def test_a_spent_budget_stops_the_agent_with_a_message(make_lab) -> None:
    lab = make_lab(nnodes=(1, 2))
    lab.handler.next_rendezvous()
    note = "restart budget spent: 4 worker-failure restarts > --max-restarts=3"
    lab.put_state(dataclasses.replace(lab.state(), status=Status.BUDGET_SPENT, note=note))
    lab.advance(0.5)
    assert lab.handler.num_nodes_waiting() == 1
    with pytest.raises(RestartBudgetExhaustedError, match="every agent stops. Fix the failing"):
        lab.handler.next_rendezvous()
    assert lab.events("budget_spent")[0]["note"] == note


def test_a_worker_failure_with_unchanged_membership_is_charged(make_lab) -> None:
    lab = make_lab()
    lab.handler.next_rendezvous()
    lab.handler.next_rendezvous()  # the agent restarts its failed workers: no keeper reason
    assert lab.state().restarts == 1
    assert "worker failure, restart 1 charged" in lab.state().note


def test_an_agent_that_gave_up_marks_the_budget_spent_for_everyone(make_lab) -> None:
    lab = make_lab(nnodes=(1, 2), max_restarts="2")
    join_with_peer(lab)
    assert lab.handler.shutdown() and lab.state().status is Status.ACTIVE  # a clean exit
    lab = make_lab(nnodes=(1, 2), max_restarts="2")
    join_with_peer(lab)
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file="/nonexistent")
    try:
        raise ChildFailedError("trainer", {0: failure})
    except ChildFailedError:  # torch's launch_agent calls shutdown() in its finally
        assert lab.handler.shutdown()
    state = lab.state()
    assert state.status is Status.BUDGET_SPENT and "--max-restarts=2" in state.note
    assert lab.events("budget_spent") and lab.events("left")


def test_the_last_node_out_removes_a_finished_run_and_keeps_one_that_did_not_finish(
        make_lab, monkeypatch: pytest.MonkeyPatch) -> None:
    lab = make_lab()
    lab.handler.next_rendezvous()
    assert lab.handler.shutdown()  # not finished: a node that was away must read how it ended
    assert lab.state().status is Status.ACTIVE and lab.peer.read_beats([ME]) == {ME: b"left"}
    monkeypatch.setattr(handler_module, "workers_succeeded", lambda: True)
    lab = make_lab()
    lab.handler.next_rendezvous()
    assert lab.handler.shutdown()
    assert lab.peer.get_state() is None and lab.peer.read_beats([ME]) == {ME: None}


@pytest.mark.parametrize("how", ["notice", "steps-without-done", "job-stopping", "leaving"])
def test_workers_that_exit_0_without_completing_the_training_do_not_finish_the_run(
        make_lab, monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    """Issue 23: preempted workers exit 0 too; only training declares the finish."""
    lab = make_lab(nnodes=(1, 2))
    join_with_peer(lab)
    monkeypatch.setattr(handler_module, "workers_succeeded", lambda: True)
    monkeypatch.setenv(CONTROL_DIR_ENV, str(lab.control.path))
    report_progress()  # workers that speak the protocol
    lab.advance(0.5, beating=("peer",))
    if how == "notice":
        report_done()
        report_notice("SIGUSR2 to a worker")
    elif how == "job-stopping":
        report_done()
        lab.put_state(dataclasses.replace(lab.state(), stop="the whole job stops"))
    elif how == "leaving":
        report_done()
        lab.put_state(dataclasses.replace(lab.state(), leaving={ME: "SIGUSR2 to the agent"}))
    assert lab.handler.shutdown()
    assert lab.state().status is Status.ACTIVE
    if how == "steps-without-done":  # the same, once the workers say the training is done
        lab = make_lab(nnodes=(1, 2))
        join_with_peer(lab)
        monkeypatch.setenv(CONTROL_DIR_ENV, str(lab.control.path))
        report_progress()
        lab.advance(0.5, beating=("peer",))
        report_done()
        assert lab.handler.shutdown() and lab.state().status is Status.FINISHED


def test_a_closed_run_refuses_new_rounds(make_lab) -> None:
    lab = make_lab()
    lab.handler.next_rendezvous()
    assert not lab.handler.is_closed()
    lab.handler.set_closed()
    assert lab.handler.is_closed()
    with pytest.raises(RendezvousClosedError, match="run1 was closed"):
        lab.handler.next_rendezvous()



# -- a job that finished while this node was away ------------------------------------------
def test_a_node_that_wakes_after_the_run_was_removed_exits_at_once(make_lab) -> None:
    lab = make_lab(nnodes=(2, 2))
    join_with_peer(lab)
    lab.advance(1.0, beating=("peer",))
    # frozen meanwhile: the peer finished, left and, last out, removed the run's keys
    lab.peer.leave("peer")
    lab.peer.remove_run()
    lab.advance(0.5)
    assert lab.handler.num_nodes_waiting() == 1
    assert "the job finished" in lab.keeper.pressure.why
    started = lab.clock.now
    with pytest.raises(JobFinishedError, match="finished while this node was away"):
        lab.handler.next_rendezvous()
    assert lab.clock.now == started  # no join_timeout wait
    assert lab.events("finished_away")


def test_a_node_that_wakes_after_the_budget_was_spent_exits_naming_why(make_lab) -> None:
    """Issue 23: the last node out keeps the state of a run that did not finish, so a node
    that was frozen through the end reads how it ended instead of taking a missing state
    for a finish (exit 0)."""
    lab = make_lab(nnodes=(2, 2))
    join_with_peer(lab)
    lab.advance(1.0, beating=("peer",))
    # frozen meanwhile: the job spent its budget, the peer left last and kept the state
    lab.put_state(dataclasses.replace(lab.state(), status=Status.BUDGET_SPENT,
                                      note="restart budget spent: 4 worker-failure restarts"))
    lab.peer.leave("peer")
    lab.advance(0.5)
    assert lab.handler.num_nodes_waiting() == 1
    with pytest.raises(RestartBudgetExhaustedError, match="restart budget spent"):
        lab.handler.next_rendezvous()


def test_a_finish_marks_the_run_and_a_node_waking_in_it_exits_at_once(
        make_lab, monkeypatch: pytest.MonkeyPatch) -> None:
    lab = make_lab(nnodes=(1, 2))
    join_with_peer(lab)
    monkeypatch.setattr(handler_module, "workers_succeeded", lambda: True)
    assert lab.handler.shutdown()  # our workers completed: the run is finished
    state = lab.state()  # kept: the peer has not left yet
    assert state.status is Status.FINISHED and "round 1 completed" in state.note
    # the peer's agent, frozen through the end, wakes: told at its next poll, then at once
    peer = make_lab(nnodes=(1, 2))
    peer.put_state(dataclasses.replace(state, status=Status.ACTIVE))
    peer.peer.beat("peer")
    peer.handler.next_rendezvous()
    peer.put_state(dataclasses.replace(peer.state(), status=Status.FINISHED))
    peer.advance(0.5)
    assert peer.handler.num_nodes_waiting() == 1
    with pytest.raises(JobFinishedError, match="finished while this node was away"):
        peer.handler.next_rendezvous()


def test_an_agent_whose_workers_failed_does_not_mark_the_run_finished(make_lab) -> None:
    lab = make_lab(nnodes=(1, 2))
    join_with_peer(lab)
    assert lab.handler.shutdown()  # not under torchrun's launch_agent: no success to see
    assert lab.state().status is Status.ACTIVE


# -- preemption notices (drain.py, notices.py) ---------------------------------------------
def test_a_notice_to_this_node_makes_it_leave_while_the_others_train_on(
        make_lab, monkeypatch: pytest.MonkeyPatch) -> None:
    lab = make_lab(nnodes=(1, 3))
    join_with_peer(lab)
    monkeypatch.setenv(CONTROL_DIR_ENV, str(lab.control.path))
    assert report_notice("SIGUSR2 to a worker")
    lab.advance(0.5, beating=("peer",))
    assert lab.state().notices == {ME: "SIGUSR2 to a worker"}
    assert lab.handler.num_nodes_waiting() == 0  # settled with the others' notices first
    lab.advance(0.5, beating=("peer",))
    assert lab.state().leaving == {ME: "SIGUSR2 to a worker"} and not lab.state().stop
    lab.advance(0.5, beating=("peer",))
    assert lab.handler.num_nodes_waiting() == 1
    assert lab.keeper.pressure.reason is Reason.MEMBERSHIP  # free for everyone
    with pytest.raises(NodeLeftError, match="left the job on a preemption notice"):
        lab.handler.next_rendezvous()
    assert lab.events("notice") and lab.events("left_on_notice")
    assert preemption_requested() is None  # the workers were not told to stop the job


def test_a_notice_that_would_leave_fewer_than_min_stops_the_whole_job_with_a_snapshot(
        make_lab, monkeypatch: pytest.MonkeyPatch) -> None:
    lab = make_lab(nnodes=(2, 3))
    join_with_peer(lab)
    monkeypatch.setenv(CONTROL_DIR_ENV, str(lab.control.path))
    lab.control.catch_preemption()
    try:
        os.kill(os.getpid(), signal.SIGUSR2)  # to the agent's process (this one, here)
    finally:
        signal.signal(signal.SIGUSR2, signal.SIG_DFL)
    lab.advance(1.5, beating=("peer",))
    assert "fewer than --nnodes MIN=2" in lab.state().stop
    assert preemption_requested() == lab.state().stop[:100]  # the workers commit and exit 0
    assert lab.handler.num_nodes_waiting() == 0 and lab.events("job_stopping")


def test_a_new_jobs_agent_ignores_the_stop_of_the_old_job_it_reads(
        make_lab, monkeypatch: pytest.MonkeyPatch) -> None:
    """A requeued job's agents read the state of the job that stopped before they start a
    new generation: that stop is not theirs."""
    lab = make_lab(nnodes=(2, 3))
    monkeypatch.setenv(CONTROL_DIR_ENV, str(lab.control.path))
    lab.put_state(dataclasses.replace(closed_round(("a", "b")), stop="the old job stops"))
    lab.keeper.tick()
    lab.advance(1.0)
    assert preemption_requested() is None
    # Waiting to join the old job when it stops (a node started while it was stopping)
    # does not make its stop this node's.
    lab.put_state(dataclasses.replace(closed_round(("a", "b")), stop="the old job stops",
                                      waiting={ME: NodeInfo("h", 1)}))
    lab.keeper.tick()
    lab.advance(1.0)
    assert preemption_requested() is None


def test_a_notice_the_store_cannot_take_stops_this_nodes_workers_with_a_snapshot(
        make_lab, monkeypatch: pytest.MonkeyPatch) -> None:
    lab = make_lab(nnodes=(1, 3))
    join_with_peer(lab)
    monkeypatch.setenv(CONTROL_DIR_ENV, str(lab.control.path))
    report_notice("SIGUSR2 to a worker")
    lab.store.down = True
    lab.advance(1.5)
    assert preemption_requested() is None  # the store may come back in time
    lab.advance(1.0)
    assert "store unreachable" in str(preemption_requested())


# -- progress and nodes that cannot be reached -----------------------------------------------
def test_the_first_training_step_of_a_round_is_recorded_in_the_run(
        make_lab, monkeypatch: pytest.MonkeyPatch) -> None:
    lab = make_lab(nnodes=(1, 2))
    assert lab.handler.next_rendezvous().rank == 0  # rank 0 records it: one write a round
    assert lab.state().progress_round == 0
    lab.advance(1.0)
    assert lab.state().progress_round == 0 and not lab.keeper.round_progressed()
    monkeypatch.setenv(CONTROL_DIR_ENV, str(lab.control.path))
    report_progress()
    lab.advance(0.5)
    assert lab.state().progress_round == 1 and lab.keeper.round_progressed()
    assert lab.handler.num_nodes_waiting() == 0  # recording it is no reason to restart


def test_only_rank_0_writes_the_rounds_progress(make_lab, monkeypatch: pytest.MonkeyPatch
                                               ) -> None:
    lab = make_lab(nnodes=(1, 2))
    join_with_peer(lab)  # "peer" is rank 0
    monkeypatch.setenv(CONTROL_DIR_ENV, str(lab.control.path))
    report_progress()
    lab.advance(1.0, beating=("peer",))
    assert lab.keeper.round_progressed() and lab.state().progress_round == 0


def test_a_node_left_out_by_the_others_stops_with_the_reason(make_lab) -> None:
    lab = make_lab(nnodes=(1, 3))
    state = dataclasses.replace(closed_round(("a", "b", ME)), phase=Phase.CLOSED,
                                excluded={ME: "not reachable from a, b, though the store was"})
    lab.peer.beat("a")
    lab.peer.beat("b")
    lab.put_state(state)
    with pytest.raises(NodeExcludedError, match="left out of the job: not reachable from a, b"
                                                ".*check the network between the nodes"):
        lab.handler.next_rendezvous()
    assert lab.events("excluded")


@pytest.mark.timeout(30)  # without the fix the handler spins without sleeping
def test_a_node_whose_join_was_dropped_joins_the_round_again(make_lab) -> None:
    # The closer judged us dead (a freeze) and deleted our join key; once it sees the
    # whole round without us, this node must write its key again, not wait for ever.
    lab = make_lab(nnodes=(2, 3))  # our join does not fill the round: the closer decides
    lab.peer.beat("peer")
    opened = dataclasses.replace(closed_round(("peer",)), phase=Phase.OPEN, order=())
    lab.put_state(opened)
    dropped: list[bool] = []

    def play_the_closer() -> None:
        lab.peer.beat("peer")
        joins = [n for n, _ in lab.peer.read_joins("gen0", 1)]
        if ME in joins and not dropped:
            lab.peer.drop_joins("gen0", 1, [ME])  # judged dead: dropped
            dropped.append(True)
        elif ME in joins:
            lab.put_state(closed_round(("peer", ME)))  # back: the closer closes with us
    lab.clock.on_sleep.append(play_the_closer)
    info = lab.handler.next_rendezvous()
    assert dropped and (info.rank, info.world_size) == (1, 2)


def test_rank_0_drops_an_old_rounds_keys_only_a_grace_after_the_round_completed(
        make_lab) -> None:
    """Issue 27: on the embedded store a join key deleted between a lagging reader's
    ``check`` and its ``multi_get`` made that read wait out connect_timeout and fail (1,024
    agents on two cores): a round's keys now outlive its completion by a grace."""
    lab = make_lab()
    for _ in range(3):
        lab.handler.next_rendezvous()
    generation = lab.state().generation

    def rounds_kept() -> list[int]:
        return sorted(int(k.rsplit("/", 1)[1]) for k in lab.store.round_stores
                      if f"/store/{generation}/" in k)
    assert lab.state().round == 3
    assert rounds_kept() == [1, 2, 3]  # round 1 is two rounds old, completed moments ago
    lab.clock.now += OLD_ROUND_GRACE_S
    lab.handler.next_rendezvous()
    assert lab.state().round == 4 and rounds_kept() == [3, 4]


def joins_read_at(lab: Lab, monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """When the round's joins were read (by whoever decides on the round), on the lab's
    clock, from now on."""
    read: list[float] = []
    read_joins = MemoryBackend.read_joins

    def reading(self: MemoryBackend, generation: str, round_: int) -> list[tuple[str, bytes]]:
        read.append(lab.clock.now)
        return read_joins(self, generation, round_)
    monkeypatch.setattr(MemoryBackend, "read_joins", reading)
    return read


@pytest.mark.parametrize("joined_before, turn", [((), 0), (("other",), 1)])
def test_a_dead_closer_is_replaced_by_one_joiner_at_a_time_in_turns_by_join_position(
        make_lab, monkeypatch, joined_before: tuple[str, ...], turn: int) -> None:
    """Issue 43's cascade: when the closer of an open round of 1,024 was judged dead, every
    joiner read every heartbeat, every join and the whole round at once. Now the next
    joiner acts (turn 0) and the others only a heartbeat timeout a turn later
    (``joins.replacement_turn``), judging only the closer meanwhile; here at join position
    2 and 3."""
    lab = make_lab(nnodes=(1, 3))
    alive = {"closer", *joined_before}
    for node in alive:
        lab.peer.beat(node)
    lab.put_state(dataclasses.replace(closed_round(("closer",)), phase=Phase.OPEN, order=()))
    for node in joined_before:
        lab.peer.join("gen0", 1, node, JoinEntry(NodeInfo("127.0.0.1", 31000)).to_bytes())
    dies_at = lab.clock.now + 1.0

    def tick() -> None:
        if lab.clock.now >= dies_at:
            alive.discard("closer")
        for node in alive:
            lab.peer.beat(node)
        lab.keeper.tick()
    lab.clock.on_sleep.append(tick)
    read = joins_read_at(lab, monkeypatch)
    info = lab.handler.next_rendezvous()
    assert "closer" not in lab.state().members and info.world_size == 1 + len(joined_before)
    judged_dead = dies_at + 3.0  # the heartbeat timeout
    acted = judged_dead + turn * 3.0
    assert acted <= read[0] <= acted + 1.0, (read[0] - dies_at, turn)


@pytest.mark.parametrize("read_s", [0.0, 0.6])
def test_a_node_takes_over_a_round_its_live_closer_leaves_idle_reading_the_count_seldom(
        make_lab, monkeypatch, read_s: float) -> None:
    """A closer that beats but never closes (its rendezvous gone): the joiner decides on
    the round itself after the idle limit, and meanwhile reads the join count only every
    half of that limit (every waiting agent reads it: once a second at 1,024 agents was
    1,024 requests a second while a round stayed open). The limit follows the load: with
    each count taking ``read_s`` (a starved store and agent), the closer gets
    ``CLOSER_REQUESTS`` such requests' time more before it is taken over."""
    lab = make_lab(nnodes=(2, 3))  # our join does not fill the round: the closer decides
    lab.peer.beat("peer")
    lab.put_state(dataclasses.replace(closed_round(("peer",)), phase=Phase.OPEN, order=()))
    lab.clock.on_sleep.append(lambda: lab.peer.beat("peer"))  # alive, never closing
    counted: list[float] = []
    count_joins = MemoryBackend.count_joins

    def counting(self: MemoryBackend, generation: str, round_: int) -> int:
        lab.clock.now += read_s  # the fault injected: a slow read
        counted.append(lab.clock.now)
        return count_joins(self, generation, round_)
    monkeypatch.setattr(MemoryBackend, "count_joins", counting)
    read = joins_read_at(lab, monkeypatch)  # only whoever decides on the round reads them
    began = lab.clock.now
    info = lab.handler.next_rendezvous()
    assert (info.rank, info.world_size) == (1, 2)
    assert lab.state().order == ("peer", ME)
    # the idle limit at join position 2 of 3: (last call 1 s + heartbeat 3 s, and the
    # closer's requests as slow as ours) * (1 + 2/3)
    idle_limit = (4.0 + CLOSER_REQUESTS * read_s) * (1 + 2 / 3)
    took_over = read[0]
    assert idle_limit <= took_over - began <= 1.5 * idle_limit + 1.0, (took_over, idle_limit)
    waiting = [at for at in counted if at < took_over]  # then it reads as the closer does
    assert len(waiting) <= 3, waiting  # one a second was 7


def test_a_round_that_moves_while_the_joiner_counts_its_joins_is_not_taken_over(
        make_lab, monkeypatch) -> None:
    """A starved store answers the count in seconds; the closer wrote the round meanwhile
    (it works). The head says so: the joiner waits a whole idle limit again instead of
    reading the whole state and the joins to decide for a live closer."""
    lab = make_lab(nnodes=(2, 3))
    lab.peer.beat("peer")
    opened = dataclasses.replace(closed_round(("peer",)), phase=Phase.OPEN, order=())
    lab.put_state(opened)
    lab.clock.on_sleep.append(lambda: lab.peer.beat("peer"))
    idle_limit = 4.0 * (1 + 2 / 3)  # (last call 1 s + heartbeat 3 s) at position 2 of 3
    began = lab.clock.now
    moved: list[float] = []
    count_joins = MemoryBackend.count_joins

    def counting(self: MemoryBackend, generation: str, round_: int) -> int:
        if not moved and lab.clock.now - began >= idle_limit:  # the count that would decide
            lab.put_state(dataclasses.replace(opened, note="the closer merged a join"))
            moved.append(lab.clock.now)
        return count_joins(self, generation, round_)
    monkeypatch.setattr(MemoryBackend, "count_joins", counting)
    read = joins_read_at(lab, monkeypatch)
    info = lab.handler.next_rendezvous()  # taken over in the end: the closer never closes
    assert (info.rank, info.world_size) == (1, 2) and moved
    assert read[0] - moved[0] >= idle_limit, (read[0] - moved[0], idle_limit)
