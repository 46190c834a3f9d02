"""Preemption and stop signals for training workers, and what a worker does on a peer's failure.

SIGTERM, SIGINT and SIGUSR2 only set a flag; at the next step boundary all ranks
agree through one small all-reduce (fused with whatever the loop reduces anyway)
and, if any rank was signalled, commit a snapshot together and leave. Under an
etcd-ext agent, a SIGUSR2 (a preemption notice) is the node's, not the job's: the
worker passes it to its agent, which decides with the other nodes whether this node
leaves while the others train on, or the whole job stops (``rendezvous/protocol/drain.py``),
and then tells the workers (a restart's SIGTERM, or the stop the guard reads here).

A Python signal handler runs only when the main thread returns to the interpreter,
and a worker whose peer is dead or frozen may sit in a C++ collective until it
times out. torch's agent sends SIGTERM at every restart and waits 30 s before
SIGKILL, so such a worker would stall the restart. A watchdog thread is woken by
the signal itself (``signal.set_wakeup_fd`` writes the signal number to a socket
in the C-level handler) and ends the process if the main thread has not reached
the boundary, or begun the agreed commit, within a short grace. Once the commit
has begun the watchdog leaves it alone.

A worker whose collective fails because a peer went away reports it to its
etcd-ext agent and waits for the agent to stop it (:mod:`elastic_ext.worker.hold`, as the
warm-start launcher does for any script), instead of exiting non-zero and spending a
restart.

A stop that is only the etcd-ext agent restarting its workers for a new round (it
says so through ``elastic_ext.worker.control``) is told apart from a real one, so the loop
can keep its state in node memory instead of writing a durable snapshot; and a
worker that leaves without reaching a step boundary first calls the loop's
``keep_state``, so the state of its last completed step survives it.
"""

from __future__ import annotations

import enum
import logging
import select
import signal
import socket
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from elastic_ext.worker import control
from elastic_ext.worker.distributed import collective_device
from elastic_ext.worker.hold import (
    EXIT_HOLD_TIMEOUT,
    HOLD_TIMEOUT_S,
    exit_now,
    hold_after_peer_fault,
    is_peer_fault,
)
from elastic_ext.worker.progress import ProgressBeacon

logger = logging.getLogger(__name__)

SignalHandler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None
"""What ``signal.signal`` returns and takes back: a function, SIG_DFL/SIG_IGN, or None."""


_PEER_LOST_POLL_S = 0.1
"""How often a stopping worker looks whether its agent found a peer dead or hung."""


class GuardPhase(enum.Enum):
    """Where the guard's worker stands, which decides what the watchdog may do (named apart
    from the rendezvous' ``protocol.state.Phase``)."""

    RUNNING = "running"        # the watchdog may end the process once the grace is over
    COMMITTING = "committing"  # a stop was agreed: the watchdog leaves the commit alone
    HOLDING = "holding"        # waiting for a signal; the main thread exits by itself


@dataclass(frozen=True)
class GuardSettings:
    """Which signals mean what, and how long a worker may take to act on them."""

    stop_signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)
    """Agent stops (restart, job cancel): act at the next boundary or leave within
    ``stop_grace_s``."""
    preempt_signals: tuple[int, ...] = (signal.SIGUSR2,)
    """Advance notice (SLURM ``--signal=USR2@120``): a longer grace, the step may be slow."""
    stop_grace_s: float = 3.0
    preempt_grace_s: float = 30.0
    hold_timeout_s: float = HOLD_TIMEOUT_S
    """How long a worker waits for its own signal after a stop it learned from others, or
    for its agent after reporting a peer failure, before it exits non-zero."""

    def grace_for(self, signum: int) -> float:
        return self.preempt_grace_s if signum in self.preempt_signals else self.stop_grace_s


@dataclass(frozen=True)
class Agreement:
    """The outcome of one step-boundary all-reduce."""

    stop: bool
    """Some rank was signalled: every rank commits and leaves."""
    values: torch.Tensor | None = field(default=None, compare=False)
    """The caller's values, summed over ranks (float64)."""
    restart: bool = False
    """Every signalled rank was stopped by its etcd-ext agent to restart the round (a
    membership change): the state kept in node memory is enough, nothing need be durable."""


_installed: PreemptionGuard | None = None


def installed_guard() -> PreemptionGuard | None:
    """The guard installed in this process, if any: whoever catches an exception that left
    the training loop (the warm-start launcher) lets it keep the step first."""
    return _installed


class PreemptionGuard:
    """Signal flag, watchdog, step-boundary agreement and failure hold for one worker.

    Typical use, on every rank::

        guard = PreemptionGuard().install()
        while step < total:
            try:
                train_step()
                agreed = guard.agree()
            except Exception as exc:
                exit_now(guard.failure_exit_code(exc))
            step += 1
            if agreed.stop:
                snapshots.commit_now(step, state)
                exit_now(guard.preempted_exit_code())
    """

    def __init__(self, settings: GuardSettings | None = None, *,
                 keep_state: Callable[[str], None] | None = None) -> None:
        """``keep_state(why)`` (settable later, as ``guard.keep_state``) is called before this
        worker leaves without reaching a step boundary (a peer failed, or a stop could not
        wait), from the main thread or the watchdog, at most once; it should keep the last
        completed step (``Snapshotter.keep_local``) unless the state is mid-update."""
        self.settings = settings or GuardSettings()
        self.keep_state = keep_state
        self._keep_lock = threading.Lock()
        self._kept = False
        self._signalled: int | None = None
        self._signal_event = threading.Event()
        self._phase = GuardPhase.RUNNING
        self._hold_code = 0  # what a held worker exits with once its signal comes
        self._lock = threading.RLock()
        self._previous_handlers: dict[int, SignalHandler] = {}
        self._previous_wakeup_fd = -1
        self._reader: socket.socket | None = None
        self._writer: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self.beacon: ProgressBeacon | None = None  # under an etcd-ext agent, once installed

    # -- installation
    @property
    def handled_signals(self) -> tuple[int, ...]:
        return tuple(dict.fromkeys((*self.settings.stop_signals, *self.settings.preempt_signals)))

    def install(self) -> PreemptionGuard:
        """Install the handlers and start the watchdog; main thread only, once per process."""
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("PreemptionGuard.install() must run in the main thread")
        if self._thread is not None:
            return self
        self.beacon = ProgressBeacon.for_this_worker()
        self._reader, self._writer = socket.socketpair()
        self._writer.setblocking(False)
        self._previous_wakeup_fd = signal.set_wakeup_fd(self._writer.fileno(),
                                                        warn_on_full_buffer=False)
        for signum in self.handled_signals:
            self._previous_handlers[signum] = signal.signal(signum, self._on_signal)
        self._thread = threading.Thread(target=self._watch, name="preemption-watchdog", daemon=True)
        self._thread.start()
        self._take_agent_notice()
        global _installed
        _installed = self
        return self

    def _take_agent_notice(self) -> None:
        """The stop the agent published (the whole job stops after a preemption notice,
        ``rendezvous/protocol/drain.py``; before this worker started, or while it runs) counts as
        this worker's own signal."""
        notice = control.preemption_requested()
        if notice is not None and self.settings.preempt_signals and self._signalled is None:
            logger.info("the job stops (%s): stopping at the next step boundary with a "
                        "snapshot", notice)
            self._note(self.settings.preempt_signals[0])

    def uninstall(self) -> None:
        """Restore the previous handlers and stop the watchdog."""
        if self._thread is None:
            return
        global _installed
        if _installed is self:
            _installed = None
        for signum, handler in self._previous_handlers.items():
            signal.signal(signum, handler)
        self._previous_handlers.clear()
        signal.set_wakeup_fd(self._previous_wakeup_fd)
        assert self._writer is not None
        self._writer.close()  # the watchdog reads EOF and returns
        self._thread.join(timeout=5)
        self._thread = None
        if self._reader is not None:
            self._reader.close()

    def __enter__(self) -> PreemptionGuard:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.uninstall()

    # -- state
    @property
    def signalled(self) -> int | None:
        """The first handled signal this process received, or None."""
        return self._signalled

    @property
    def phase(self) -> GuardPhase:
        return self._phase

    def _set_phase(self, phase: GuardPhase) -> None:
        with self._lock:
            if phase is not GuardPhase.RUNNING and self._phase is GuardPhase.RUNNING \
                    and self.beacon is not None:
                self.beacon.close()  # a commit or a hold is not a hang: this worker leaves
            self._phase = phase

    def _keep(self, why: str) -> None:
        """Call ``keep_state`` once; a second caller waits until the first is done, so the
        watchdog never ends the process in the middle of the main thread's keep."""
        if self.keep_state is None:
            return
        with self._keep_lock:
            if self._kept:
                return
            self._kept = True
            try:
                self.keep_state(why)
            except Exception:
                logger.exception("could not keep the state of the last step")

    def _begin_hold(self, code_on_signal: int) -> None:
        """From now the main thread waits for a signal; should it not leave once one came,
        the watchdog ends the process with ``code_on_signal``."""
        with self._lock:
            self._hold_code = code_on_signal
            self._phase = GuardPhase.HOLDING

    def _wait_for_signal(self, timeout: float) -> int | None:
        """The handled signal this process got, waiting up to ``timeout`` for one: the
        :data:`elastic_ext.worker.hold.SignalWait` of a process whose handlers are the guard's
        (the watchdog, woken by the signal, sets the event)."""
        return self._signalled if self._signal_event.wait(timeout) else None

    def _note(self, signum: int) -> None:
        with self._lock:
            if self._signalled is None:
                self._signalled = signum
        self._signal_event.set()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # No locks here: the handler may run inside any bytecode of the main thread, even one
        # holding a lock it would need. The watchdog, woken by the same signal, does the rest.
        if self._signalled is None and not self._passed_to_agent(signum):
            self._signalled = signum

    def _passed_to_agent(self, signum: int) -> bool:
        """Whether ``signum`` is a notice this worker's etcd-ext agent takes (the watchdog
        passes it on): it does not stop the job by itself."""
        return signum in self.settings.preempt_signals and control.agent_listens()

    def _watch(self) -> None:
        assert self._reader is not None
        deadline: float | None = None
        deadline_signal = 0
        while True:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            if timeout is not None and deadline_signal in self.settings.stop_signals:
                if control.peer_lost():  # learned after the signal: stop waiting
                    timeout, deadline = 0.0, time.monotonic()
                else:
                    timeout = min(timeout, _PEER_LOST_POLL_S)
            try:
                readable, _, _ = select.select([self._reader], [], [], timeout)
            except (OSError, ValueError):
                return
            if readable:
                try:
                    data = self._reader.recv(256)
                except BlockingIOError:
                    continue
                except OSError:
                    return
                if not data:
                    return
                for signum in data:
                    if signum not in self.handled_signals:
                        continue
                    if self._passed_to_agent(signum) and \
                            control.report_notice(f"{signal.Signals(signum).name} to a worker"):
                        logger.info("got %s: passed to the etcd-ext agent, which settles it "
                                    "with the other nodes", signal.Signals(signum).name)
                        continue
                    self._note(signum)
                    candidate = time.monotonic() + self._grace(signum)
                    if deadline is None or candidate < deadline:
                        deadline, deadline_signal = candidate, signum
                continue
            if deadline is None or time.monotonic() < deadline:
                continue
            with self._lock:
                phase = self._phase
            if phase is GuardPhase.RUNNING:
                if deadline_signal in self.settings.stop_signals and control.peer_lost():
                    logger.warning("got %s and the agent found a peer dead or hung: no step "
                                   "boundary can be reached, exiting at once",
                                   signal.Signals(deadline_signal).name)
                    self._keep("a peer is dead or hung")
                else:
                    logger.error("got %s but the step boundary was not reached within %.1fs (a "
                                 "peer is dead or frozen, or a step is slower than the grace); "
                                 "exiting without a snapshot", signal.Signals(deadline_signal).name,
                                 self.settings.grace_for(deadline_signal))
                    self._keep("the step boundary was not reached in time")
                exit_now(128 + deadline_signal)
            if phase is GuardPhase.HOLDING:  # the main thread should have left already
                exit_now(self._hold_code)
            deadline = None  # committing: the commit's own collectives have timeouts

    def _grace(self, signum: int) -> float:
        """A stop because a peer is dead or hung gets no grace: no step boundary can be
        reached (every collective waits on that peer), so waiting only delays the restart."""
        if signum in self.settings.stop_signals and control.peer_lost():
            return 0.0
        return self.settings.grace_for(signum)

    # -- the step boundary
    def agree(self, values: torch.Tensor | None = None,
              group: dist.ProcessGroup | None = None) -> Agreement:
        """One all-reduce (SUM) of ``[signalled, restart, *values]``: did any rank get a
        signal, and was every signal its agent restarting the round?

        Call it at every step boundary on every rank. Passing the loop's own values
        (a loss sum, a sample count) makes this the only collective the boundary needs.
        When the answer is stop, the watchdog stands down so the commit can finish.
        """
        if self._signalled is None:
            self._take_agent_notice()
        signalled = self._signalled
        flag = 1.0 if signalled is not None else 0.0
        restart = 1.0 if signalled is not None and signalled in self.settings.stop_signals \
            and control.leaving_reason() is not None else 0.0  # files read only once signalled
        flags = torch.tensor([flag, restart], dtype=torch.float64)
        if not (dist.is_available() and dist.is_initialized()):
            summed = values.detach().to(torch.float64).flatten() if values is not None else None
        else:
            device = values.device if values is not None else collective_device(group)
            parts = [flags.to(device)]
            if values is not None:
                parts.append(values.detach().to(device=device, dtype=torch.float64).flatten())
            payload = torch.cat(parts)
            dist.all_reduce(payload, op=dist.ReduceOp.SUM, group=group)
            flags = payload[:2].cpu()
            summed = payload[2:] if values is not None else None
        stop = bool(flags[0].item() > 0)  # read back: the device finished the step
        if stop:
            self._set_phase(GuardPhase.COMMITTING)
        else:
            control.report_progress()
            if self.beacon is not None:
                self.beacon.step()
        return Agreement(stop=stop, values=summed,
                         restart=stop and bool(flags[1].item() == flags[0].item()))

    def no_hang_check(self) -> AbstractContextManager[None]:
        """A known long pause between step boundaries (evaluation, a synchronous save): the
        agent's hang judge does not count it (``rendezvous/protocol/hang.py``)."""
        return self.beacon.paused() if self.beacon is not None else nullcontext()

    def done(self) -> None:
        """The last step is done: tell the etcd-ext agent that training completed. Only this
        marks the job finished; a worker that exits 0 may have been stopped."""
        control.report_done()

    def begin_commit(self) -> None:
        """Stand the watchdog down for a commit that is not the result of :meth:`agree`
        (the last one)."""
        self._set_phase(GuardPhase.COMMITTING)

    def preempted_exit_code(self) -> int:
        """After the agreed commit: 0 once this process has its own signal.

        A worker that learned of the stop only from the others must not exit 0 at
        once (its agent would take that as the job succeeding), so it waits up to
        ``hold_timeout_s`` for its own signal and otherwise returns non-zero.
        """
        if self._signalled is not None:
            return 0
        logger.info("a peer was signalled; waiting up to %.0fs for this worker's own signal",
                    self.settings.hold_timeout_s)
        self._begin_hold(code_on_signal=0)
        deadline = time.monotonic() + self.settings.hold_timeout_s
        while (left := deadline - time.monotonic()) > 0:
            if self._wait_for_signal(min(left, _PEER_LOST_POLL_S)) is not None:
                return 0
            self._take_agent_notice()  # the agent's stop counts as this worker's signal
        if self._signalled is not None:
            return 0
        logger.error("no signal reached this worker within %.0fs after the preemption snapshot",
                     self.settings.hold_timeout_s)
        return EXIT_HOLD_TIMEOUT

    def failure_exit_code(self, exc: BaseException) -> int:
        """What a worker whose step raised ``exc`` exits with; re-raises what is not a peer's fault.

        Already signalled: the failure is part of the stop, keep the state and leave. A
        peer fault under an etcd-ext agent: report it, keep the state, and wait until the
        agent stops this worker (then 128+SIGTERM), or ``hold_timeout_s`` or the agent's
        death (then non-zero), as :func:`elastic_ext.worker.hold.hold_for_agent` does for any
        script. Otherwise (stock torchrun, or a genuine error): ``exc`` is raised again.
        """
        if self._signalled is not None:
            logger.warning("step failed while stopping on %s: %s",
                           signal.Signals(self._signalled).name, exc)
            self._keep("the step failed while stopping")
            return 128 + self._signalled
        code = hold_after_peer_fault(exc, timeout_s=self.settings.hold_timeout_s,
                                     wait=self._wait_for_signal, on_reported=self._before_hold)
        if code is None:
            raise exc
        return code

    def _before_hold(self) -> None:
        """Keep the last step's state once the fault is reported, then hold."""
        self._set_phase(GuardPhase.COMMITTING)  # the agent's SIGTERM must not cut the keep short
        self._keep("a collective failed")
        self._begin_hold(code_on_signal=128 + signal.SIGTERM)


__all__ = [
    "EXIT_HOLD_TIMEOUT",
    "Agreement",
    "GuardPhase",
    "GuardSettings",
    "PreemptionGuard",
    "exit_now",
    "installed_guard",
    "is_peer_fault",
]
