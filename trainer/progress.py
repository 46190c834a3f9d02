"""Progress of the bundled trainer on stdout: one line every few seconds, or a bar on a terminal.

Global rank 0 owns an enabled :class:`Progress`; the training loop calls
:meth:`Progress.step` after every step, which costs one clock read unless a rate
sample or a line is due, so formatting and I/O never happen per step. Every worker
generation is a new process, so rates come from this generation's steps only, over
the last :data:`WINDOW_S` seconds: a restart or a slow start-up does not distort them.

The line (stable, one line, greppable by ``progress:``; ``--`` means not known yet)::

    progress: step 120/2000 (6.0%) loss 0.0123 | 18.5 steps/s 592 samples/s | world 2 |
    agent restarts 0 | snapshot 2.1s ago | ETA 1m41s

all on one line, with `` | EVENT`` appended to the lines that mark one: ``started``,
``resumed from step N`` (each the first line of a worker generation), ``preempted``
and ``done``. ``agent restarts`` is TORCHELASTIC_RESTART_COUNT: the worker-failure
restarts torch's agent on this node has done (membership changes are not counted).
``snapshot`` is ``Xs ago`` since the newest durable one, ``none yet`` or ``off``.

Everything but :class:`Progress`'s writes is pure and clock-injected, for fast tests.
"""

from __future__ import annotations

import io
import logging
import math
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TextIO

logger = logging.getLogger(__name__)

WINDOW_S = 30.0
"""Span of the rate window: recent enough to follow a world-size change within a minute."""

MAX_SAMPLE_S = 1.0
"""Rate samples (and bar refreshes) at most this far apart; more often for short intervals."""

UNKNOWN = "--"

FALLBACK_COLUMNS, FALLBACK_ROWS = 100, 24
"""The bar's size on a terminal that reports none."""

Style = Literal["bar", "lines"]
Clock = Callable[[], float]


class Bar(Protocol):
    """The part of ``tqdm.tqdm`` that :class:`Progress` uses (a fake one in tests)."""

    n: float

    def set_description_str(self, desc: str = "", refresh: bool = True) -> None: ...

    def refresh(self) -> None: ...

    def write(self, s: str, file: Any = None) -> None: ...

    def close(self) -> None: ...


BarFactory = Callable[[int, int, TextIO], Bar]
"""``(total, initial, stream) -> bar``."""


def format_duration(seconds: float) -> str:
    """``4.2s``, ``42s``, ``1m42s``, ``3h05m``, ``2d04h``: short, and fixed in shape."""
    if seconds < 10:
        return f"{max(0.0, seconds):.1f}s"
    whole = int(seconds)
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    if whole < 86400:
        return f"{whole // 3600}h{whole % 3600 // 60:02d}m"
    return f"{whole // 86400}d{whole % 86400 // 3600:02d}h"


def format_rate(value: float) -> str:
    """About three significant digits: ``0.0312``, ``18.5``, ``592``, ``12345``."""
    return f"{value:.0f}" if value >= 100 else f"{value:.3g}"


def eta_seconds(step: int, total: int, steps_per_s: float | None) -> float | None:
    """Seconds to ``total`` at ``steps_per_s``; None while the rate is unknown."""
    if step >= total:
        return 0.0
    if steps_per_s is None or steps_per_s <= 0:
        return None
    return (total - step) / steps_per_s


class RateWindow:
    """Steps per second over the samples of the last ``span_s`` seconds.

    The newest sample older than the span is kept as the anchor, so that steps slower
    than the span still get a rate; at most about ``span_s / sample interval`` samples.
    """

    def __init__(self, span_s: float = WINDOW_S) -> None:
        self.span_s = span_s
        self._samples: deque[tuple[float, int]] = deque()

    def add(self, t: float, step: int) -> None:
        self._samples.append((t, step))
        while len(self._samples) > 2 and self._samples[1][0] <= t - self.span_s:
            self._samples.popleft()

    def rate(self) -> float | None:
        """None until two samples a positive time apart."""
        if len(self._samples) < 2:
            return None
        (t0, s0), (t1, s1) = self._samples[0], self._samples[-1]
        return (s1 - s0) / (t1 - t0) if t1 > t0 else None


@dataclass(frozen=True)
class Status:
    """What one progress line or bar refresh shows."""

    step: int
    total: int
    loss: float | None
    steps_per_s: float | None
    global_batch_size: int
    world_size: int
    restarts: int
    snapshot_age_s: float | None
    snapshots_on: bool = True
    event: str = ""


def _fields(status: Status) -> dict[str, str]:
    rate = status.steps_per_s
    eta = eta_seconds(status.step, status.total, rate)
    if not status.snapshots_on:
        snapshot = "off"
    elif status.snapshot_age_s is None:
        snapshot = "none yet"
    else:
        snapshot = f"{format_duration(status.snapshot_age_s)} ago"
    return {
        "loss": f"loss {UNKNOWN if status.loss is None else f'{status.loss:.4g}'}",
        "rates": (f"{UNKNOWN} steps/s {UNKNOWN} samples/s" if rate is None else
                  f"{format_rate(rate)} steps/s "
                  f"{format_rate(rate * status.global_batch_size)} samples/s"),
        "world": f"world {status.world_size}",
        "restarts": f"agent restarts {status.restarts}",
        "snapshot": f"snapshot {snapshot}",
        "eta": f"ETA {UNKNOWN if eta is None else format_duration(eta)}",
    }


def format_line(status: Status) -> str:
    """The plain line; see the module docstring for its format."""
    pct = 100.0 * status.step / status.total if status.total > 0 else 100.0
    f = _fields(status)
    line = (f"progress: step {status.step}/{status.total} ({pct:.1f}%) {f['loss']} | "
            f"{f['rates']} | {f['world']} | {f['restarts']} | {f['snapshot']} | {f['eta']}")
    return f"{line} | {status.event}" if status.event else line


def format_bar_stats(status: Status) -> str:
    """The text right of the bar: the same fields, most wanted first, since a narrow
    terminal cuts the end."""
    f = _fields(status)
    return " | ".join([f["eta"], f["rates"], f["loss"], f["world"], f["restarts"],
                       f["snapshot"]])


def choose_style(stream: Any, have_tqdm: bool) -> Style:
    """A bar only on a terminal and with tqdm installed: files, pipes, ``--tee``,
    ``--redirects`` and SLURM output files get plain lines, which grep and tail well."""
    try:
        tty = bool(stream.isatty())
    except (AttributeError, ValueError, OSError):  # no isatty, or a closed stream
        tty = False
    return "bar" if tty and have_tqdm else "lines"


def tqdm_bar_factory() -> BarFactory | None:
    """A factory of tqdm bars, or None without tqdm (the ``progress`` extra)."""
    try:
        from tqdm import tqdm
    except ImportError:
        return None

    def make(total: int, initial: int, stream: TextIO) -> Bar:
        # A terminal that reports no size (a fresh pty: script, docker exec -t) makes tqdm
        # draw nothing at all (it takes the bar for hidden), so fall back to a fixed size.
        sized = terminal_size(stream) is not None
        bar: Bar = tqdm(total=total, initial=initial, file=stream, mininterval=0, leave=True,
                        dynamic_ncols=sized, ncols=None if sized else FALLBACK_COLUMNS,
                        nrows=None if sized else FALLBACK_ROWS,
                        bar_format="{n_fmt}/{total_fmt} {percentage:3.0f}%|{bar:24}| {desc}")
        return bar
    return make


def terminal_size(stream: Any) -> tuple[int, int] | None:
    """(columns, rows) of the terminal behind ``stream``; None when it has none or says 0."""
    try:
        size = os.get_terminal_size(stream.fileno())
    except (AttributeError, ValueError, OSError):
        return None
    return (size.columns, size.lines) if size.columns > 0 and size.lines > 0 else None


class Progress:
    """Rank 0's progress output; the disabled one (other ranks, ``--progress-every 0``)
    does nothing.

    ``step`` runs on the training thread; ``snapshot_durable`` may run on the snapshot
    writer's thread (it only stores a float). A write that fails (a closed pipe) turns
    progress off with one warning: it must never stop training.
    """

    def __init__(self, *, total: int, global_batch_size: int, world_size: int, restarts: int,
                 every_s: float, stream: TextIO, style: Style = "lines",
                 bar_factory: BarFactory | None = None, snapshots_on: bool = True,
                 clock: Clock = time.monotonic, window_s: float = WINDOW_S,
                 enabled: bool = True) -> None:
        if style == "bar" and bar_factory is None:
            raise ValueError("a bar needs a bar factory")
        self.enabled = enabled and every_s > 0
        self.style: Style = style
        self._total = total
        self._batch = global_batch_size
        self._world = world_size
        self._restarts = restarts
        self._every = every_s
        self._sample_every = min(MAX_SAMPLE_S, every_s / 4)
        self._stream = stream
        self._bar_factory = bar_factory
        self._bar: Bar | None = None
        self._snapshots_on = snapshots_on
        self._clock = clock
        self._window = RateWindow(window_s)
        self._step = 0
        self._loss: float | None = None
        self._snapshot_at: float | None = None
        self._next_sample = -math.inf
        self._next_line = math.inf
        self._next_check = math.inf

    @classmethod
    def off(cls) -> Progress:
        return cls(total=0, global_batch_size=1, world_size=1, restarts=0, every_s=0,
                   stream=io.StringIO(), enabled=False)

    # -- what the loop calls
    def start(self, step: int, resumed_from: int | None, snapshot_age_s: float | None) -> None:
        """The first line of a worker generation (so also of every world size)."""
        if not self.enabled:
            return
        now = self._clock()
        self._step = step
        if snapshot_age_s is not None:
            self._snapshot_at = now - snapshot_age_s
        event = "started" if resumed_from is None else f"resumed from step {resumed_from}"
        self._emit(self._status(now, event))
        if self.style == "bar" and self.enabled:
            assert self._bar_factory is not None
            try:
                self._bar = self._bar_factory(self._total, step, self._stream)
            except (OSError, ValueError) as exc:
                self._fail(exc)
                return
        self._next_line = now + self._every if self.style == "lines" else math.inf
        self._next_check = min(self._next_sample, self._next_line)

    def step(self, step: int, loss: float) -> None:
        """After every step: a clock read, and rarely a sample, a bar refresh or a line."""
        if not self.enabled:
            return
        self._step = step
        self._loss = loss
        now = self._clock()
        if now >= self._next_check:
            self._due(now)

    def snapshot_durable(self) -> None:
        """A snapshot just became durable (any thread)."""
        self._snapshot_at = self._clock()

    def finish(self, event: str) -> None:
        """The last line of this generation (``done``, ``preempted``, ``stopped``); closes
        the bar."""
        if not self.enabled:
            return
        now = self._clock()
        self._window.add(now, self._step)
        status = self._status(now, event)
        self._refresh_bar(status)
        self.close()
        self._emit(status)
        self.enabled = False

    def close(self) -> None:
        """Leave the terminal on a fresh line (a bar left open would swallow the next
        output's start); idempotent."""
        bar, self._bar = self._bar, None
        if bar is not None:
            try:
                bar.close()
            except (OSError, ValueError) as exc:
                self._fail(exc)

    # -- inside
    def _due(self, now: float) -> None:
        line_due = now >= self._next_line
        if now >= self._next_sample or line_due:
            self._window.add(now, self._step)
            self._next_sample = now + self._sample_every
            if self._bar is not None:
                self._refresh_bar(self._status(now, ""))
        if line_due:
            self._emit(self._status(now, ""))
            # a steady cadence; after a long stall, one line and a fresh start, not a burst
            following = self._next_line + self._every
            self._next_line = following if following > now else now + self._every
        self._next_check = min(self._next_sample, self._next_line)

    def _status(self, now: float, event: str) -> Status:
        age = None if self._snapshot_at is None else max(0.0, now - self._snapshot_at)
        return Status(step=self._step, total=self._total, loss=self._loss,
                      steps_per_s=self._window.rate(), global_batch_size=self._batch,
                      world_size=self._world, restarts=self._restarts, snapshot_age_s=age,
                      snapshots_on=self._snapshots_on, event=event)

    def _refresh_bar(self, status: Status) -> None:
        if self._bar is None:
            return
        try:
            self._bar.n = status.step
            self._bar.set_description_str(format_bar_stats(status), refresh=False)
            self._bar.refresh()
        except (OSError, ValueError) as exc:
            self._fail(exc)

    def _emit(self, status: Status) -> None:
        if not self.enabled:
            return
        line = format_line(status)
        try:
            if self._bar is not None:
                self._bar.write(line, file=self._stream)  # above the bar, which is redrawn
            else:
                self._stream.write(line + "\n")
            self._stream.flush()  # a file or pipe is block-buffered: show the line now
        except (OSError, ValueError) as exc:
            self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        logger.warning("progress output off: writing to %s failed (%s)",
                       getattr(self._stream, "name", "stdout"), exc)
        self.enabled = False
        self._bar = None
        self._next_check = math.inf


def open_progress(*, rank: int, every_s: float, total: int, global_batch_size: int,
                  world_size: int, restarts: int, snapshots_on: bool,
                  stream: TextIO) -> Progress:
    """Rank 0's progress on ``stream`` (a bar on a terminal with tqdm), an off one elsewhere."""
    if rank != 0 or every_s <= 0:
        return Progress.off()
    # tqdm is imported for a terminal only; the bar needs it, else plain lines
    factory = tqdm_bar_factory() if choose_style(stream, have_tqdm=True) == "bar" else None
    return Progress(total=total, global_batch_size=global_batch_size, world_size=world_size,
                    restarts=restarts, every_s=every_s, stream=stream,
                    style="lines" if factory is None else "bar", bar_factory=factory,
                    snapshots_on=snapshots_on)
