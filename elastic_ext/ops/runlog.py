"""A training run's metrics events, analysed: rounds, restores, steps redone, time not training.

The events follow the bundled trainer's metrics contract
(``elastic_ext/worker/loop/metrics_file.py``): one JSON object per line with ``event``
(``start``, ``restore``, ``step``, ``snapshot``, ``stopped``, ``preempted``, ``done``),
``step``, ``world_size``, ``restart`` and ``time``. Any loop that writes the same events
can be analysed. Everything here is a pure function of the event list, so that
``elastic-ext report`` and the chaos harness (which judges a run from the same events)
share one reading of them and it can be tested on made-up lists.

A *round* (a worker generation) is a ``start`` event and the events up to the next one.
Where its state came from is its *restore* (:data:`RESTORE_SOURCES`). A round that ends
with ``stopped`` was restarted by its agents at a step boundary (a membership change).
A round that ends without ``done``, ``preempted`` or ``stopped`` and is followed by
another one was cut short: a *fault* (a killed or lost worker or node), visible in
the metrics only by its silence.

The agents' events files (``--rdzv-conf events_file``, ``rendezvous/agent/events.py``)
add what only the agents know: the stragglers they named (``slow`` events,
:func:`with_agent_events`), on the same unix-time axis.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from itertools import pairwise
from typing import Any, TypeVar

Event = Mapping[str, Any]

REQUIRED = ("event", "step", "world_size", "time")
"""The fields every event must have to be placed on the timeline."""

RATE_WINDOW = 1.0  # seconds per bin of the step-rate curve

AGENT_EVENT_SLACK_S = 60.0
"""Agents' events this long before the run's first event or after its last still belong to
it: the metrics file may be read mid-run, and the agent that names a straggler may run on
another machine than rank 0, whose clock may differ a little. Events further out (an
events file several runs appended to) are counted as ignored."""

BoundaryT = TypeVar("BoundaryT", bound="Boundary")

# field -> the JSON types it may have (None: null); "resumed_from" and "loss" may be null
_TYPES: dict[str, tuple[type | None, ...]] = {
    "event": (str,), "step": (int,), "world_size": (int,), "time": (int, float),
    "resumed_from": (int, None), "loss": (int, float, None),
}
_TYPE_TEXT = {"event": "a string", "step": "an integer", "world_size": "an integer",
              "time": "a number (unix seconds)", "resumed_from": "an integer or null",
              "loss": "a number or null"}


def _is(value: Any, kinds: tuple[type | None, ...]) -> bool:
    if value is None:
        return None in kinds
    return not isinstance(value, bool) and isinstance(value, tuple(k for k in kinds if k))


class RunLogError(ValueError):
    """The events cannot be analysed; the message says what to give instead."""


# ------------------------------------------------------------------------------ reading
def parse_events(text: str,
                 name: str = "the metrics file") -> tuple[list[dict[str, Any]], list[int]]:
    """The events of a JSON-lines text, and the numbers of the lines that do not parse.

    A line torn by a crash (or still being written) is skipped and counted, but a text
    whose first line is not JSON is not a metrics file: :class:`RunLogError` then, and
    for an object without the :data:`REQUIRED` fields or a text without any ``start``.
    """
    lines = [(number, line) for number, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not lines:
        raise RunLogError(f"{name} is empty: no event yet (is the run started with --metrics?)")
    events: list[dict[str, Any]] = []
    unreadable: list[int] = []
    for number, line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if not events:
                raise RunLogError(f"{name} line {number} is not JSON: give the JSON-lines file "
                                  "the run wrote with --metrics") from None
            unreadable.append(number)
            continue
        if not isinstance(record, dict):
            raise RunLogError(f"{name} line {number} is not a JSON object: give the JSON-lines "
                              "file the run wrote with --metrics")
        missing = [key for key in REQUIRED if key not in record]
        if missing:
            raise RunLogError(f"{name} line {number} lacks {', '.join(missing)}: every event "
                              f"needs {', '.join(REQUIRED)} "
                              "(see elastic_ext/worker/loop/metrics_file.py)")
        wrong = [key for key, kinds in _TYPES.items()
                 if key in record and not _is(record[key], kinds)]
        if wrong:
            raise RunLogError(f"{name} line {number}: "
                              + ", ".join(f"{key} must be {_TYPE_TEXT[key]}" for key in wrong)
                              + " (see elastic_ext/worker/loop/metrics_file.py)")
        events.append(record)
    if not any(e["event"] == "start" for e in events):
        raise RunLogError(f"{name} has no 'start' event: a round must log 'start' before its "
                          "steps (see elastic_ext/worker/loop/metrics_file.py)")
    return events, unreadable


# ----------------------------------------------------------------------------- segments
@dataclass(frozen=True)
class Segment:
    """One round of training: a ``start`` event and the events up to the next one."""

    start_time: float
    world_size: int
    resumed_from: int | None
    steps: tuple[int, ...]
    step_times: tuple[float, ...]
    end: str  # "done", "preempted", "stopped" or "cut" (the round ended without saying why)
    events: tuple[Event, ...] = field(default=(), repr=False, compare=False)

    @property
    def base(self) -> int:
        return self.resumed_from or 0

    @property
    def last_step(self) -> int:
        return self.steps[-1] if self.steps else self.base

    @property
    def last_time(self) -> float:
        """When the round was last heard of: its last event."""
        return max(float(e["time"]) for e in self.events) if self.events else self.start_time


def split_segments(events: Iterable[Event]) -> tuple[list[Segment], list[Event]]:
    """The segments, and any events logged before the first ``start`` (there should be none)."""
    segments: list[Segment] = []
    stray: list[Event] = []
    current: list[Event] = []

    def close() -> None:
        if not current:
            return
        start = current[0]
        steps = [e for e in current if e.get("event") == "step"]
        kinds = {e.get("event") for e in current}
        end = next((kind for kind in ("done", "preempted", "stopped") if kind in kinds), "cut")
        segments.append(Segment(float(start["time"]), int(start["world_size"]),
                                start.get("resumed_from"), tuple(int(e["step"]) for e in steps),
                                tuple(float(e["time"]) for e in steps), end, tuple(current)))

    for event in events:
        if event.get("event") == "start":
            close()
            current = [event]
        elif current:
            current.append(event)
        else:
            stray.append(event)
    close()
    return segments, stray


@dataclass(frozen=True)
class Boundary:
    """Between two segments: the steps thrown away and how long training stood still."""

    time: float                 # the new round's start event
    recovered_at: float | None  # the new round's first step
    stopped_at: float | None    # the old round's last step
    world_before: int
    world_after: int
    last_step: int              # the old round's last committed step
    resumed_from: int
    lost: int                   # the old round's steps after the one the new round starts at

    @property
    def downtime(self) -> float | None:
        if self.recovered_at is None or self.stopped_at is None:
            return None
        return self.recovered_at - self.stopped_at

    @classmethod
    def between(cls: type[BoundaryT], old: Segment, new: Segment,
                **extra: Any) -> BoundaryT:
        """The boundary from ``old`` to ``new``; ``extra`` fills a subclass's own fields."""
        last, resumed = old.last_step, new.base
        return cls(new.start_time, new.step_times[0] if new.step_times else None,
                   old.step_times[-1] if old.step_times else None, old.world_size,
                   new.world_size, last, resumed, max(0, last - resumed), **extra)


def durable_snapshots(events: Iterable[Event],
                      seen: Iterable[tuple[int, float]] = ()) -> list[tuple[int, float]]:
    """``(step, time)`` of every snapshot known to be durable: logged or seen on disk."""
    found = {(int(e["step"]), float(e["time"])) for e in events if e.get("event") == "snapshot"}
    found.update((int(step), float(when)) for step, when in seen)
    return sorted(found, key=lambda item: item[1])


def step_rate(times: Sequence[float],
              window: float = RATE_WINDOW) -> tuple[list[float], list[float]]:
    """Steps per second in consecutive windows: ``(window centres, rates)``."""
    if not times:
        return [], []
    start, end = min(times), max(times)
    bins = max(1, int((end - start) // window) + 1)
    counts = [0] * bins
    for t in times:
        counts[min(bins - 1, int((t - start) // window))] += 1
    centres = [start + (i + 0.5) * window for i in range(bins)]
    return centres, [c / window for c in counts]


# ----------------------------------------------------------------------------- restores
@dataclass(frozen=True)
class RestoreSource:
    """One way a round can get its state: recognised from its ``start`` event, to which
    the round's ``restore`` event adds ``restored_by`` (its ``source``)."""

    name: str
    matches: Callable[[Event], bool]
    describe: Callable[[Event], str]


RESTORE_SOURCES: tuple[RestoreSource, ...] = (
    RestoreSource("peer", lambda start: start.get("restored_by") == "peer",
                  lambda start: f"state from a peer at step {start['resumed_from']}"),
    RestoreSource("local", lambda start: start.get("restored_by") == "local",
                  lambda start: f"state kept on the node at step {start['resumed_from']}"),
    RestoreSource("snapshot", lambda start: start.get("resumed_from") is not None,
                  lambda start: f"snapshot at step {start['resumed_from']}"),
    RestoreSource("fresh", lambda start: True, lambda start: "fresh start"),
)
MEMORY_SOURCES = frozenset({"peer", "local"})
"""Restores from state kept in node memory: it may be of a step the old round trained
but did not log (a peer failed in the step-boundary collective), and it is on no disk."""
"""Tried in order, the first that matches names the source; the last matches anything."""


@dataclass(frozen=True)
class Restore:
    """Where one round's state came from."""

    round: int        # 1-based
    time: float       # the round's start event
    source: str       # a RestoreSource name
    step: int         # the step the round starts after
    description: str  # "snapshot at step 40", "fresh start"


def restore_of(round_number: int, segment: Segment,
               sources: Sequence[RestoreSource] = RESTORE_SOURCES) -> Restore:
    """Where ``segment`` got its state: the first of ``sources`` its start event matches."""
    start = dict(segment.events[0]) if segment.events else {"resumed_from": segment.resumed_from}
    restore = next((e for e in segment.events if e.get("event") == "restore"), None)
    if restore is not None:
        start["restored_by"] = restore.get("source")
    source = next(s for s in sources if s.matches(start))
    return Restore(round_number, segment.start_time, source.name, segment.base,
                   source.describe(start))


# ------------------------------------------------------------------------------ summary
@dataclass(frozen=True)
class Mark:
    """Something to draw as a vertical line on the timeline."""

    time: float
    label: str  # "" draws the line alone
    kind: str   # "round", "recovery", "preempted", "fault"... (see elastic_ext.ops.timeline.STYLES)


@dataclass(frozen=True)
class Straggler:
    """A node an agent named slow (its ``slow`` event): its own work per step against the
    other nodes' median, and whether it was left out (``straggler=drop``)."""

    time: float
    node: str  # the slow node (the event's ``peer``)
    own_s: float
    others_s: float
    dropped: bool
    by: str = ""  # the agent that named it
    step_s: float | None = None  # the job's step time then
    gain: float | None = None  # samples/s without it over samples/s with it

    @property
    def label(self) -> str:
        """``node-b slow: own 0.300s vs 0.100s (3.0x), left out``."""
        ratio = f" ({self.own_s / self.others_s:.1f}x)" if self.others_s > 0 else ""
        return (f"{self.node} slow: own {self.own_s:.3f}s vs {self.others_s:.3f}s{ratio}, "
                + ("left out" if self.dropped else "kept"))

    @classmethod
    def from_event(cls, event: Event) -> Straggler | None:
        """The straggler a ``slow`` event names; None for another event or a malformed one."""
        numbers = [event.get(k) for k in ("time", "own_s", "others_s")]
        if event.get("event") != "slow" or not isinstance(event.get("peer"), str) or \
                not all(_is(v, (int, float)) for v in numbers):
            return None
        optional = [event.get(k) if _is(event.get(k), (int, float)) else None
                    for k in ("step_s", "gain")]
        return cls(float(event["time"]), event["peer"], float(event["own_s"]),
                   float(event["others_s"]), event.get("dropped") is True,
                   str(event.get("node", "")), *optional)

    def mark(self) -> Mark:
        """The timeline's line: short, as the picture's labels stand in a narrow strip."""
        ratio = f" {self.own_s / self.others_s:.1f}x" if self.others_s > 0 else ""
        return Mark(self.time, f"{self.node} slow{ratio}, "
                    + ("left out" if self.dropped else "kept"), "slow")


@dataclass(frozen=True)
class RunSummary:
    """What happened during a run, from its metrics events alone."""

    segments: tuple[Segment, ...]
    boundaries: tuple[Boundary, ...]
    restores: tuple[Restore, ...]          # one per round
    faults: tuple[Mark, ...]               # rounds cut short and followed by another
    preemptions: tuple[Mark, ...]          # rounds that stopped on a signal, at the step boundary
    new_rounds: tuple[Mark, ...]           # rounds the agents stopped at a step boundary to
                                           # start another (a membership change)
    steps_redone: int                      # step events for a step already logged before
    startup_s: float | None                # the first start event to the first step
    gaps_s: tuple[float, ...]              # one round's last step to the next one's first step
    total_s: float                         # the first event to the last
    started: float                         # the first start event's time
    final_step: int | None                 # from 'done'; None if the run never logged it
    params_sha256: str | None
    last_step: int                         # the highest step logged
    ignored: int                           # events logged before the first start
    stragglers: tuple[Straggler, ...] = ()  # named by the agents (with_agent_events)
    agent_events: int | None = None        # agents' events read; None: no events file given
    agent_events_ignored: int = 0          # straggler events outside the run's time

    @property
    def rounds(self) -> int:
        return len(self.segments)

    @property
    def not_training_s(self) -> float:
        return (self.startup_s or 0.0) + sum(self.gaps_s)

    @property
    def finished(self) -> bool:
        return self.final_step is not None

    def restores_by_source(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for restore in self.restores:
            counts[restore.source] = counts.get(restore.source, 0) + 1
        return counts

    def marks(self) -> list[Mark]:
        """Every round (labelled with its restore), its first step, preemption and fault.

        The first step is often a split second after the start event, so the round's
        label says where its state came from and the first step's line has none.
        """
        marks = []
        for seg, restore in zip(self.segments, self.restores, strict=True):
            marks.append(Mark(seg.start_time, f"round {restore.round}: world {seg.world_size}, "
                                              f"{restore.description}", "round"))
            if seg.step_times and (restore.round > 1 or restore.source != "fresh"):
                marks.append(Mark(seg.step_times[0], "", "recovery"))
        marks += [*self.preemptions, *self.new_rounds, *self.faults]
        marks += [s.mark() for s in self.stragglers]
        return sorted(marks, key=lambda m: m.time)


def steps_text(first: int, last: int) -> str:
    """``step 7`` or ``steps 7-12``: how reports and verdicts name a run of steps."""
    return f"step {first}" if first == last else f"steps {first}-{last}"


def stop_label(preempted: Event) -> str:
    """``stopped at step N by SIGTERM``: a round that left at a step boundary on a signal."""
    signal = preempted.get("signal")
    return f"stopped at step {preempted['step']}" + (f" by {signal}" if signal else "")


def summarize(events: Sequence[Event],
              sources: Sequence[RestoreSource] = RESTORE_SOURCES) -> RunSummary:
    """The summary of a run; :class:`RunLogError` when it has no ``start`` event."""
    segments, stray = split_segments(events)
    if not segments:
        raise RunLogError("no 'start' event: a round must log 'start' before its steps")
    restores = tuple(restore_of(n, s, sources) for n, s in enumerate(segments, 1))
    faults = tuple(Mark(old.last_time, f"round {n} cut at step {old.last_step}", "fault")
                   for n, old in enumerate(segments[:-1], 1) if old.end == "cut")
    preemptions = tuple(Mark(float(e["time"]), stop_label(e), "preempted")
                        for s in segments for e in s.events if e.get("event") == "preempted")
    new_rounds = tuple(Mark(float(e["time"]), f"new round at step {e['step']}", "new-round")
                       for s in segments for e in s.events if e.get("event") == "stopped")

    seen: set[int] = set()
    redone = 0
    step_times: list[tuple[float, int]] = []  # (time, round index) of every step
    for index, seg in enumerate(segments):
        for step, when in zip(seg.steps, seg.step_times, strict=True):
            redone += step in seen
            seen.add(step)
            step_times.append((when, index))
    # max(0, ...): rank 0, which writes the file, may move to a machine with another clock
    gaps = tuple(max(0.0, later - earlier)
                 for (earlier, a), (later, b) in pairwise(step_times) if a != b)
    started = segments[0].start_time
    startup = step_times[0][0] - started if step_times else None
    times = [float(e["time"]) for s in segments for e in s.events]
    done = [e for s in segments for e in s.events if e.get("event") == "done"]
    return RunSummary(
        segments=tuple(segments),
        boundaries=tuple(Boundary.between(old, new) for old, new in pairwise(segments)),
        restores=restores, faults=faults, preemptions=preemptions, new_rounds=new_rounds,
        steps_redone=redone,
        startup_s=startup, gaps_s=gaps, total_s=max(times) - started, started=started,
        final_step=int(done[-1]["step"]) if done else None,
        params_sha256=done[-1].get("params_sha256") if done else None,
        last_step=max(seen, default=segments[0].base), ignored=len(stray))


def with_agent_events(summary: RunSummary, events: Sequence[Event]) -> RunSummary:
    """``summary`` with what the agents' events add: the stragglers they named during the
    run's time (:data:`AGENT_EVENT_SLACK_S`), each once (the same file given twice, or a
    directory and a file in it)."""
    start = summary.started - AGENT_EVENT_SLACK_S
    end = summary.started + summary.total_s + AGENT_EVENT_SLACK_S
    named = {s for s in map(Straggler.from_event, events) if s is not None}
    kept = tuple(sorted((s for s in named if start <= s.time <= end),
                        key=lambda s: (s.time, s.node)))
    return replace(summary, stragglers=kept, agent_events=len(events),
                   agent_events_ignored=len(named) - len(kept))
