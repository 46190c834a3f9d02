"""The report of a chaos run: a JSON summary and a PNG timeline.

The summary is built by a pure function (:func:`summary`) so it can be tested and
reused; the timeline is drawn by :mod:`elastic_ext.ops.timeline` (the same picture as
``elastic-ext report``), which needs matplotlib, an optional dependency (``pip install
elastic-ext[chaos]``), imported only when a picture is asked for.

The timeline has time on x (seconds since the harness started) and three panels:
world size, step rate and loss, with a vertical line for every injected fault (red),
every fault that ended (grey) and every recovery, i.e. the first step of a new round
(green).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from elastic_ext.chaos.invariants import FaultRecord, Restart
from elastic_ext.chaos.runner import RunResult
from elastic_ext.chaos.soak import SoakResult, fault_lines, summary_lines
from elastic_ext.ops.runlog import Mark
from elastic_ext.ops.timeline import MissingMatplotlib, draw

logger = logging.getLogger(__name__)


class ReportError(RuntimeError):
    """The report could not be drawn (matplotlib missing)."""


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def summary(result: RunResult) -> dict[str, Any]:
    """Everything worth keeping about a run, as JSON-ready data; times are relative to its start."""
    t0 = result.started
    scenario = result.scenario
    out: dict[str, Any] = {
        "scenario": scenario.name,
        "text": scenario.text,
        "settings": asdict(scenario.settings),
        "network": scenario.network,
        "result": "skipped" if result.skipped else "pass" if result.ok else "fail",
        "skipped": result.skipped,
        "duration_s": _round(result.ended - result.started, 1),
        "workdir": str(result.workdir),
        "logs": {name: str(path) for name, path in result.logs.items()},
    }
    verdict, obs = result.verdict, result.observation
    if verdict is None or obs is None:
        return out

    def rel(t: float | None) -> float | None:
        return None if t is None else _round(t - t0)

    out.update({
        "violations": [{"invariant": v.invariant, "message": v.message}
                       for v in verdict.violations],
        "faults": [{"t": rel(f.time), "description": f.description, "verb": f.verb,
                    "detail": f.detail, "crash": f.crash, "restore": f.restore}
                   for f in obs.faults],
        "rounds": [{"t": rel(s.start_time), "world_size": s.world_size,
                    "resumed_from": s.resumed_from, "first_step": s.steps[0] if s.steps else None,
                    "last_step": s.last_step, "end": s.end}
                   for s in verdict.segments],
        "restarts": [{"t": rel(r.time), "recovered_t": rel(r.recovered_at),
                      "downtime_s": _round(r.downtime), "world_before": r.world_before,
                      "world_after": r.world_after, "last_step": r.last_step,
                      "resumed_from": r.resumed_from, "lost_steps": r.lost,
                      "after_crash": r.crash_allowed}
                     for r in verdict.restarts],
        "lost_steps": verdict.lost_steps,
        "final_step": verdict.final_step,
        "steps": obs.steps,
        "params_check": verdict.params_check,
        "final_params_sha256": verdict.final_sha,
        "reference_params_sha256": obs.reference_sha,
        "snapshots_seen": [{"step": step, "t": rel(when)} for step, when in obs.snapshots_seen],
        "nodes": [asdict(n) for n in obs.nodes],
        "leftovers": list(obs.leftovers),
        "bound_ports": list(obs.bound_ports),
    })
    return out


def write_json(result: RunResult, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary(result), indent=2, default=str) + "\n")
    return path


def _markers(faults: Sequence[FaultRecord], restarts: Sequence[Restart]) -> list[Mark]:
    """One vertical line per fault, restore (a fault undone) or recovery."""
    marks = [Mark(f.time, f.description, "restore" if f.restore else "fault") for f in faults]
    marks += [Mark(r.recovered_at, f"recovered: world {r.world_after}, from step {r.resumed_from}",
                   "recovery")
              for r in restarts if r.recovered_at is not None]
    return sorted(marks, key=lambda m: (m.time, m.label, m.kind))


def plot_timeline(result: RunResult, path: Path) -> Path:
    """Draw the timeline PNG; :class:`ReportError` when matplotlib is not installed."""
    verdict, obs = result.verdict, result.observation
    if verdict is None or obs is None:
        raise ReportError(f"{result.scenario.name} did not run: {result.skipped}")
    verdict_text = "PASS" if verdict.ok else f"FAIL ({len(verdict.violations)} broken)"
    title = (f"chaos scenario '{result.scenario.name}': {verdict_text}; lost steps "
             f"{verdict.lost_steps}; params {verdict.params_check}")
    try:
        return draw(path, title=title, xlabel="seconds since the harness started",
                    segments=verdict.segments, events=obs.events,
                    marks=_markers(obs.faults, verdict.restarts), t0=result.started,
                    end=result.ended - result.started, extra="chaos")
    except MissingMatplotlib as exc:
        raise ReportError(str(exc)) from exc


def write_report(result: RunResult, directory: Path) -> dict[str, Path]:
    """``NAME.json`` and (when matplotlib is there) ``NAME.png`` in ``directory``."""
    written = {"json": write_json(result, directory / f"{result.scenario.name}.json")}
    if result.verdict is not None:
        try:
            written["png"] = plot_timeline(result, directory / f"{result.scenario.name}.png")
        except ReportError as exc:
            logger.warning("%s", exc)
    return written


def summaries(results: Sequence[RunResult]) -> Mapping[str, Any]:
    """The index of a report directory with several scenarios."""
    return {"scenarios": [{"scenario": r.scenario.name,
                           "result": "skipped" if r.skipped else "pass" if r.ok else "fail",
                           "duration_s": _round(r.ended - r.started, 1),
                           "violations": [str(v) for v in
                                          (r.verdict.violations if r.verdict else ())]}
                          for r in results]}


# ---------------------------------------------------------------------------------- soak
def soak_summary(result: SoakResult) -> dict[str, Any]:
    """A soak's own report: the schedule, one entry per fault, the summary numbers."""
    plan, stats, t0 = result.soak, result.stats, result.run.started
    return {
        "scenario": plan.scenario.name,
        "result": "skipped" if result.skipped else "pass" if result.ok else "fail",
        "seed": plan.seed,
        "duration_s": plan.duration_s,
        "every_s": list(plan.every),
        "nodes": plan.nodes,
        "kinds": list(plan.kinds),
        "recovery_bound_s": plan.recovery_bound_s,
        "replay": plan.replay_command(),
        "run_s": _round(result.run.ended - result.run.started, 1),
        "faults": [{"number": o.number, "kind": o.kind, "description": o.description,
                    "detail": o.detail, "t": None if o.time is None else _round(o.time - t0),
                    "recover_s": _round(o.recover_s), "restarts": o.restarts,
                    "lost_steps": o.lost}
                   for o in result.outcomes],
        "summary": {"planned": stats.planned, "fired": stats.fired,
                    "by_kind": dict(stats.by_kind), "recovered": stats.recovered,
                    "median_recover_s": stats.median_recover_s,
                    "worst_recover_s": stats.worst_recover_s, "lost_steps": stats.lost_steps,
                    "longest_stall_s": _round(result.longest_stall_s, 1)},
        "violations": [{"invariant": v.invariant, "message": v.message}
                       for v in result.all_violations],
    }


def _soak_markers(result: SoakResult) -> list[Mark]:
    """A soak has dozens of faults: each is labelled by its number and kind (the per-fault
    lines say the rest); what restores the shape and each recovery are unlabelled lines."""
    obs, verdict = result.run.observation, result.run.verdict
    assert obs is not None and verdict is not None
    fired = {o.time for o in result.outcomes if o.time is not None}
    marks = [Mark(o.time, f"{o.number} {o.kind}", "fault")
             for o in result.outcomes if o.time is not None]
    marks += [Mark(f.time, "", "restore") for f in obs.faults if f.time not in fired]
    marks += [Mark(r.recovered_at, "", "recovery")
              for r in verdict.restarts if r.recovered_at is not None]
    return sorted(marks, key=lambda m: (m.time, m.label, m.kind))


def plot_soak_timeline(result: SoakResult, path: Path) -> Path:
    """The soak's timeline PNG; :class:`ReportError` when matplotlib is not installed."""
    run, stats = result.run, result.stats
    if run.verdict is None or run.observation is None:
        raise ReportError(f"{run.scenario.name} did not run: {run.skipped}")
    verdict_text = "PASS" if result.ok else f"FAIL ({len(result.all_violations)} broken)"
    worst = f", worst recovery {stats.worst_recover_s:g}s" if stats.worst_recover_s else ""
    title = (f"chaos soak, seed {result.soak.seed}: {verdict_text}; {stats.fired} faults"
             f"{worst}; lost steps {run.verdict.lost_steps}; params {run.verdict.params_check}")
    try:
        return draw(path, title=title, xlabel="seconds since the harness started",
                    segments=run.verdict.segments, events=run.observation.events,
                    marks=_soak_markers(result), t0=run.started, end=run.ended - run.started,
                    extra="chaos")
    except MissingMatplotlib as exc:
        raise ReportError(str(exc)) from exc


def write_soak_report(result: SoakResult, directory: Path) -> dict[str, Path]:
    """``NAME.json`` (the run's summary, as for any scenario), ``NAME.png`` (the timeline,
    faults numbered), ``NAME-soak.json``, ``NAME-soak.txt`` (one line per fault and the
    summary) and ``NAME.scn`` (the schedule, to replay)."""
    name = result.soak.scenario.name
    written = {"json": write_json(result.run, directory / f"{name}.json")}
    if result.run.verdict is not None:
        try:
            written["png"] = plot_soak_timeline(result, directory / f"{name}.png")
        except ReportError as exc:
            logger.warning("%s", exc)
    data = directory / f"{name}-soak.json"
    data.write_text(json.dumps(soak_summary(result), indent=2) + "\n")
    written["soak"] = data
    text = directory / f"{name}-soak.txt"
    text.write_text("\n".join([*fault_lines(result), *summary_lines(result),
                               *(f"- {v}" for v in result.all_violations)]) + "\n")
    written["lines"] = text
    schedule = directory / f"{name}.scn"
    schedule.write_text(result.soak.text)
    written["schedule"] = schedule
    return written
