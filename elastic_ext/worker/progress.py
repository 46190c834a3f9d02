"""A worker's beacon: its step progress and where its main thread is, for its agent's hang
judge (``rendezvous/protocol/hang.py``).

A worker process lives for one round (torchrun restarts the workers at every round), so
its count of step boundaries is its round's. The training thread only updates two numbers
per step (no I/O on the step's path); a
daemon thread writes them with the main thread's innermost Python frame to
``beat-<LOCAL_RANK>`` in the control directory every ``BEAT_S``. That the thread writes
at all is itself a signal: a process stopped, or whose GIL is held by a deadlocked
thread, stops beating, while a rank blocked in a collective (which releases the GIL)
beats on. Only under an etcd-ext agent (``ELASTIC_EXT_CONTROL_DIR``); otherwise inert.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from elastic_ext.control_channel import BEAT, CONTROL_DIR_ENV, atomic_write
from elastic_ext.worker import control

logger = logging.getLogger(__name__)

BEAT_S = 0.25
"""How often the beacon thread writes."""

RECENT_STEPS = 20
"""Step times the median is taken over."""

_IN_COLLECTIVE = (f"{os.sep}torch{os.sep}distributed{os.sep}",
                  f"{os.sep}torch{os.sep}autograd{os.sep}",
                  f"{os.sep}torch{os.sep}nn{os.sep}parallel{os.sep}")
"""Where a main thread waits when it waits for its peers: a collective, or the backward
pass whose gradient hooks wait for DDP's or FSDP's reductions."""


class ProgressBeacon:
    """Tells the agent, from a daemon thread, how far this worker got and where it is."""

    def __init__(self, directory: Path, local_rank: int, *, interval: float = BEAT_S) -> None:
        self._path = directory / f"{BEAT}{local_rank}"
        self._interval = interval
        self._lock = threading.Lock()
        self._step = 0  # the boundaries this process passed: its round's steps
        self._round = control.current_round()
        self._last_at: float | None = None
        self._times: deque[float] = deque(maxlen=RECENT_STEPS)
        self._paused = 0
        self._pause_began = 0.0
        self._stopped = threading.Event()
        self._write_lock = threading.Lock()  # one writer of the file at a time
        self._main = threading.main_thread().ident
        self._thread = threading.Thread(target=self._run, name="etcd-ext-beacon", daemon=True)

    @classmethod
    def for_this_worker(cls) -> ProgressBeacon | None:
        """The beacon of a worker an etcd-ext agent started (None under any other)."""
        path = os.environ.get(CONTROL_DIR_ENV)
        if not path or not Path(path).is_dir():
            return None
        beacon = cls(Path(path), int(os.environ.get("LOCAL_RANK", "0")))
        beacon._thread.start()
        return beacon

    def step(self) -> None:
        """One more step is complete (the caller's boundary: the device finished it)."""
        now = time.monotonic()
        with self._lock:
            if self._last_at is not None:
                self._times.append(now - self._last_at)
            self._step, self._last_at = self._step + 1, now

    def pause(self) -> None:
        """A known long pause begins (evaluation, a synchronous save): not a hang, and not
        part of the step's time. Pauses nest."""
        with self._lock:
            if self._paused == 0:
                self._pause_began = time.monotonic()
            self._paused += 1

    def resume(self) -> None:
        """The pause ends: the step's clock starts again where it stood."""
        with self._lock:
            if self._paused == 0:
                return
            self._paused -= 1
            if self._paused == 0 and self._last_at is not None:
                self._last_at += time.monotonic() - self._pause_began

    @contextmanager
    def paused(self) -> Iterator[None]:
        self.pause()
        try:
            yield
        finally:
            self.resume()

    def close(self) -> None:
        """This worker leaves (it commits or holds, then exits): no more steps, so its last
        word, written now and not at the next beat (the process may end first), is that
        it is paused, and its silence after that blames nobody."""
        with self._write_lock:  # after the thread's last write, never before it
            self._stopped.set()
            with self._lock:
                self._paused += 1
            try:
                atomic_write(self._path, json.dumps(self._record()))
            except OSError:
                pass

    def _record(self) -> dict[str, object]:
        frame = sys._current_frames().get(self._main) if self._main is not None else None
        where, waiting = "", False
        if frame is not None:
            code = frame.f_code
            where = f"{code.co_filename}:{frame.f_lineno} {code.co_name}"
            waiting = any(part in code.co_filename for part in _IN_COLLECTIVE)
        with self._lock:
            record: dict[str, object] = {
                "pid": os.getpid(), "round": self._round, "step": self._step,
                "steps_in_round": self._step,
                "step_s": statistics.median(self._times) if self._times else None,
                "paused": self._paused > 0, "waiting": waiting, "where": where,
                "backend": _backend(), "at": time.time()}
        return record

    def _run(self) -> None:
        while not self._stopped.wait(self._interval):
            try:
                with self._write_lock:
                    if self._stopped.is_set():
                        return
                    atomic_write(self._path, json.dumps(self._record()))
            except OSError:  # the agent removed its directory: it is leaving
                return
            except Exception:  # never let the beacon take the worker down
                logger.debug("beacon write failed", exc_info=True)


def _backend() -> str:
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return str(dist.get_backend()).lower()
    except Exception:  # a group being torn down
        return ""
    return ""
