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

Where the worker trains through DDP, the beacon also carries its *own* time per step: the
forward and backward compute DDP's reducer times (``torch_compat.ddp_own_seconds``),
without the wait for the other ranks, which is what tells a straggler apart when every
rank finishes its steps at the slowest one's pace (``rendezvous/protocol/pace.py``). The
DDP module is found by a global forward pre-hook, removed at the first step boundary.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel

from elastic_ext import torch_compat
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


class OwnTime:
    """This worker's own compute per step, from the DDP module its first step ran (none:
    no own time); read on the training thread at each step boundary."""

    def __init__(self) -> None:
        self._ddp: weakref.ref[DistributedDataParallel] | None = None
        self._hook: torch.utils.hooks.RemovableHandle | None = None
        self._iteration = -1
        self.times: deque[float] = deque(maxlen=RECENT_STEPS)

    def start_looking(self) -> None:
        """Watch every module's forward for a DDP one until the first step boundary."""
        if self._hook is None and self._ddp is None:
            self._hook = torch.nn.modules.module.register_module_forward_pre_hook(self._spot)

    def _spot(self, module: torch.nn.Module, args: object) -> None:
        if isinstance(module, DistributedDataParallel) and self._ddp is None:
            self._ddp = weakref.ref(module)
            torch_compat.time_every_ddp_step(module)
            self.stop_looking()

    def stop_looking(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def step(self) -> None:
        """A step boundary: the first ends the search for a DDP module (its forward ran by
        then, if there is one); then the last step DDP timed, if it is new."""
        self.stop_looking()
        ddp = self._ddp() if self._ddp is not None else None
        if ddp is None:
            return
        try:
            timed = torch_compat.ddp_own_seconds(ddp)
        except Exception:  # a torch that changed it (tests/test_torch_compat.py says)
            logger.debug("DDP's runtime stats unreadable: no own time", exc_info=True)
            self._ddp = None
            return
        if timed is not None and timed[0] != self._iteration:
            self._iteration = timed[0]
            self.times.append(timed[1])


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
        self._own = OwnTime()
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
        beacon._own.start_looking()
        beacon._thread.start()
        return beacon

    def step(self) -> None:
        """One more step is complete (the caller's boundary: the device finished it)."""
        now = time.monotonic()
        with self._lock:  # the beacon thread reads the own times under it too
            self._own.step()
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
            self._own.stop_looking()
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
                "own_s": statistics.median(own) if (own := tuple(self._own.times)) else None,
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
