"""What must hold after a chaos run, judged from what was observed; no side effects.

The runner collects an :class:`Observation` (the trainer's metrics events, the faults
it injected with their times, the snapshots it saw become durable, how each node
ended, what was left running or bound) and :func:`check` turns it into a
:class:`Verdict`: the violations, readable on their own, plus the segments and
restarts the report draws. Keeping this pure lets every rule be tested on made-up
event lists in milliseconds.

The metrics file is split into *segments*, one per ``start`` event (one round of
training), by :mod:`elastic_ext.ops.runlog`, the reading ``elastic-ext report`` shares.
Between two segments is a *restart*: the new round resumes from a snapshot, or from
the state its nodes kept in memory, so the steps of the old round after that are
lost. That is allowed only when a crash-type fault (a killed worker or node, a frozen
or partitioned node) was injected since the old round started; a preemption, a join
or an etcd fault must lose nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

from elastic_ext.ops.runlog import (
    MEMORY_SOURCES,
    Boundary,
    Event,
    Segment,
    durable_snapshots,
    restore_of,
    split_segments,
    steps_text,
)

LAST_STEP = "job reaches its last step"
LOST_STEPS = "no committed step lost beyond the last snapshot"
SAME_PARAMS = "same parameters as an uninterrupted run"
LEFTOVERS = "nothing left running or bound"
CONSISTENT = "consistent step sequence"
HARNESS = "scenario ran as written"


@dataclass(frozen=True)
class FaultRecord:
    """One thing the harness did to the job, when, and to what."""

    time: float
    description: str
    verb: str
    crash: bool = False    # may cost the steps since the last snapshot
    restore: bool = False  # undoes an earlier fault (thaw, heal, etcd back, disk freed)
    detail: str = ""


@dataclass(frozen=True)
class NodeOutcome:
    name: str
    exit_code: int | None  # None: still running when the scenario ended
    killed: bool           # the scenario SIGKILLed it, so its exit code says nothing
    left_out: bool = False  # cut off its peers: the job may leave it out (it exits 1 then)


@dataclass(frozen=True)
class Observation:
    """Everything the runner saw; the only input of :func:`check`."""

    events: tuple[Event, ...]
    steps: int
    faults: tuple[FaultRecord, ...] = ()
    # (step, unix time its manifest was first seen)
    snapshots_seen: tuple[tuple[int, float], ...] = ()
    nodes: tuple[NodeOutcome, ...] = ()
    leftovers: tuple[str, ...] = ()      # processes still alive after the job, described
    bound_ports: tuple[int, ...] = ()    # the job's ports still listening after it ended
    reference_sha: str | None = None
    reference_note: str = "no reference run"
    errors: tuple[str, ...] = ()         # the harness could not play the scenario as written


@dataclass(frozen=True)
class Violation:
    invariant: str
    message: str

    def __str__(self) -> str:
        return f"{self.invariant}: {self.message}"


@dataclass(frozen=True)
class Restart(Boundary):
    """A boundary between two rounds, judged: was a crash-type fault injected in the old one?"""

    crash_allowed: bool = False


@dataclass(frozen=True)
class Verdict:
    violations: tuple[Violation, ...]
    segments: tuple[Segment, ...]
    restarts: tuple[Restart, ...]
    params_check: str
    final_step: int | None
    final_sha: str | None

    @property
    def ok(self) -> bool:
        return not self.violations

    @property
    def lost_steps(self) -> int:
        return sum(r.lost for r in self.restarts)


# ------------------------------------------------------------------------------ helpers
def _newest_before(snapshots: Sequence[tuple[int, float]], when: float, at_most: int) -> int | None:
    steps = [step for step, t in snapshots if t <= when and step <= at_most]
    return max(steps) if steps else None


# -------------------------------------------------------------------------------- check
def check(obs: Observation) -> Verdict:
    """Judge a run: every broken invariant becomes one readable :class:`Violation`."""
    violations: list[Violation] = [Violation(HARNESS, e) for e in obs.errors]
    segments, stray = split_segments(obs.events)
    snapshots = durable_snapshots(obs.events, obs.snapshots_seen)
    t0 = segments[0].start_time if segments else 0.0

    def at(when: float) -> str:
        return f"t={when - t0:.1f}s"

    # 5. the step sequence is consistent
    if stray:
        violations.append(Violation(CONSISTENT,
                                    f"{len(stray)} event(s) logged before the first start, "
                                    f"the first: {dict(stray[0])}"))
    for index, seg in enumerate(segments):
        expected = list(range(seg.base + 1, seg.base + 1 + len(seg.steps)))
        if list(seg.steps) != expected:
            bad = next(i for i, (got, want) in enumerate(zip(seg.steps, expected, strict=True))
                       if got != want)
            before = seg.steps[bad - 1] if bad else seg.base
            violations.append(Violation(CONSISTENT,
                                        f"round started at {at(seg.start_time)} (resumed from "
                                        f"{seg.base}) logged step {seg.steps[bad]} after "
                                        f"{before}, expected {expected[bad]}"))
        worlds = ({int(e["world_size"]) for e in seg.events if e.get("event") == "step"}
                  - {seg.world_size})
        if worlds:
            violations.append(Violation(CONSISTENT,
                                        f"round started at {at(seg.start_time)} at world size "
                                        f"{seg.world_size} logged steps at {sorted(worlds)}"))
        for event in seg.events:
            kind = event.get("event")
            if kind in ("done", "preempted") and int(event["step"]) != seg.last_step:
                violations.append(Violation(CONSISTENT,
                                            f"'{kind}' at step {event['step']} but the round's "
                                            f"last step was {seg.last_step}"))
        if seg.end == "done" and index != len(segments) - 1:
            violations.append(Violation(CONSISTENT,
                                        "training started again at "
                                        f"{at(segments[index + 1].start_time)}"
                                        f" after 'done' at step {seg.last_step}"))
        from_memory = restore_of(index + 1, seg).source in MEMORY_SOURCES
        if seg.resumed_from is not None and index > 0 and not from_memory:
            known = {step for step, t in snapshots if t <= seg.start_time}
            if seg.resumed_from not in known:
                violations.append(Violation(CONSISTENT,
                                            f"round started at {at(seg.start_time)} resumed from "
                                            f"step {seg.resumed_from}, but no snapshot of that "
                                            "step was seen"))
    if segments and segments[0].resumed_from is not None:
        violations.append(Violation(CONSISTENT,
                                    f"the first round resumed from step {segments[0].resumed_from}"
                                    " of an older run (the snapshot directory was not empty)"))

    # 2. nothing lost beyond what a crash allows
    restarts: list[Restart] = []
    for old, new in pairwise(segments):
        crash = [f for f in obs.faults if f.crash and old.start_time < f.time <= new.start_time]
        restart = Restart.between(old, new, crash_allowed=bool(crash))
        last, resumed = restart.last_step, restart.resumed_from
        newest = _newest_before(snapshots, new.start_time, last)
        restarts.append(restart)
        # State kept in memory may hold one step more than the old round logged: a peer
        # failed in the step-boundary collective, after the update was applied everywhere.
        if resumed > last + (restore_of(len(restarts), new).source in MEMORY_SOURCES):
            violations.append(Violation(CONSISTENT,
                                        f"round started at {at(new.start_time)} resumed from step "
                                        f"{resumed}, past the last logged step {last}"))
            continue
        if newest is not None and resumed < newest:
            violations.append(Violation(LOST_STEPS,
                                        f"round started at {at(new.start_time)} resumed from step "
                                        f"{resumed} although the snapshot of step {newest} was "
                                        f"durable: {steps_text(resumed + 1, newest)} lost"))
        elif last > resumed and not crash:
            causes = [f.description for f in obs.faults
                      if old.start_time < f.time <= new.start_time]
            why = f"after {', '.join(causes)}" if causes else "with no fault injected"
            violations.append(Violation(LOST_STEPS,
                                        f"round started at {at(new.start_time)} {why} resumed "
                                        f"from step {resumed}: {steps_text(resumed + 1, last)} "
                                        "lost though no node crashed"))

    # 1. the job reaches its last step, and every node we did not kill ends cleanly
    done = [e for e in obs.events if e.get("event") == "done"]
    final_step = int(done[-1]["step"]) if done else None
    final_sha = done[-1].get("params_sha256") if done else None
    if not done:
        reached = max((s.last_step for s in segments), default=0)
        violations.append(Violation(LAST_STEP,
                                    f"no 'done' event: training got to step {reached} of "
                                    f"{obs.steps}"))
    elif final_step != obs.steps:
        violations.append(Violation(LAST_STEP, f"'done' at step {final_step}, not {obs.steps}"))
    for node in obs.nodes:
        if node.killed:
            continue
        if node.exit_code is None:
            violations.append(Violation(LAST_STEP,
                                        f"{node.name} was still running when the scenario ended"))
        elif node.exit_code != 0 and not (node.left_out and node.exit_code == 1):
            violations.append(Violation(LAST_STEP,
                                        f"{node.name} exited with status {node.exit_code}"))

    # 3. bit-exact with an uninterrupted run when the world size never changed
    sizes = sorted({s.world_size for s in segments})
    if len(sizes) != 1:
        params_check = ("not applicable: the world size changed "
                        f"({', '.join(map(str, sizes)) or 'none'})")
    elif final_sha is None:
        params_check = "not checked: no final params_sha256"
    elif obs.reference_sha is None:
        params_check = f"not checked: {obs.reference_note}"
    elif final_sha == obs.reference_sha:
        params_check = f"equal ({final_sha[:12]}…)"
    else:
        params_check = f"different: {final_sha[:12]}… against {obs.reference_sha[:12]}…"
        violations.append(Violation(SAME_PARAMS,
                                    f"final params_sha256 {final_sha} differs from the "
                                    f"uninterrupted run's {obs.reference_sha} at world size "
                                    f"{sizes[0]}"))

    # 4. nothing left behind
    for leftover in obs.leftovers:
        violations.append(Violation(LEFTOVERS, f"still running after the job: {leftover}"))
    if obs.bound_ports:
        violations.append(Violation(LEFTOVERS, "ports still listening after the job: "
                                               + ", ".join(map(str, sorted(obs.bound_ports)))))
    return Verdict(tuple(violations), tuple(segments), tuple(restarts), params_check, final_step,
                   final_sha)


def listening_ports(proc_net_tcp: str) -> set[int]:
    """Local ports in LISTEN state in the text of ``/proc/net/tcp`` or ``tcp6``."""
    ports = set()
    for line in proc_net_tcp.splitlines()[1:]:
        parts = line.split()
        if len(parts) > 3 and parts[3] == "0A":  # TCP_LISTEN
            ports.add(int(parts[1].rsplit(":", 1)[1], 16))
    return ports
