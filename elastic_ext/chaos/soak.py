"""A random-fault soak: a seeded schedule of the harness's faults, played as one scenario.

The schedule is ordinary scenario text (:func:`plan` is pure), so the soak is judged by
the matrix's own runner and invariants, draws the same timeline, and any soak can be
replayed exactly: the same ``--seed`` gives the same text, and ``--print-schedule``
writes it for ``elastic-ext chaos FILE``.

Faults are placed at *steps*, not at wall-clock times: ``at step N`` fires only while
the job trains, so the trainer cannot finish before the last fault, and a fault never
lands on a job that is still recovering from the previous one (recovery waits are
subtracted from the next gap, from an estimate per kind, so that the wall-clock rate is
about the one asked for). Each fault is followed by what restores the job's shape: a
killed node is replaced once the job recovered (unless a join had added one), a
preemption is followed by a restart of every node; a freeze, a partition and an etcd
fault carry their own duration. After the last fault a quiet tail lets its recovery
finish before the trainer's last step, so the final checks are about that recovery.

On top of the matrix's invariants the soak checks that every fault recovered within
the recovery bound and that training never stood still for longer than it, and
reports one line per fault: its kind, the time to recover (the fault to the first
step of a round started after it; training that went on without a new round counts
from its next step) and the steps lost.
"""

from __future__ import annotations

import math
import random
import re
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from elastic_ext.chaos.invariants import Violation
from elastic_ext.chaos.runner import RunOptions, RunResult, run_scenario
from elastic_ext.chaos.scenario import (
    NETNS_VERBS,
    Scenario,
    ScenarioError,
    ScenarioSettings,
    apply_setting,
    parse,
)

__all__ = ["DEFAULT_KINDS", "KINDS", "NETNS_KINDS", "FaultOutcome", "PlannedFault",
           "ScheduleError", "Soak", "SoakResult", "SoakStats", "analyse", "fault_lines",
           "format_duration", "format_every",
           "parse_duration", "parse_every", "parse_kinds", "plan", "run_soak", "summary_lines"]

KINDS: dict[str, str] = {
    "kill-worker": "SIGKILL one worker process (its agent lives; costs one restart)",
    "kill-node": "SIGKILL a node without rank 0; a new node starts once the job recovered",
    "kill-rank0": "SIGKILL the node with group rank 0; a new node starts once recovered",
    "freeze": "SIGSTOP a node for a while (SIGCONT after)",
    "join": "start one more node (up to --nodes + 1)",
    "preempt": "SIGUSR2 to every worker, then every node started again",
    "notice": "SIGUSR2 to one node's agent and workers: it leaves, the others train on; "
              "a new node starts once the job recovered",
    "notice-all": "SIGUSR2 to every node over 2 s: one whole-job stop with a snapshot, then "
                  "every node started again",
    "terminate-rank0": "SIGTERM to the rank-0 node's agent alone (a pod deleted); a new node "
                       "starts once the job recovered",
    "etcd-member": "kill the etcd leader or a follower for a while (3 members)",
    "etcd-restart": "kill every etcd member, start them again on their data directories",
    "partition": "take a node's network link down for a while (network namespaces, root)",
    "drop": "drop everything a node sends, without a word, for a while (network namespaces, "
            "root)",
    "cut-peers": "cut a node off the other nodes, not off etcd, for 90 s (network namespaces, "
                 "root): the job leaves it out, then a new node starts",
}
"""The fault kinds a soak draws from, with what each does to the job."""

DEFAULT_KINDS = tuple(kind for kind in KINDS if kind != "cut-peers")
"""What a soak draws from unless ``--kinds`` says otherwise. A cut-off node is found only
when the trainer's collective times out (60 s), a minute of every soak it is drawn in:
``--kinds all`` or naming ``cut-peers`` adds it."""

NETNS_KINDS = NETNS_VERBS
"""Kinds that need every node in a network namespace of its own (root): those named after
the scenario actions that do."""

CUT_PEERS_S = 90
"""How long ``cut-peers`` lasts: past the trainer's collective timeout and the round that
leaves the node out."""

LASTING = ("freeze", "partition", "drop", "etcd-member", "etcd-restart")
"""Kinds that last a while; their duration is drawn from :data:`DOWN_S`."""

DOWN_S = (5, 15)
"""Seconds a freeze, partition or etcd fault lasts (capped so it ends before the next fault)."""

HANG = "no hang longer than the recovery bound"

# Estimates measured on a 2-core machine (3 nodes, tiny model, etcd, warm worker starts),
# used only to place faults: the trainer's step rate as a share of 1/step-delay, the time
# from the start to the first step, and how long training stands still after each kind.
STEP_EFFICIENCY = 0.85
STARTUP_S = 7.0
STALL_S: dict[str, float] = {
    "kill-worker": 1.0, "kill-node": 1.0, "kill-rank0": 1.0, "freeze": 4.0, "join": 1.0,
    "preempt": 7.0, "notice": 2.0, "notice-all": 9.0, "terminate-rank0": 2.0,
    "etcd-member": 0.0, "etcd-restart": 0.0, "partition": 5.0, "drop": 5.0,
    "cut-peers": 65.0,
}
MIN_TRAIN_S = 5.0   # training between two faults, however short the gap
TAIL_S = 20.0       # training after the last fault has ended
MIN_GAP_S = 10.0    # the shortest --every: a fault must be noticed before the next one
FORBIDDEN = {"steps": "--duration", "nodes": "--nodes", "nnodes": "--nodes"}
"""Settings the soak computes itself, and the option that sets them instead."""


class ScheduleError(ScenarioError):
    """The soak's options cannot make a schedule; the message names the option to change."""


# ------------------------------------------------------------------------------ options
_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str, option: str = "--duration") -> float:
    """Seconds in ``90s``, ``2m``, ``1.5h``, ``1h30m`` or a bare number of seconds."""
    clean = text.strip().lower()
    if re.fullmatch(r"\d+(?:\.\d+)?", clean):
        seconds = float(clean)
    elif re.fullmatch(r"(?:\d+(?:\.\d+)?[smh])+", clean):
        seconds = sum(float(number) * _UNITS[unit]
                      for number, unit in re.findall(r"(\d+(?:\.\d+)?)([smh])", clean))
    else:
        raise ScheduleError(f"{option} {text!r}: expected a time such as 30m, 90s or 1h30m")
    if not seconds > 0:
        raise ScheduleError(f"{option} {text!r}: must be more than 0s")
    return seconds


def parse_every(text: str) -> tuple[float, float]:
    """``20-40s`` (a gap drawn uniformly from 20 to 40 s), ``20s-1m``, or one time: ``30s``."""
    low_text, sep, high_text = text.partition("-")
    if sep:
        unit = re.search(r"[smh]$", high_text.strip().lower())
        if unit and re.fullmatch(r"\s*\d+(?:\.\d+)?\s*", low_text):
            low_text += unit.group(0)  # 20-40s: the unit is shared
    else:
        high_text = low_text
    try:
        low, high = parse_duration(low_text, "--every"), parse_duration(high_text, "--every")
    except ScheduleError:
        raise ScheduleError(f"--every {text!r}: expected a range such as 20-40s "
                            "or one time such as 30s") from None
    if low > high:
        raise ScheduleError(f"--every {text!r}: the shorter gap comes first, e.g. 20-40s")
    if low < MIN_GAP_S:
        raise ScheduleError(f"--every {text!r}: gaps under {MIN_GAP_S:g}s leave no time to "
                            "notice a fault before the next one; use e.g. 20-40s")
    return low, high


def parse_kinds(text: str) -> tuple[str, ...]:
    """A comma-separated list of :data:`KINDS` (``all`` for every one), in the table's order."""
    names = [name.strip().lower() for name in text.split(",") if name.strip()]
    if names == ["all"]:
        return tuple(KINDS)
    unknown = [name for name in names if name not in KINDS]
    if unknown or not names:
        raise ScheduleError(f"--kinds {text!r}: unknown kind {', '.join(unknown) or '(none)'}; "
                            f"choose from {','.join(KINDS)}")
    return tuple(kind for kind in KINDS if kind in names)


def format_duration(seconds: float) -> str:
    """``2m``, ``90s``, ``1h30m``: what :func:`parse_duration` reads back to the same value."""
    if seconds != int(seconds):
        return f"{seconds:g}s"
    whole = int(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    text = (f"{hours}h" if hours else "") + (f"{minutes}m" if minutes else "")
    return text + (f"{secs}s" if secs or not text else "")


def format_every(every: tuple[float, float]) -> str:
    """``20-40s``, ``30s`` or ``30s-2m``: what :func:`parse_every` reads back."""
    low, high = every
    if low == high:
        return format_duration(low)
    if low < 60 and high < 60 and low == int(low) and high == int(high):
        return f"{int(low)}-{int(high)}s"
    return f"{format_duration(low)}-{format_duration(high)}"


# ------------------------------------------------------------------------------ the plan
@dataclass(frozen=True)
class PlannedFault:
    """One fault of the schedule: its kind, its scenario lines (the fault, then what
    restores the job's shape), and when it should come (seconds since the job started)."""

    number: int            # 1-based
    kind: str
    step: int              # fires at the first step >= this
    lines: tuple[str, ...]
    planned_s: float
    nodes_after: int       # the node count once the job's shape is restored

    def describe(self) -> str:
        return self.lines[0].split(": ", 1)[1]


@dataclass(frozen=True)
class Soak:
    """A soak's schedule as scenario text, and what the report needs to read it back."""

    seed: int
    duration_s: float
    every: tuple[float, float]
    nodes: int
    kinds: tuple[str, ...]
    overrides: tuple[tuple[str, str], ...]
    faults: tuple[PlannedFault, ...]
    scenario: Scenario
    planned_s: float        # about how long the run takes, recoveries included
    recovery_bound_s: float

    @property
    def text(self) -> str:
        return self.scenario.text

    def replay_command(self) -> str:
        """The command line that plays this very schedule again."""
        return _command(self.seed, self.duration_s, self.every, self.nodes, self.kinds,
                        dict(self.overrides), self.recovery_bound_s)


def _allowed(kinds: Sequence[str], live: int, max_nodes: int) -> list[str]:
    return [kind for kind in kinds if kind != "join" or live < max_nodes]


def plan(seed: int, duration_s: float, *, every: tuple[float, float] = (20.0, 40.0),
         nodes: int = 3, kinds: Sequence[str] = DEFAULT_KINDS,
         overrides: Mapping[str, str] | None = None,
         recovery_bound_s: float = 120.0) -> Soak:
    """The soak of ``seed``: a pure function of its arguments (no process, no clock).

    ``every`` is the range the gap between two faults is drawn from (seconds), ``nodes``
    the node count the job starts with and returns to, ``overrides`` scenario settings
    (``--set``) written after the generated ones. :class:`ScheduleError` says which
    option to change when no schedule fits.
    """
    overrides = dict(overrides or {})
    for key, option in FORBIDDEN.items():
        if key in overrides:
            raise ScheduleError(f"--set {key}: the soak sets {key} itself; use {option}")
    kinds = tuple(kind for kind in KINDS if kind in kinds)
    if not kinds:
        raise ScheduleError(f"--kinds: choose at least one of {','.join(KINDS)}")
    if kinds == ("join",):
        raise ScheduleError("--kinds join: a join needs a kind that takes the job back to "
                            "--nodes (kill-node, kill-rank0, notice or preempt)")
    if nodes < 2:
        raise ScheduleError(f"--nodes {nodes}: a soak needs at least 2 nodes, so that a fault "
                            "leaves a survivor")
    low, high = every
    if not MIN_GAP_S <= low <= high:
        raise ScheduleError(f"--every: gaps must be at least {MIN_GAP_S:g}s, shorter first")
    settings = ScenarioSettings()
    for key, value in overrides.items():
        try:
            settings = apply_setting(settings, key, value)
        except ScenarioError as exc:
            raise ScheduleError(f"--set {key}={value}: {exc}") from None
    if not settings.step_delay > 0:
        raise ScheduleError("--set step-delay: the soak needs a step delay above 0 "
                            "(it places faults at steps from the step rate)")
    if "etcd-member" in kinds and overrides.get("etcd-members", "3") != "3":
        raise ScheduleError("--set etcd-members: the etcd-member kind needs 3 members")
    rate = STEP_EFFICIENCY / settings.step_delay  # steps per second of training
    max_nodes = nodes + 1 if "join" in kinds else nodes
    down_high = max(DOWN_S[0], min(DOWN_S[1], int(low) - 5))

    rng = random.Random(seed)
    faults: list[PlannedFault] = []
    clock = STARTUP_S      # planned seconds since the job started
    step = 0
    live = nodes
    stall = 0.0            # how long the previous fault stops training
    while True:
        gap = rng.uniform(low, high)
        kind = rng.choice(_allowed(kinds, live, max_nodes))
        down = rng.randint(DOWN_S[0], down_high) if kind in LASTING else 0
        at = clock + gap
        if at + STALL_S[kind] + down + TAIL_S > duration_s:
            break
        step += max(1, round(max(MIN_TRAIN_S, gap - stall) * rate))
        lines, live = _lines(kind, step, down, live, nodes, rng)
        faults.append(PlannedFault(len(faults) + 1, kind, step, lines, round(at, 1), live))
        clock, stall = at, STALL_S[kind]
    if not faults:
        raise ScheduleError(f"--duration {format_duration(duration_s)}: no fault fits (the job "
                            f"starts in about {STARTUP_S:g}s, the first gap is {low:g}-{high:g}s "
                            f"and the last fault needs {TAIL_S:g}s after it); give a longer "
                            "--duration or a shorter --every")
    last = faults[-1]
    # The quiet tail: training from the last fault's recovery to the end. Every fault
    # was accepted only with its duration, recovery and TAIL_S before the end, so the
    # tail outlasts the last fault by TAIL_S at least.
    tail_s = duration_s - last.planned_s - STALL_S[last.kind]
    steps = last.step + round(tail_s * rate)
    kill_workers = sum(f.kind == "kill-worker" for f in faults)
    generated = {
        "nodes": str(nodes),
        "nnodes": f"{max(1, nodes - 1)}:{max_nodes}",
        "etcd-members": "3" if "etcd-member" in kinds else "1",
        "steps": str(steps),
        "max-restarts": str(kill_workers + 3),
        "timeout": str(math.ceil(2 * duration_s + 180)),
    }
    header = [f"# {_command(seed, duration_s, every, nodes, kinds, overrides, recovery_bound_s)}",
              f"# {len(faults)} fault(s), planned over about {format_duration(duration_s)} "
              "(recoveries estimated); replay: elastic-ext chaos THIS-FILE"]
    text_lines = header + [f"{key} = {value}" for key, value in generated.items()]
    text_lines += [f"{key} = {value}" for key, value in overrides.items()]
    for fault in faults:
        text_lines += ["", f"# fault {fault.number} at about {fault.planned_s:g}s: {fault.kind}",
                       *fault.lines]
    name = f"soak-{seed}"
    try:
        scenario = parse("\n".join(text_lines) + "\n", name)
    except ScenarioError as exc:  # a --set the drawn faults cannot run with
        raise ScheduleError(f"{exc}; change --set or --kinds") from None
    return Soak(seed, duration_s, (low, high), nodes, kinds, tuple(overrides.items()),
                tuple(faults), scenario, duration_s, recovery_bound_s)


def _lines(kind: str, step: int, down: int, live: int, nodes: int,
           rng: random.Random) -> tuple[tuple[str, ...], int]:
    """The scenario lines of one fault and the node count after them."""
    at = f"at step {step}: "
    if kind == "kill-worker":
        return (at + f"kill worker {rng.choice(('other', 'rank0'))}",), live
    if kind in ("kill-node", "kill-rank0", "notice", "terminate-rank0"):
        line = at + {"kill-node": "kill node other", "kill-rank0": "kill node rank0",
                     "notice": "notice node other", "terminate-rank0": "terminate node rank0"}[kind]
        if live > nodes:  # a join had added one: the kill takes the job back to its size
            return (line,), live - 1
        return (line, "when recovered: start node"), live
    if kind == "freeze":
        return (at + f"freeze node other for {down}s",), live
    if kind == "partition":
        return (at + f"partition node other for {down}s",), live
    if kind == "drop":
        return (at + f"drop node other for {down}s",), live
    if kind == "cut-peers":  # the node is left out and exits, like a killed one
        line = at + f"cut peers of node other for {CUT_PEERS_S}s"
        if live > nodes:
            return (line,), live - 1
        return (line, "when recovered: start node"), live
    if kind == "join":
        return (at + "start node",), live + 1
    if kind in ("preempt", "notice-all"):
        fault = "preempt all" if kind == "preempt" else "notice all over 2s"
        return (at + fault, "when stopped: start all"), nodes
    if kind == "etcd-member":
        return (at + f"kill etcd {rng.choice(('leader', 'follower'))} for {down}s",), live
    if kind == "etcd-restart":
        return (at + f"kill etcd all for {down}s",), live
    raise ScheduleError(f"unknown kind {kind!r}")


def _command(seed: int, duration_s: float, every: tuple[float, float], nodes: int,
             kinds: Sequence[str], overrides: Mapping[str, str], bound_s: float) -> str:
    words = ["elastic-ext chaos soak", f"--duration {format_duration(duration_s)}",
             f"--seed {seed}", f"--every {format_every(every)}", f"--nodes {nodes}",
             f"--kinds {','.join(kinds)}", f"--recovery-bound {format_duration(bound_s)}"]
    return " ".join(words + [f"--set {key}={value}" for key, value in overrides.items()])


# ----------------------------------------------------------------------------- the result
@dataclass(frozen=True)
class FaultOutcome:
    """What one fault did to the job, read from the run."""

    number: int
    kind: str
    description: str           # the action as written
    detail: str = ""           # what it hit, from the injector ("" if it never fired)
    time: float | None = None  # unix time it fired
    recovered_at: float | None = None
    restarts: int = 0          # new rounds until the next fault
    lost: int = 0              # steps lost in those rounds

    @property
    def fired(self) -> bool:
        return self.time is not None

    @property
    def recover_s(self) -> float | None:
        if self.time is None or self.recovered_at is None:
            return None
        return max(0.0, self.recovered_at - self.time)


@dataclass(frozen=True)
class SoakStats:
    """The numbers of the summary line."""

    planned: int = 0
    fired: int = 0
    by_kind: tuple[tuple[str, int], ...] = ()
    recovered: int = 0
    median_recover_s: float | None = None
    worst_recover_s: float | None = None
    lost_steps: int = 0


@dataclass(frozen=True)
class SoakResult:
    soak: Soak
    run: RunResult
    outcomes: tuple[FaultOutcome, ...] = ()
    violations: tuple[Violation, ...] = ()   # the soak's own, beyond the run's verdict
    longest_stall_s: float = 0.0
    stats: SoakStats = field(default_factory=SoakStats)

    @property
    def skipped(self) -> str | None:
        return self.run.skipped

    @property
    def ok(self) -> bool:
        return self.run.ok and not self.violations

    @property
    def all_violations(self) -> tuple[Violation, ...]:
        run = self.run.verdict.violations if self.run.verdict is not None else ()
        return (*run, *self.violations)


def analyse(soak: Soak, run: RunResult) -> SoakResult:
    """Per-fault recovery and loss, the recovery-bound checks, and the summary numbers."""
    verdict, obs = run.verdict, run.observation
    if verdict is None or obs is None:
        return SoakResult(soak, run, stats=_stats(soak, ()))
    injected = [record for record in obs.faults if not record.restore]
    first_line: list[int] = []
    index = 0
    for fault in soak.faults:
        first_line.append(index)
        index += len(fault.lines)
    times = [injected[i].time if i < len(injected) else None for i in first_line]
    steps = sorted(float(e["time"]) for e in obs.events if e.get("event") == "step")
    t0 = run.started
    outcomes: list[FaultOutcome] = []
    violations: list[Violation] = []
    for number, (fault, when) in enumerate(zip(soak.faults, times, strict=True)):
        if when is None:
            outcomes.append(FaultOutcome(fault.number, fault.kind, fault.describe()))
            continue
        until = next((t for t in times[number + 1:] if t is not None), math.inf)
        restarts = [r for r in verdict.restarts if when < r.time <= until]
        recovered = next((r.recovered_at for r in restarts if r.recovered_at is not None), None)
        if not restarts:  # training went on: its next step
            recovered = next((t for t in steps if when < t <= until), None)
        outcome = FaultOutcome(fault.number, fault.kind, fault.describe(),
                               injected[first_line[number]].detail, when, recovered,
                               len(restarts), sum(r.lost for r in restarts))
        outcomes.append(outcome)
        took = outcome.recover_s
        if took is None:
            violations.append(Violation(HANG, f"fault {fault.number} ({fault.kind}, "
                                              f"{fault.describe()}) at t={when - t0:.1f}s: "
                                              "training never went on"))
        elif took > soak.recovery_bound_s:
            violations.append(Violation(HANG, f"fault {fault.number} ({fault.kind}) at "
                                              f"t={when - t0:.1f}s took {took:.1f}s to recover, "
                                              f"more than {soak.recovery_bound_s:g}s"))
    stall, stall_at = 0.0, 0.0
    for earlier, later in zip(steps, steps[1:], strict=False):
        if later - earlier > stall:
            stall, stall_at = later - earlier, earlier
    if stall > soak.recovery_bound_s:
        violations.append(Violation(HANG, f"no step from t={stall_at - t0:.1f}s for {stall:.1f}s, "
                                          f"more than {soak.recovery_bound_s:g}s"))
    return SoakResult(soak, run, tuple(outcomes), tuple(violations), stall,
                      _stats(soak, outcomes))


def _stats(soak: Soak, outcomes: Sequence[FaultOutcome]) -> SoakStats:
    recovered = [took for o in outcomes if (took := o.recover_s) is not None]
    by_kind: dict[str, int] = {}
    for o in outcomes:
        if o.fired:
            by_kind[o.kind] = by_kind.get(o.kind, 0) + 1
    return SoakStats(len(soak.faults), sum(o.fired for o in outcomes),
                     tuple(sorted(by_kind.items())), len(recovered),
                     round(statistics.median(recovered), 1) if recovered else None,
                     round(max(recovered), 1) if recovered else None,
                     sum(o.lost for o in outcomes))


def fault_lines(result: SoakResult) -> list[str]:
    """One line per fault: number, time, kind, time to recover, steps lost, what it hit."""
    lines = []
    t0 = result.run.started
    for o in result.outcomes:
        if not o.fired or o.time is None:
            lines.append(f"fault {o.number:>3} {'':>9} {o.kind:<12} not fired ({o.description})")
            continue
        took = o.recover_s
        recover = "NOT recovered" if took is None else f"recovered in {took:5.1f}s"
        rounds = f"{o.restarts} new round(s)" if o.restarts else "no new round"
        lines.append(f"fault {o.number:>3} t={o.time - t0:7.1f}s {o.kind:<12} {recover}, "
                     f"lost {o.lost} step(s), {rounds} ({o.description}: {o.detail})")
    return lines


def summary_lines(result: SoakResult) -> list[str]:
    """The soak's summary: faults per kind, recovered, median and worst recovery, loss, and
    the command that replays it."""
    stats = result.stats
    kinds = ", ".join(f"{kind} {count}" for kind, count in stats.by_kind) or "none"
    recovery = (f"recovery median {stats.median_recover_s:g}s, worst {stats.worst_recover_s:g}s"
                if stats.median_recover_s is not None and stats.worst_recover_s is not None
                else "no recovery measured")
    verdict = "SKIP" if result.skipped else "PASS" if result.ok else "FAIL"
    return [f"soak {verdict}: {stats.fired} of {stats.planned} fault(s) fired ({kinds}); "
            f"recovered {stats.recovered}; {recovery}; lost {stats.lost_steps} step(s); "
            f"longest stall {result.longest_stall_s:.1f}s; seed {result.soak.seed}",
            f"replay: {result.soak.replay_command()}"]


def run_soak(soak: Soak, options: RunOptions) -> SoakResult:
    """Play the soak with the matrix's runner and judge it: its invariants and the soak's."""
    return analyse(soak, run_scenario(soak.scenario, options))
