"""Whether this agent's workers should leave their round, and whether the round trained:
the keeper's restart pressure and worker progress, apart from its I/O.

torch's agent polls ``num_nodes_waiting()`` and restarts its workers, without spending a
local restart, when it is positive: the ``Pressure`` here. The first reason sticks until
the next round (the agent acts on the first). The decider reads the workers' reports
through ``WorkerReports`` (the control directory, injected) only when it needs them, and
returns what the keeper is to do: ``Leave`` the round, ``TellLost`` to the workers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from elastic_ext.rendezvous.protocol.clock import Clock
from elastic_ext.rendezvous.protocol.hang import Beacon, HangJudge, HangRules, Hung
from elastic_ext.rendezvous.protocol.head import Head
from elastic_ext.rendezvous.protocol.policy import Limits, head_pressure
from elastic_ext.rendezvous.protocol.state import Phase, Reason, Status

PROGRESS_WITHOUT_REPORTS_S = 120.0
"""Workers that never report steps (``control.report_progress``; the bundled trainer and
``PreemptionGuard`` do) count as progressing once their round has run this long."""


class WorkerReports(Protocol):
    """What this agent's workers reported (``AgentControl``)."""

    def progress_reported(self, round_: int) -> bool: ...

    def fault_reported(self, round_: int) -> str | None: ...

    def setup_fault_reported(self, round_: int) -> str | None: ...

    def beacons(self) -> list[Beacon]: ...


@dataclass(frozen=True)
class Pressure:
    """The keeper's verdict: how many reasons to leave the round, the first, and its kind."""

    count: int = 0
    why: str = ""
    reason: Reason = Reason.FAILURE


@dataclass(frozen=True)
class Leave:
    """Leave round ``round`` for ``pressure``: tell the workers and the events."""

    round: int
    pressure: Pressure


@dataclass(frozen=True)
class TellLost:
    """Tell the workers of ``round`` that peers are dead or hung (``why``): their stop
    cannot wait for a step boundary."""

    round: int
    why: str


Action = Leave | TellLost


class RoundPressure:
    """The watched round, its reasons to leave and its progress; the keeper's lock guards
    it."""

    def __init__(self, me: str, limits: Limits, clock: Clock,
                 hang_rules: HangRules | None = None) -> None:
        self._me = me
        self._limits = limits
        self._clock = clock
        self.round: tuple[str, int] | None = None
        self.pressure = Pressure()
        self._lost_told: tuple[str, int] | None = None  # the round whose workers know
        self._round_since = clock.monotonic()  # when the watched round was handed over
        self.progressed = False  # the watched round's workers completed a step
        self.steps_reported = False  # this agent's workers ever reported one
        self.hang = HangJudge(hang_rules or HangRules())
        self.hung: Hung | None = None  # the watched round's hang, until its culprits are stopped

    def watch(self, round_: tuple[str, int] | None) -> None:
        """A new round to watch (None: none): no reason to leave it yet, no progress."""
        self.round = round_
        self.pressure = Pressure()
        self._round_since = self._clock.monotonic()
        self.progressed = False
        self.hang.watch(round_[1] if round_ else None, self._round_since)
        self.hung = None

    def blind(self, reports: WorkerReports) -> None:
        """The store is unreachable. Workers stuck on a dead peer cannot wait for it to
        come back: the agent takes them into the rendezvous, which waits or fails clearly.
        (No ``Leave``: the workers are told nothing.)"""
        if self.round is not None and not self.pressure.count \
                and reports.fault_reported(self.round[1]) is not None:
            self.pressure = Pressure(1, "a worker reported a peer fault while the store is "
                                        "unreachable", Reason.FAILURE)

    def after_read(self, watched: tuple[str, int] | None, head: Head | None,
                   dead: frozenset[str], lost_of: Callable[[tuple[str, int]], frozenset[str]],
                   reports: WorkerReports) -> tuple[list[Action], bool]:
        """What one tick's read calls for (the tick began watching ``watched``; ``lost_of``
        gives the dead of our round), and whether the run's state should learn from us
        that the round trained (``progress``)."""
        if self.round is None or self.round != watched:
            return [], False  # not in a round, or it changed while the tick read
        if head is None:
            return self.state_gone(), False
        record_progress = self.progress(head, reports)
        return self.weigh(head, dead, lost_of(self.round), reports), record_progress

    def state_gone(self) -> list[Action]:
        """The last agent of a finished job removed the run's keys while this one was away
        (frozen): nothing to train with any more."""
        if self.pressure.count:
            return []
        return self._leave(Pressure(1, "the run's state is gone: the job finished",
                                    Reason.MEMBERSHIP))

    def progress(self, head: Head, reports: WorkerReports) -> bool:
        """Note the watched round's progress; True when the run's state should learn it from
        us: rank 0 writes it, as its workers take part in every step, and one writer is one
        write, where every agent trying would be N compare-and-swaps of the whole state."""
        assert self.round is not None
        if not self.progressed:
            if reports.progress_reported(self.round[1]):
                self.progressed = self.steps_reported = True
            elif not self.steps_reported and \
                    self._clock.monotonic() - self._round_since >= PROGRESS_WITHOUT_REPORTS_S:
                self.progressed = True
        return (self.progressed and (head.generation, head.round) == self.round
                and head.phase is Phase.CLOSED and head.status is Status.ACTIVE
                and head.progress_round < head.round and head.closer == self._me)

    def weigh(self, head: Head, dead: frozenset[str], lost: frozenset[str],
              reports: WorkerReports) -> list[Action]:
        """What the head and ``lost`` (the dead of our round) call for: the workers told of
        ``lost`` once per round, also after another reason came first (the stop must not
        wait on them), and the first reason to leave."""
        assert self.round is not None
        actions: list[Action] = []
        if lost and self._lost_told != self.round:
            actions.append(TellLost(self.round[1], f"dead or hung: {', '.join(sorted(lost))}"))
            self._lost_told = self.round
        if self.pressure.count:
            return actions  # sticky until the next round: the agent acts on the first reason
        count, why, reason = head_pressure(
            head, self._me, dead, lost, self._limits, self.round,
            reports.fault_reported(self.round[1]) is not None)
        return actions + (self._leave(Pressure(count, why, reason)) if count else [])

    def lost_not_told(self) -> None:
        """The workers could not be told of the lost (the control file's write failed):
        ``weigh`` tells them again at the next tick."""
        self._lost_told = None

    def worker_report(self, reports: WorkerReports) -> list[Action]:
        """A worker's fault report, acted on at once: the agent polls ``num_nodes_waiting``
        every tenth of a second, the keeper ticks every second. A fault of the node's own
        machinery (not of the training) leaves the round for free."""
        if self.round is None or self.pressure.count:
            return []
        setup = reports.setup_fault_reported(self.round[1])
        if setup is not None:
            return self._leave(Pressure(1, f"a worker's launcher reported: {setup}",
                                        Reason.MEMBERSHIP))
        if reports.fault_reported(self.round[1]) is not None:
            return self._leave(Pressure(1, "a worker reported a peer fault", Reason.FAILURE))
        return self.hang_check(reports)

    def hang_check(self, reports: WorkerReports) -> list[Action]:
        """Leave a round whose workers stopped finishing steps (``hang.py``): free when
        this node's workers are to blame (its culprits are stopped, and it leaves the job
        after ``BLAMES_TO_LEAVE`` in a row), charged once when no node could tell."""
        assert self.round is not None
        hung = self.hang.observe(reports.beacons(), self._clock.monotonic())
        if hung is None:
            return []
        self.hung = hung
        reason = Reason.MEMBERSHIP if hung.culprits else Reason.FAILURE
        return self._leave(Pressure(1, f"the round is hung: {hung.why}", reason))

    def _leave(self, pressure: Pressure) -> list[Action]:
        """Record the first reason to leave the round, and say so; when its workers made no
        progress for half the hang limit, they are told the peers are lost, so that their
        stop keeps the last finished step at once instead of waiting for a boundary."""
        assert self.round is not None
        self.pressure = pressure
        actions: list[Action] = []
        if self.hang.stalled(self._clock.monotonic()) and self._lost_told != self.round:
            actions.append(TellLost(self.round[1], f"no step for "
                                    f"{self.hang.stalled_for(self._clock.monotonic()):.1f}s"))
            self._lost_told = self.round
        return [*actions, Leave(self.round[1], pressure)]
