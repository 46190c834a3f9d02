"""The report of a chaos run: a JSON summary and a PNG timeline.

The summary is built by a pure function (:func:`summary`) so it can be tested and
reused; the timeline is drawn by :mod:`elastic_ext.timeline` (the same picture as
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
from elastic_ext.runlog import Mark
from elastic_ext.timeline import MissingMatplotlib, draw

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
