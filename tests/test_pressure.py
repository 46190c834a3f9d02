"""The keeper's pressure decider (``protocol/pressure.py``): when this agent's workers leave
their round and why, what they are told, and whether the round trained. Pure: a fake
clock and fake worker reports, no store, no thread."""

from __future__ import annotations

from dataclasses import replace

from elastic_ext.rendezvous.protocol.hang import Beacon
from elastic_ext.rendezvous.protocol.head import Head
from elastic_ext.rendezvous.protocol.policy import Limits
from elastic_ext.rendezvous.protocol.pressure import (
    PROGRESS_WITHOUT_REPORTS_S,
    Leave,
    Pressure,
    RoundPressure,
    TellLost,
)
from elastic_ext.rendezvous.protocol.state import NodeInfo, Phase, Reason, RunState
from tests.support.handler_lab import FakeClock

ROUND = ("g", 1)


class Reports:
    """What the workers reported, and every read of it (reads are file reads)."""

    def __init__(self, fault: str | None = None, setup: str | None = None,
                 progress: bool = False) -> None:
        self.fault, self.setup, self.progress = fault, setup, progress
        self.reads: list[str] = []
        self.beacon_list: list[Beacon] = []  # the workers' beats (``hang.py``)

    def progress_reported(self, round_: int) -> bool:
        self.reads.append("progress")
        return self.progress

    def fault_reported(self, round_: int) -> str | None:
        self.reads.append("fault")
        return self.fault

    def setup_fault_reported(self, round_: int) -> str | None:
        self.reads.append("setup")
        return self.setup

    def beacons(self) -> list[Beacon]:
        return self.beacon_list


def head(closer: str = "me", **changes: object) -> Head:
    state = RunState(generation="g", round=1, phase=Phase.CLOSED,
                     members={closer: NodeInfo("127.0.0.1", 1000),
                              "other": NodeInfo("127.0.0.1", 1001)},
                     order=(closer, "other"))
    return replace(Head.of(state), **changes)  # type: ignore[arg-type]


def watching(clock: FakeClock | None = None) -> RoundPressure:
    rounds = RoundPressure("me", Limits(2, 4, 1.0, None), clock or FakeClock())
    rounds.watch(ROUND)
    return rounds


def test_the_dead_of_the_round_make_it_leave_and_the_workers_are_told_once() -> None:
    rounds = watching()
    actions = rounds.weigh(head(), frozenset({"other"}), frozenset({"other"}), Reports())
    assert actions == [TellLost(1, "dead or hung: other"),
                       Leave(1, Pressure(1, "dead or hung: other", Reason.MEMBERSHIP))]
    assert rounds.pressure.count == 1
    assert rounds.weigh(head(), frozenset({"other"}), frozenset({"other"}), Reports()) == []


def test_workers_that_could_not_be_told_of_the_lost_are_told_at_the_next_tick() -> None:
    rounds = watching()
    told = TellLost(1, "dead or hung: other")
    assert rounds.weigh(head(), frozenset({"other"}), frozenset({"other"}), Reports())[0] == told
    rounds.lost_not_told()  # the keeper's write of the control file failed
    assert rounds.weigh(head(), frozenset({"other"}), frozenset({"other"}), Reports()) == [told]


def test_the_workers_hear_of_the_lost_even_when_another_reason_came_first() -> None:
    rounds = watching()
    first = rounds.worker_report(Reports(fault="nccl timeout"))
    assert first == [Leave(1, Pressure(1, "a worker reported a peer fault", Reason.FAILURE))]
    actions = rounds.weigh(head(), frozenset({"other"}), frozenset({"other"}), Reports())
    assert actions == [TellLost(1, "dead or hung: other")]
    assert rounds.pressure.why == "a worker reported a peer fault"  # the first one sticks


def test_a_newer_round_makes_it_leave_with_the_rounds_reason() -> None:
    rounds = watching()
    newer = head(round=2, phase=Phase.OPEN, opened_because=Reason.MEMBERSHIP)
    assert rounds.weigh(newer, frozenset(), frozenset(), Reports()) == [
        Leave(1, Pressure(1, "round 2 (open) replaced round 1", Reason.MEMBERSHIP))]


def test_a_quiet_round_stays_and_reads_the_fault_report_only_while_it_has_no_reason() -> None:
    rounds = watching()
    reports = Reports()
    assert rounds.weigh(head(), frozenset(), frozenset(), reports) == []
    assert reports.reads == ["fault"]
    rounds.worker_report(Reports(setup="warm server died"))
    reports.reads.clear()
    rounds.weigh(head(), frozenset(), frozenset(), reports)
    assert reports.reads == []


def test_a_setup_fault_leaves_for_free_and_a_peer_fault_as_a_failure() -> None:
    setup = watching().worker_report(Reports(setup="warm server died", fault="x"))
    assert setup == [Leave(1, Pressure(1, "a worker's launcher reported: warm server died",
                                       Reason.MEMBERSHIP))]
    fault = watching().worker_report(Reports(fault="x"))
    assert fault == [Leave(1, Pressure(1, "a worker reported a peer fault", Reason.FAILURE))]
    assert watching().worker_report(Reports()) == []
    idle = RoundPressure("me", Limits(2, 4, 1.0, None), FakeClock())
    assert idle.worker_report(Reports(fault="x")) == []  # no round: nothing to leave


def test_a_gone_state_leaves_once_as_the_job_finished() -> None:
    rounds = watching()
    assert rounds.state_gone() == [
        Leave(1, Pressure(1, "the run's state is gone: the job finished", Reason.MEMBERSHIP))]
    assert rounds.state_gone() == []


def test_without_the_store_a_fault_report_raises_the_pressure_silently() -> None:
    rounds = watching()
    rounds.blind(Reports())
    assert rounds.pressure == Pressure()
    rounds.blind(Reports(fault="x"))
    assert rounds.pressure == Pressure(
        1, "a worker reported a peer fault while the store is unreachable", Reason.FAILURE)


def test_a_new_round_clears_the_pressure_and_the_progress() -> None:
    rounds = watching()
    rounds.worker_report(Reports(fault="x"))
    rounds.progress(head(), Reports(progress=True))
    rounds.watch(("g", 2))
    assert rounds.pressure == Pressure() and not rounds.progressed
    assert rounds.steps_reported  # the workers speak the protocol, whatever the round


def test_only_rank_0_of_the_closed_round_records_its_progress_once() -> None:
    rounds = watching()
    assert not rounds.progress(head(), Reports())
    assert rounds.progress(head(), Reports(progress=True))
    assert rounds.progressed and rounds.steps_reported
    assert not rounds.progress(head(progress_round=1), Reports())  # recorded already
    other = watching()
    assert not other.progress(head(closer="other"), Reports(progress=True))
    assert other.progressed


def test_workers_that_never_report_count_as_progressing_after_a_while() -> None:
    clock = FakeClock()
    rounds = watching(clock)
    clock.now += PROGRESS_WITHOUT_REPORTS_S - 1
    assert not rounds.progress(head(), Reports())
    clock.now += 1
    assert rounds.progress(head(), Reports()) and not rounds.steps_reported
    reporting = watching(clock)
    reporting.progress(head(), Reports(progress=True))
    reporting.watch(("g", 2))
    clock.now += PROGRESS_WITHOUT_REPORTS_S
    assert not reporting.progress(head(round=2), Reports())  # they report: wait for it


def test_a_tick_weighs_only_the_round_it_began_with() -> None:
    rounds = watching()
    asked: list[tuple[str, int]] = []

    def lost_of(round_: tuple[str, int]) -> frozenset[str]:
        asked.append(round_)
        return frozenset({"other"})

    dead = frozenset({"other"})
    assert rounds.after_read(None, head(), dead, lost_of, Reports()) == ([], False)
    assert rounds.after_read(("g", 0), head(), dead, lost_of, Reports()) == ([], False)
    assert asked == []
    actions, record = rounds.after_read(ROUND, head(), dead, lost_of, Reports(progress=True))
    assert asked == [ROUND] and record
    assert actions == [TellLost(1, "dead or hung: other"),
                       Leave(1, Pressure(1, "dead or hung: other", Reason.MEMBERSHIP))]
    gone = watching()
    assert gone.after_read(ROUND, None, dead, lost_of, Reports(progress=True)) == (
        [Leave(1, Pressure(1, "the run's state is gone: the job finished", Reason.MEMBERSHIP))],
        False)
    assert not gone.progressed  # no head: nothing to record against
