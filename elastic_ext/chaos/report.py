"""The report of a chaos run: a JSON summary and a PNG timeline.

The summary is built by a pure function (:func:`summary`) so it can be tested and
reused; the timeline needs matplotlib, an optional dependency (``pip install
elastic-ext[chaos]``), imported only when a picture is asked for. It uses
matplotlib's object API with the Agg canvas, never ``pyplot``, so drawing changes no
global state of the caller.

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

from elastic_ext.chaos.invariants import Event, FaultRecord, Restart, Segment
from elastic_ext.chaos.runner import RunResult

logger = logging.getLogger(__name__)

RATE_WINDOW = 1.0  # seconds per bin of the step-rate curve


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


def step_rate(times: Sequence[float],
              window: float = RATE_WINDOW) -> tuple[list[float], list[float]]:
    """Steps per second in consecutive windows: ``(window centres, rates)``; pure."""
    if not times:
        return [], []
    start, end = min(times), max(times)
    bins = max(1, int((end - start) // window) + 1)
    counts = [0] * bins
    for t in times:
        counts[min(bins - 1, int((t - start) // window))] += 1
    centres = [start + (i + 0.5) * window for i in range(bins)]
    return centres, [c / window for c in counts]


def _markers(faults: Sequence[FaultRecord],
             restarts: Sequence[Restart]) -> list[tuple[float, str, str]]:
    """``(time, label, kind)`` for each vertical line: fault, restore or recovery."""
    marks = [(f.time, f.description, "restore" if f.restore else "fault") for f in faults]
    marks += [(r.recovered_at, f"recovered: world {r.world_after}, from step {r.resumed_from}",
               "recovery")
              for r in restarts if r.recovered_at is not None]
    return sorted(marks)


def plot_timeline(result: RunResult, path: Path) -> Path:
    """Draw the timeline PNG; :class:`ReportError` when matplotlib is not installed."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ReportError("the timeline needs matplotlib: "
                          "pip install 'elastic-ext[chaos]'") from exc
    verdict, obs = result.verdict, result.observation
    if verdict is None or obs is None:
        raise ReportError(f"{result.scenario.name} did not run: {result.skipped}")
    t0 = result.started
    steps: list[Event] = [e for e in obs.events if e.get("event") == "step"]
    times = [float(e["time"]) - t0 for e in steps]

    figure = Figure(figsize=(11, 7.5), dpi=110, layout="constrained")
    FigureCanvasAgg(figure)
    world_ax, rate_ax, loss_ax = figure.subplots(3, 1, sharex=True, height_ratios=[1, 1, 1.2])
    verdict_text = "PASS" if verdict.ok else f"FAIL ({len(verdict.violations)} broken)"
    figure.suptitle(f"chaos scenario '{result.scenario.name}': {verdict_text}; lost steps "
                    f"{verdict.lost_steps}; params {verdict.params_check}", fontsize=11)

    _draw_world(world_ax, verdict.segments, t0, result.ended - t0)
    centres, rates = step_rate(times)
    rate_ax.step(centres, rates, where="mid", color="tab:blue", linewidth=1.2)
    rate_ax.set_ylabel("steps / s")
    rate_ax.set_ylim(bottom=0)
    losses = [(float(e["time"]) - t0, float(e["loss"])) for e in steps if e.get("loss") is not None]
    if losses:
        loss_ax.plot([t for t, _ in losses], [v for _, v in losses], ".", markersize=2.5,
                     color="tab:purple")
        if all(v > 0 for _, v in losses):
            loss_ax.set_yscale("log")
    loss_ax.set_ylabel("loss")
    loss_ax.set_xlabel("seconds since the harness started")

    colours = {"fault": "tab:red", "restore": "tab:gray", "recovery": "tab:green"}
    styles = {"fault": "--", "restore": ":", "recovery": "-"}
    seen: set[str] = set()
    for when, label, kind in _markers(obs.faults, verdict.restarts):
        x = when - t0
        for ax in (world_ax, rate_ax, loss_ax):
            ax.axvline(x, color=colours[kind], linestyle=styles[kind], linewidth=1.1, alpha=0.85,
                       label=kind if (kind not in seen and ax is world_ax) else None)
        seen.add(kind)
        world_ax.annotate(label, (x, 1.0), xycoords=("data", "axes fraction"), xytext=(2, -2),
                          textcoords="offset points", rotation=90, va="top", ha="left", fontsize=7,
                          color=colours[kind])
    world_ax.legend(loc="lower left", fontsize=8, ncols=3)
    for ax in (world_ax, rate_ax, loss_ax):
        ax.grid(alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    return path


def _draw_world(ax: Any, segments: Sequence[Segment], t0: float, end: float) -> None:
    """World size as a step line: the size of each round from its start, 0 between rounds."""
    xs: list[float] = [0.0]
    ys: list[int] = [0]
    for seg in segments:
        xs.append(seg.start_time - t0)
        ys.append(seg.world_size)
        if seg.step_times:
            xs.append(seg.step_times[-1] - t0)
            ys.append(seg.world_size)
        xs.append((seg.step_times[-1] if seg.step_times else seg.start_time) - t0)
        ys.append(0)
    xs.append(end)
    ys.append(0)
    ax.step(xs, ys, where="post", color="tab:orange", linewidth=1.6)
    top = max(ys) if ys else 1
    ax.set_ylim(-0.1, top + 1.5)
    ax.set_yticks(range(top + 1))
    ax.set_ylabel("world size")


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
