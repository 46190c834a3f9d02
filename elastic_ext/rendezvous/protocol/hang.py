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
is held or deadlocked), or, on gloo, is not inside a collective while another worker of
its node waits in one (gloo's collectives block the calling thread, so every healthy rank
of a hung round is in one). A gloo node whose workers all run outside collectives gets
``busy`` (60 s): from there one rank's endless loop and the whole round's evaluation look
the same, and the nodes whose workers wait judge first. On NCCL a healthy rank waits in a
CUDA synchronisation called from anywhere, so the last rules do not apply there (the
flight recorder names the rank: docs/failure-model.md).
A node with no culprit waits ``NO_CULPRIT_WAIT_S`` longer before it judges, so that the
culprit's node, which leaves for free, opens the next round. Time the agent itself did
not run (``LATE_OBSERVATION_S``: a starved machine) does not count.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

NO_CULPRIT_WAIT_S = 1.0
"""How much longer a node that finds no culprit among its workers waits before it judges
the round hung (the culprit's node judges first and its round is free)."""

SILENT_BEACON_S = 3.0
"""A worker whose beacon thread (a beat every 0.25 s) wrote nothing for this long runs no
Python: its GIL is held or deadlocked. Long enough that a busy machine's scheduler does
not make a culprit of a thread that only waited for a core (a node with no culprit waits
``peers_judged``, 4.5 s on etcd, so a deadlock is still blamed before that)."""

LATE_OBSERVATION_S = 0.5
"""The agent observes every 0.1 s (torch's monitor interval); a gap longer than this means
the agent itself was starved (an overloaded machine), and the gap's time is not counted
against the workers: a judge that may be the slow one does not judge on it."""

BLAMES_TO_LEAVE = 2
"""Hangs in a row blamed on this node's workers after which the node leaves the job."""


@dataclass(frozen=True)
class HangRules:
    """When a round is hung (``--rdzv-conf hang_floor, hang_factor, hang_startup``)."""

    floor: float = 2.0
    factor: float = 10.0
    startup: float = 300.0
    busy: float = 60.0  # a gloo node whose workers all run outside collectives
    enabled: bool = True
    peers_judged: float = 0.0
    """When a dead or frozen peer node is judged from its heartbeat (``heartbeat_timeout``
    + one interval): a hang nobody here is to blame for waits at least this long, so that
    a peer's death, which is free, is found first instead of charged as a hang."""

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
    own_s: float | None = None  # the median of its recent own compute times (``pace.py``)


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
    workers: tuple[int, ...] = ()  # every local worker's pid: those still there after the
    # stop grace are killed too (a deadlock the rules could not name)

    @property
    def unkillable(self) -> tuple[Culprit, ...]:
        return tuple(c for c in self.culprits if not c.killable)


def culprit_of(beacon: Beacon, *, peers_wait: bool = True) -> Culprit | None:
    """Why ``beacon``'s worker is to blame for a hang, if it is; ``peers_wait``: another
    worker of its node waits in a collective (the evidence that running outside one is a
    hang, not the whole round's evaluation)."""
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
    if beacon.backend == "gloo" and peers_wait and not beacon.waiting and not beacon.paused:
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
    _observed_at: float = 0.0  # when ``observe`` last ran
    _blamed_in_a_row: int = 0
    seen_beacons: bool = field(default=False)  # this round's workers beat at all

    def watch(self, round_: int | None, now: float) -> None:
        """A new round: nothing finished in it yet, its clock starts now."""
        self.round, self._progress_at, self._last_step = round_, now, None
        self._judged, self.seen_beacons, self._limit = False, False, None
        self._observed_at = 0.0

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
        late = now - self._observed_at - LATE_OBSERVATION_S if self._observed_at else 0.0
        self._observed_at = now
        if late > 0:  # this agent itself did not run on time: that time proves nothing
            self._progress_at += late
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
        waiting = [b for b in mine if b.waiting]
        culprits = tuple(c for b in mine if (c := culprit_of(
            b, peers_wait=any(w is not b for w in waiting))) is not None)
        if not culprits and not waiting and all(b.backend == "gloo" for b in mine):
            # Every worker runs outside a collective: the whole round's evaluation (without
            # ``no_hang_check``) looks the same from here as one rank's endless loop; the
            # nodes whose workers wait for it judge the hang, this one only much later.
            limit = max(limit, self.rules.busy)
        stalled = now - self._progress_at
        if stalled < (limit if culprits else
                      max(limit + NO_CULPRIT_WAIT_S, self.rules.peers_judged)):
            return None
        self._judged = True
        self._blamed_in_a_row = self._blamed_in_a_row + 1 if culprits else 0
        why = f"no training step for {stalled:.1f}s (limit {limit:.1f}s) after step {step}"
        if culprits:
            why += ": " + "; ".join(c.how for c in culprits)
        else:
            why += (" and no worker of this node is to blame (if it was a known long pause, "
                    "such as an evaluation, wrap it in ElasticLoop.no_hang_check() or raise "
                    "--rdzv-conf hang_floor)")
        return Hung(why, culprits, tuple(b.pid for b in mine))

    @property
    def leave_the_job(self) -> bool:
        """This node's workers were to blame for the last ``BLAMES_TO_LEAVE`` hangs."""
        return self._blamed_in_a_row >= BLAMES_TO_LEAVE
