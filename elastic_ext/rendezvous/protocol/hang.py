"""Whether this node's round is hung, judged from its workers' step progress, and whom to
blame: pure, over the workers' beacons (``worker/progress.py`` writes them, the agent's
``control.py`` reads them) and an injected clock.

A collective that waits for a stuck peer waits for its timeout (60 s in the bundled
trainer, 10 minutes on NCCL by default). Every rank of a data-parallel round finishes each
step, so a round where no local worker finished a step for far longer than its steps take
is hung, whoever is stuck: ``max(floor, factor x recent step time)``. The first steps of a
round get ``startup`` instead (restore, compilation, the first batches), and a worker
inside ``ElasticLoop.no_hang_check()`` stops the clock.

Blame is local: a worker is the culprit when it is stopped (``T``), in uninterruptible
sleep (``D``: it cannot be killed), runs no Python (its beacon thread is silent: the GIL
is held or deadlocked), or, on gloo, is not inside a collective while the round waits
(gloo's collectives block the calling thread, so every healthy rank of a hung round is in
one). On NCCL a healthy rank waits in a CUDA synchronisation called from anywhere, so the
last rule does not apply there (the flight recorder names the rank: docs/failure-model.md).
A node with no culprit waits ``NO_CULPRIT_WAIT_S`` longer before it judges, so that the
culprit's node, which leaves for free, opens the next round.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

NO_CULPRIT_WAIT_S = 1.0
"""How much longer a node that finds no culprit among its workers waits before it judges
the round hung (the culprit's node judges first and its round is free)."""

SILENT_BEACON_S = 1.5
"""A worker whose beacon thread wrote nothing for this long runs no Python."""

BLAMES_TO_LEAVE = 2
"""Hangs in a row blamed on this node's workers after which the node leaves the job."""


@dataclass(frozen=True)
class HangRules:
    """When a round is hung (``--rdzv-conf hang_floor, hang_factor, hang_startup``)."""

    floor: float = 2.0
    factor: float = 10.0
    startup: float = 300.0
    enabled: bool = True

    def limit(self, step_s: float | None, steps_in_round: int) -> float:
        """Seconds without a finished step that make the round hung."""
        if steps_in_round < 2 or step_s is None:
            return self.startup
        return max(self.floor, self.factor * step_s)


@dataclass(frozen=True)
class Beacon:
    """One worker's last beat, with what the agent read of its process."""

    local_rank: int
    pid: int
    round: int
    step: int  # the loop's steps completed
    steps_in_round: int  # of them, completed in this round
    step_s: float | None  # the median of its recent step times
    paused: bool  # inside ``no_hang_check()``
    waiting: bool  # its main thread is inside a collective (or the backward's wait)
    where: str  # its main thread's innermost Python frame, ``file:line function``
    backend: str  # the default group's backend ("gloo", "nccl", "" before there is one)
    silent_s: float  # seconds since its beacon thread last wrote
    process: str  # /proc state letter: R, S, D, T, t, Z; "" when the process is gone


@dataclass(frozen=True)
class Culprit:
    local_rank: int
    pid: int
    how: str
    killable: bool = True


@dataclass(frozen=True)
class Hung:
    """The round is hung: why, and this node's culprits (none: the hang is elsewhere, or
    cannot be told)."""

    why: str
    culprits: tuple[Culprit, ...] = ()

    @property
    def unkillable(self) -> tuple[Culprit, ...]:
        return tuple(c for c in self.culprits if not c.killable)


def culprit_of(beacon: Beacon) -> Culprit | None:
    """Why ``beacon``'s worker is to blame for a hang, if it is."""
    rank = f"local rank {beacon.local_rank} (pid {beacon.pid})"
    if beacon.process in ("T", "t"):
        return Culprit(beacon.local_rank, beacon.pid, f"{rank} is stopped (SIGSTOP or a "
                                                      "debugger)")
    if beacon.process == "D":
        return Culprit(beacon.local_rank, beacon.pid,
                       f"{rank} is in uninterruptible sleep (a driver or file-system hang) "
                       "and cannot be killed", killable=False)
    if beacon.process in ("", "Z"):
        return None  # gone: torch's agent sees its exit
    if beacon.silent_s > SILENT_BEACON_S:
        return Culprit(beacon.local_rank, beacon.pid,
                       f"{rank} runs no Python for {beacon.silent_s:.1f}s (the GIL is held "
                       f"or deadlocked; last seen at {beacon.where or 'an unknown place'})")
    if beacon.backend == "gloo" and not beacon.waiting and not beacon.paused:
        return Culprit(beacon.local_rank, beacon.pid,
                       f"{rank} is not in a collective while its round waits: at "
                       f"{beacon.where or 'an unknown place'}")
    return None


@dataclass
class HangJudge:
    """Watches one round's progress from its workers' beacons (one judge per agent, used
    under the keeper's lock)."""

    rules: HangRules
    round: int | None = None
    _progress_at: float = 0.0  # when the round last made progress (or started, or paused)
    _last_step: int | None = None
    _judged: bool = False
    _limit: float | None = None  # the limit the last observation applied
    _blamed_in_a_row: int = 0
    seen_beacons: bool = field(default=False)  # this round's workers beat at all

    def watch(self, round_: int | None, now: float) -> None:
        """A new round: nothing finished in it yet, its clock starts now."""
        self.round, self._progress_at, self._last_step = round_, now, None
        self._judged, self.seen_beacons, self._limit = False, False, None

    def stalled_for(self, now: float) -> float:
        """Seconds since the watched round last made progress (0 without beacons)."""
        return now - self._progress_at if self.seen_beacons else 0.0

    def stalled(self, now: float) -> bool:
        """Whether the round made no progress for half its hang limit: its workers wait on
        something (a reason to leave that comes now will not find them at a boundary)."""
        return self._limit is not None and self.stalled_for(now) >= self._limit / 2

    def observe(self, beacons: list[Beacon], now: float) -> Hung | None:
        """This round's verdict after reading ``beacons`` at ``now``: once per round."""
        if self.round is None or self._judged or not self.rules.enabled:
            return None
        mine = [b for b in beacons if b.round == self.round]
        if not mine:
            return None
        self.seen_beacons = True
        step = min(b.step for b in mine)
        times = [b.step_s for b in mine if b.step_s is not None]
        limit = self._limit = self.rules.limit(statistics.median(times) if times else None,
                                               min(b.steps_in_round for b in mine))
        if any(b.paused for b in mine) or step != self._last_step:
            self._last_step, self._progress_at = step, now
            return None
        culprits = tuple(c for c in map(culprit_of, mine) if c is not None)
        stalled = now - self._progress_at
        if stalled < limit + (0.0 if culprits else NO_CULPRIT_WAIT_S):
            return None
        self._judged = True
        self._blamed_in_a_row = self._blamed_in_a_row + 1 if culprits else 0
        why = f"no training step for {stalled:.1f}s (limit {limit:.1f}s) after step {step}"
        if culprits:
            why += ": " + "; ".join(c.how for c in culprits)
        return Hung(why, culprits)

    @property
    def leave_the_job(self) -> bool:
        """This node's workers were to blame for the last ``BLAMES_TO_LEAVE`` hangs."""
        return self._blamed_in_a_row >= BLAMES_TO_LEAVE
