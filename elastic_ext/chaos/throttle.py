"""A slow machine, made on this one: a node's workers stopped and continued in a duty cycle.

A straggler is a node that trains, only slower than the others (a throttled CPU, a GPU
that clocks down, a noisy neighbour). SIGSTOP and SIGCONT on a fixed period give one
that any process shows: the workers run ``fraction`` of every ``period`` and are stopped
for the rest, so their compute takes about ``1 / fraction`` as long. Only the workers are
throttled, never the agent: its heartbeats stay on time, as a slow machine's would.

The period should be short against a step's compute: a computation shorter than the run
window mostly fits in it, and only the steps' sum slows down, not each step's own time.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable

logger = logging.getLogger(__name__)

DEFAULT_FRACTION = 1 / 3
DEFAULT_PERIOD_S = 0.03
REFRESH_S = 1.0
"""How often the cycle looks the workers up again: a round restarted them (new pids)."""


def _signal(pids: Iterable[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


class DutyCycle:
    """Runs the processes ``pids_of()`` names for ``fraction`` of every ``period`` seconds
    and stops them for the rest, from a daemon thread, until ``stop``. ``pids_of`` is asked
    again every ``refresh`` seconds (while the processes run), so that workers a restart
    replaced are throttled too."""

    def __init__(self, pids_of: Callable[[], list[int]], *,
                 fraction: float = DEFAULT_FRACTION, period: float = DEFAULT_PERIOD_S,
                 refresh: float = REFRESH_S, name: str = "slow") -> None:
        if not 0 < fraction < 1:
            raise ValueError(f"run fraction {fraction} must be between 0 and 1")
        if not period > 0:
            raise ValueError(f"period {period} must be more than 0")
        self._pids_of = pids_of
        self.fraction = fraction
        self.period = period
        self._refresh = refresh
        self._halt = threading.Event()
        self._lock = threading.Lock()
        self._touched: set[int] = set()  # every pid ever stopped: each is continued at the end
        self.cycles = 0
        self._thread = threading.Thread(target=self._run, name=f"chaos-{name}", daemon=True)

    def start(self) -> DutyCycle:
        self._thread.start()
        return self

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def pids(self) -> set[int]:
        """Every process the cycle stopped at least once."""
        with self._lock:
            return set(self._touched)

    def stop(self, timeout: float = 5.0) -> int:
        """End the cycle and SIGCONT every process it ever stopped; returns the cycles run."""
        self._halt.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        with self._lock:
            _signal(self._touched, signal.SIGCONT)
        return self.cycles

    def _run(self) -> None:
        run_s = self.fraction * self.period
        pids: list[int] = []
        looked_at = -float("inf")
        start = time.monotonic()
        try:
            while not self._halt.is_set():
                now = time.monotonic()
                if now - looked_at >= self._refresh:
                    pids, looked_at = self._pids_of(), now
                # Phase boundaries on a fixed grid: a late wake-up shortens the phase it ends
                # instead of drifting the fraction.
                cycle_at = start + (self.cycles * self.period)
                if now > cycle_at + self.period:  # far behind (a starved machine): catch up
                    self.cycles = int((now - start) // self.period)
                    cycle_at = start + self.cycles * self.period
                if self._halt.wait(max(0.0, cycle_at + run_s - time.monotonic())):
                    break
                with self._lock:
                    self._touched.update(pids)
                    _signal(pids, signal.SIGSTOP)
                try:
                    self._halt.wait(max(0.0, cycle_at + self.period - time.monotonic()))
                finally:
                    _signal(pids, signal.SIGCONT)
                self.cycles += 1
        except Exception:  # noqa: BLE001 - a thread's error would vanish; the workers must run
            logger.exception("the duty cycle failed; its processes run on at full speed")
        finally:
            with self._lock:
                _signal(self._touched, signal.SIGCONT)
