"""``elastic-ext report METRICS.jsonl``: what happened during a run, from its metrics file.

Rounds, restores by source, faults and preemptions, steps trained twice and time not
training, as a short text (or ``--json``), and with ``--out DIR`` the same as
``report.json`` plus the timeline ``report.png`` (the chaos harness's picture, for any
run of the bundled trainer or of a loop that writes the same events). ``--events`` adds
the agents' events files: the stragglers they named, on the same timeline. The analysis is
:mod:`elastic_ext.ops.runlog`, the picture :mod:`elastic_ext.ops.timeline`; this module only
reads the file and writes the results, the one place of the command that prints.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from elastic_ext.jsonlines import read_json_lines
from elastic_ext.ops.runlog import (
    RunLogError,
    RunSummary,
    Segment,
    parse_events,
    steps_text,
    stop_label,
    summarize,
    with_agent_events,
)
from elastic_ext.ops.timeline import MissingMatplotlib, draw

logger = logging.getLogger(__name__)

EXIT_OK, EXIT_NO_PICTURE, EXIT_BAD_INPUT = 0, 1, 2

EPILOG = """\
METRICS.jsonl is the file the bundled trainer writes with --metrics (the chaos harness
keeps one in each work directory), or any file of the same JSON lines: event (start,
step, snapshot, preempted, done), step, world_size and time; start has resumed_from.

--events adds the agents' events files (--rdzv-conf events_file=PATH; a directory: every
*.jsonl in it): the stragglers they named ("slow" events) join the summary and the
timeline.

Exit status: 0 done, 1 the picture could not be drawn (no matplotlib:
pip install 'elastic-ext[report]'), 2 the metrics file could not be read.
"""


def add_arguments(parser: argparse.ArgumentParser, name: str = "report") -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EPILOG
    parser.add_argument("metrics", type=Path, metavar="METRICS.jsonl",
                        help="the run's metrics file (the trainer's --metrics)")
    parser.add_argument("--out", type=Path, metavar="DIR",
                        help="write DIR/report.json and DIR/report.png (the timeline)")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument("--dpi", type=int, default=100,
                        help="resolution of report.png (default %(default)s)")
    parser.add_argument("--events", type=Path, action="append", default=[],
                        metavar="EVENTS.jsonl",
                        help="an agent's events file (events_file=), or a directory of "
                        "them; may be repeated: adds the stragglers the agents named")


def read_events(path: Path) -> tuple[list[dict[str, Any]], list[int]]:
    """The file's events and its unreadable lines; :class:`RunLogError` (one line: the reason
    and the fix) when it is not a metrics file."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RunLogError(f"{path}: no such file; give the file the run wrote with "
                          "--metrics") from None
    except IsADirectoryError:
        raise RunLogError(f"{path} is a directory; give the metrics file in it "
                          "(e.g. metrics.jsonl)") from None
    except UnicodeDecodeError:
        raise RunLogError(f"{path} is not a text file; give the JSON-lines file the run wrote "
                          "with --metrics") from None
    except OSError as exc:
        raise RunLogError(f"{path}: {exc.strerror or exc}") from None
    return parse_events(text, str(path))


def read_agent_events(paths: Sequence[Path]) -> list[dict[str, Any]]:
    """Every event of the agents' events files at ``paths`` (a directory: its ``*.jsonl``);
    :class:`RunLogError` for a path that is not there. A torn line is skipped."""
    events: list[dict[str, Any]] = []
    for path in paths:
        if path.is_dir():
            files = sorted(path.glob("*.jsonl"))
        elif path.exists():
            files = [path]
        else:
            raise RunLogError(f"{path}: no such file; give an agent's events file "
                              "(--rdzv-conf events_file=PATH) or a directory of them")
        for file in files:
            try:
                events += read_json_lines(file)
            except (OSError, UnicodeDecodeError) as exc:
                raise RunLogError(f"{file}: not an events file ({exc})") from None
    return events


# ------------------------------------------------------------------------------ views
def _rel(value: float, t0: float) -> float:
    return round(value - t0, 3)


def _steps_text(seg: Segment) -> str:
    return steps_text(seg.steps[0], seg.steps[-1]) if seg.steps else "no step"


def _end_text(seg: Segment, last: bool) -> str:
    if seg.end == "done":
        return "done"
    if seg.end == "preempted":
        return stop_label(next(e for e in seg.events if e.get("event") == "preempted"))
    if seg.end == "stopped":
        stopped = next(e for e in seg.events if e.get("event") == "stopped")
        return f"stopped at step {stopped['step']} for a new round ({stopped.get('reason')})"
    return ("no end logged (still running, or stopped without a word)" if last
            else "cut short (a fault)")


def as_data(summary: RunSummary, metrics: Path,
            unreadable: Sequence[int] = ()) -> dict[str, Any]:
    """The summary as JSON-ready data; times in seconds since the first start event."""
    t0 = summary.started
    rounds = []
    for number, (seg, restore) in enumerate(zip(summary.segments, summary.restores,
                                                strict=True), 1):
        start = seg.events[0] if seg.events else {}
        rounds.append({
            "round": number, "t": _rel(seg.start_time, t0), "world_size": seg.world_size,
            "restart": start.get("restart"),
            "restore": {"source": restore.source, "step": restore.step,
                        "description": restore.description},
            "first_step": seg.steps[0] if seg.steps else None,
            "last_step": seg.steps[-1] if seg.steps else None,
            "first_step_t": _rel(seg.step_times[0], t0) if seg.step_times else None,
            "last_step_t": _rel(seg.step_times[-1], t0) if seg.step_times else None,
            "end": seg.end,
        })
    return {
        "metrics": str(metrics),
        "rounds": rounds,
        "restores_by_source": summary.restores_by_source(),
        "faults": [{"t": _rel(m.time, t0), "description": m.label} for m in summary.faults],
        "preemptions": [{"t": _rel(m.time, t0), "description": m.label}
                        for m in summary.preemptions],
        "new_rounds": [{"t": _rel(m.time, t0), "description": m.label}
                       for m in summary.new_rounds],
        "steps_redone": summary.steps_redone,
        "restarts": [{"t": _rel(b.time, t0), "world_before": b.world_before,
                      "world_after": b.world_after, "last_step": b.last_step,
                      "resumed_from": b.resumed_from, "lost_steps": b.lost,
                      "downtime_s": None if b.downtime is None else round(b.downtime, 3)}
                     for b in summary.boundaries],
        "not_training_s": round(summary.not_training_s, 3),
        "startup_s": None if summary.startup_s is None else round(summary.startup_s, 3),
        "gaps_s": [round(g, 3) for g in summary.gaps_s],
        "total_s": round(summary.total_s, 3),
        "finished": summary.finished,
        "final_step": summary.final_step,
        "last_step": summary.last_step,
        "params_sha256": summary.params_sha256,
        "ignored_events": summary.ignored,
        "unreadable_lines": list(unreadable),
        "stragglers": [{"t": _rel(s.time, t0), "node": s.node, "own_s": s.own_s,
                        "others_s": s.others_s, "step_s": s.step_s, "gain": s.gain,
                        "dropped": s.dropped, "named_by": s.by} for s in summary.stragglers],
        "agent_events": summary.agent_events,
        "ignored_straggler_events": summary.agent_events_ignored,
    }


def as_text(summary: RunSummary, metrics: Path, unreadable: Sequence[int] = ()) -> str:
    """The short summary a person reads."""
    t0 = summary.started
    state = (f"finished at step {summary.final_step}" if summary.finished
             else f"not finished: last step {summary.last_step}, no 'done' logged")
    lines = [f"{metrics}: {state}",
             f"rounds: {summary.rounds} (worker generations)"]
    width = max(len(r.description) for r in summary.restores)
    for number, (seg, restore) in enumerate(zip(summary.segments, summary.restores,
                                                strict=True), 1):
        when = f"t={seg.start_time - t0:.1f}s"
        lines.append(f"  round {number:<3} {when:<9} world {seg.world_size:<3} "
                     f"{restore.description:<{width}} {_steps_text(seg):<13} "
                     f"{_end_text(seg, number == summary.rounds)}")
    by_source = ", ".join(f"{name} {count}" for name, count in summary.restores_by_source().items())
    lines.append(f"restores by source: {by_source}")
    for title, marks in (("faults", summary.faults), ("preemptions", summary.preemptions),
                         ("new rounds at a step boundary", summary.new_rounds)):
        listed = f" ({'; '.join(m.label for m in marks)})" if marks else ""
        lines.append(f"{title}: {len(marks)}{listed}")
    if summary.agent_events is not None:  # without the agents' events, nothing to say
        listed = "; ".join(f"t={s.time - t0:.1f}s {s.label}" for s in summary.stragglers)
        lines.append(f"stragglers: {len(summary.stragglers)}"
                     + (f" ({listed})" if listed else ""))
    lines.append(f"steps trained twice: {summary.steps_redone} (redone after a restore)")
    parts = [] if summary.startup_s is None else [f"start-up {summary.startup_s:.1f}s"]
    if summary.gaps_s:
        parts.append("gaps between rounds " + " + ".join(f"{g:.1f}s" for g in summary.gaps_s))
    lines.append(f"time not training: {summary.not_training_s:.1f}s"
                 + (f" ({', '.join(parts)})" if parts else ""))
    lines.append(f"total run time: {summary.total_s:.1f}s")
    if summary.ignored:
        lines.append(f"ignored: {summary.ignored} event(s) logged before the first start")
    if summary.agent_events_ignored:
        lines.append(f"ignored: {summary.agent_events_ignored} straggler event(s) outside the "
                     "run's time (another run's, in the same events file?)")
    if unreadable:
        lines.append(f"skipped: {len(unreadable)} line(s) that are not JSON (torn by a crash?): "
                     + ", ".join(map(str, unreadable[:10])) + (" ..." if len(unreadable) > 10
                                                                else ""))
    return "\n".join(lines) + "\n"


def picture(summary: RunSummary, metrics: Path, path: Path, dpi: int = 100) -> Path:
    """The timeline PNG; :class:`~elastic_ext.ops.timeline.MissingMatplotlib` without matplotlib."""
    state = (f"done at step {summary.final_step}" if summary.finished
             else f"not finished (step {summary.last_step})")
    title = (f"{metrics.name}: {summary.rounds} round(s), {state}, {summary.steps_redone} "
             f"step(s) trained twice, {summary.not_training_s:.1f}s of {summary.total_s:.1f}s "
             "not training")
    events = [e for seg in summary.segments for e in seg.events]
    return draw(path, title=title, xlabel="seconds since the first start event",
                segments=summary.segments, events=events, marks=summary.marks(),
                t0=summary.started, end=summary.total_s, dpi=dpi, extra="report")


# -------------------------------------------------------------------------------- run
def run(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    out = out or sys.stdout
    err = err or sys.stderr
    try:
        events, unreadable = read_events(args.metrics)
        summary = summarize(events)
        if args.events:
            summary = with_agent_events(summary, read_agent_events(args.events))
    except RunLogError as exc:
        err.write(f"elastic-ext report: {exc}\n")
        return EXIT_BAD_INPUT
    data = as_data(summary, args.metrics, unreadable)
    out.write(json.dumps(data, indent=2) + "\n" if args.json
              else as_text(summary, args.metrics, unreadable))
    if args.out is None:
        return EXIT_OK
    # with --json, standard output is the JSON alone
    notes = err if args.json else out
    written = [args.out / "report.json"]
    try:
        args.out.mkdir(parents=True, exist_ok=True)
        written[0].write_text(json.dumps(data, indent=2) + "\n")
        written.append(picture(summary, args.metrics, args.out / "report.png", args.dpi))
    except MissingMatplotlib as exc:
        notes.write(f"report: {written[0]}; no report.png: {exc}\n")
        return EXIT_NO_PICTURE
    except OSError as exc:
        err.write(f"elastic-ext report: cannot write to {args.out}: {exc.strerror or exc}\n")
        return EXIT_BAD_INPUT
    notes.write("report: " + ", ".join(map(str, written)) + "\n")
    return EXIT_OK
