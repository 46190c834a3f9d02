"""Which completed step the training state holds: what a worker that must leave mid-step
may keep in node memory for the next workers.

On the CPU (gloo) an update is done when ``optimizer.step()`` returns, and the rule is
simple: the state holds step N+1 once that returns, and nothing while it runs (the
lock keeps a keep from another thread out of a half-applied update).

On a GPU (NCCL) ``optimizer.step()`` only queues the update behind the gradients'
all-reduce. If a peer dies, NCCL's watchdog aborts the communicator and the queued
update then runs on partly reduced gradients. So a step counts as held only when the
device finished it with a healthy communicator: a marker (a CUDA event) is recorded
before and after each update, and the step is confirmed when the host read the
result of a later collective (``confirm``: the step-boundary agreement, which waits
for the stream), or at keep time when its after-marker completed while the
communicator reports no error (``torch_compat.communicator_error``). At keep time an
update still queued is left alone: the copy (``staging.stage_for_keep``, on a side
stream that does not wait for the hung one, within a time limit) is of the confirmed
step, and counts only if the update's before-marker had still not completed when the
copy ended, so no update kernel ran under it; otherwise nothing is kept.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import torch

from elastic_ext import torch_compat

logger = logging.getLogger("elastic_ext.worker.snapshot")  # the whole package logs under one name

T = TypeVar("T")
S = TypeVar("S")
R = TypeVar("R")


class Marker(Protocol):
    """A point in the device's stream (``torch.cuda.Event`` has this shape)."""

    def record(self) -> None: ...

    def query(self) -> bool: ...


@dataclass(frozen=True)
class _Pending(Generic[T]):
    step: int
    extra: T
    before: Marker
    after: Marker
    aborted: bool = False
    """The update raised after queuing some of its kernels: it never counts as done, and
    its before-marker still tells a keep whether any of them may have run."""


class HeldStep(Generic[T]):
    """The completed step the state holds, and what goes with it (``extra``: where the
    data stands after it); see the module docstring for the rule on each device.

    ``new_marker`` and ``communicator_error`` are the device's; tests pass fakes.
    """

    def __init__(self, step: int, extra: T, *, device: torch.device,
                 new_marker: Callable[[], Marker] | None = None,
                 communicator_error: Callable[[], str | None] = torch_compat.communicator_error
                 ) -> None:
        self.lock = threading.Lock()
        self._held: tuple[int, T] | None = (step, extra)
        self._pending: _Pending[T] | None = None
        self._on_device = device.type == "cuda" or new_marker is not None
        self._new_marker = new_marker or torch.cuda.Event
        self._communicator_error = communicator_error
        if device.type == "cuda":  # a restore's copies to the device land before any keep
            torch.cuda.current_stream(device).synchronize()

    @contextmanager
    def updating(self, step: int, extra: T) -> Iterator[None]:
        """Around ``optimizer.step()`` (and the scheduler's) that completes ``step``;
        ``extra`` is what goes with the state after it."""
        with self.lock:
            if not self._on_device:
                self._held = None
                yield
                self._held = (step, extra)
                return
            self._promote()
            before = self._new_marker()
            before.record()
            try:
                yield
            except BaseException:
                after = self._new_marker()
                after.record()
                self._pending = _Pending(step, extra, before, after, aborted=True)
                raise
            after = self._new_marker()
            after.record()
            self._pending = _Pending(step, extra, before, after)

    def confirm(self) -> None:
        """The host read the result of a collective queued after the last update (the
        step-boundary agreement): the device finished that update, with a healthy
        communicator unless it reports an error."""
        with self.lock:
            pending = self._pending
            if pending is not None and not pending.aborted and self._communicator_error() is None:
                self._held, self._pending = (pending.step, pending.extra), None

    @property
    def step(self) -> int | None:
        """The held step, None while a CPU update runs (no lock: a glance, for logs)."""
        held = self._held
        return None if held is None else held[0]

    def _promote(self) -> None:
        pending = self._pending
        if (pending is not None and not pending.aborted and pending.after.query()
                and self._communicator_error() is None):
            self._held, self._pending = (pending.step, pending.extra), None

    def keep(self, stage: Callable[[int, T], S], write: Callable[[int, S], R]
             ) -> tuple[int, R] | None:
        """Under the lock: ``stage(step, extra)`` the held step in host memory, check that
        no update ran meanwhile, then ``write(step, staged)``; the step and what ``write``
        returned, or None when no step can be trusted (logged)."""
        with self.lock:
            self._promote()
            held, pending = self._held, self._pending
            if held is None:
                logger.warning("not keeping the state: an update was being applied")
                return None
            if pending is not None and pending.before.query():
                logger.warning("not keeping the state: the update of step %d had started on "
                               "the device when the worker had to leave (communicator: %s)",
                               pending.step, self._communicator_error() or "no error reported")
                return None
            staged = stage(*held)
            if pending is not None and pending.before.query():
                logger.warning("not keeping the state of step %d: the update of step %d "
                               "started on the device while it was copied", held[0],
                               pending.step)
                return None
            return held[0], write(held[0], staged)


__all__ = ["HeldStep", "Marker"]
