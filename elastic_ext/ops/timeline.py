"""The timeline picture of a run: world size, steps/s and loss, with a line for every mark.

Shared by ``elastic-ext report`` and the chaos harness's report, so that both pictures
read the same. matplotlib is optional (``pip install 'elastic-ext[report]'``) and
imported only when a picture is drawn. The object API with the Agg canvas is used,
never ``pyplot``, so drawing changes no global state of the caller.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from elastic_ext.ops.runlog import Event, Mark, Segment, step_rate

logger = logging.getLogger(__name__)

# kind -> (colour, line style); the legend names the kind
STYLES: dict[str, tuple[str, str]] = {
    "fault": ("tab:red", "--"),        # a fault injected (chaos) or a round cut short
    "restore": ("tab:gray", ":"),      # an injected fault undone (chaos)
    "recovery": ("tab:green", "-"),    # the first step of a round, from its restored state
    "round": ("tab:blue", "-."),       # a round's start event
    "preempted": ("tab:purple", "--"),  # a round stopped on a signal at a step boundary
    "new-round": ("tab:olive", "--"),   # a round stopped at a step boundary for a new one
    "slow": ("tab:brown", ":"),         # an agent named a straggler (its events file)
}


class MissingMatplotlib(RuntimeError):
    """The picture needs matplotlib, an optional dependency."""

    def __init__(self, extra: str) -> None:
        super().__init__(f"the timeline needs matplotlib: pip install 'elastic-ext[{extra}]'")


def draw(path: Path, *, title: str, xlabel: str, segments: Sequence[Segment],
         events: Sequence[Event], marks: Sequence[Mark], t0: float, end: float,
         dpi: int = 110, extra: str = "report") -> Path:
    """Draw the PNG at ``path``; times are shifted by ``t0``, the x axis ends at ``end``.

    :class:`MissingMatplotlib` (naming the ``extra`` to install) without matplotlib.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise MissingMatplotlib(extra) from exc
    steps = [e for e in events if e.get("event") == "step"]
    times = [float(e["time"]) - t0 for e in steps]

    figure = Figure(figsize=(11, 7.5), dpi=dpi, layout="constrained")
    FigureCanvasAgg(figure)
    world_ax, rate_ax, loss_ax = figure.subplots(3, 1, sharex=True, height_ratios=[1, 1, 1.2])
    figure.suptitle(title, fontsize=11)

    _draw_world(world_ax, segments, t0, end)
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
    loss_ax.set_xlabel(xlabel)

    seen: set[str] = set()
    for mark in sorted(marks, key=lambda m: m.time):
        colour, style = STYLES[mark.kind]
        x = mark.time - t0
        for ax in (world_ax, rate_ax, loss_ax):
            ax.axvline(x, color=colour, linestyle=style, linewidth=1.1, alpha=0.85,
                       label=mark.kind if (mark.kind not in seen and ax is world_ax) else None)
        seen.add(mark.kind)
        if mark.label:
            world_ax.annotate(mark.label, (x, 1.0), xycoords=("data", "axes fraction"),
                              xytext=(2, -2), textcoords="offset points", rotation=90, va="top",
                              ha="left", fontsize=7, color=colour)
    if seen:
        world_ax.legend(loc="lower left", fontsize=8, ncols=len(seen))
    for ax in (world_ax, rate_ax, loss_ax):
        ax.grid(alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    logger.debug("timeline written to %s", path)
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
