"""A worker that fails through no fault of its own reports it to its agent and waits to be stopped.

A worker whose collective fails because a peer went away is not at fault, and exiting
non-zero would spend one of torch's ``--max-restarts`` on every survivor. Instead it
reports the fault through :mod:`elastic_ext.worker.control` and waits for the stop signal of
the free restart its etcd-ext agent then does. The bundled trainer's
:class:`~elastic_ext.worker.preemption.PreemptionGuard` and the warm-start launcher (for any
script, and for a worker that died with the node's warm-start server) both hold
through :func:`hold_for_agent`, so both behave the same.

It imports nothing heavy: the warm-start launcher uses it, and must start in milliseconds.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import sys
import time
from collections.abc import Callable
from typing import NoReturn

logger = logging.getLogger(__name__)

HOLD_TIMEOUT_S = 60.0
"""How long a worker that reported a fault waits for its agent to stop it, by default."""

EXIT_HOLD_TIMEOUT = 1
"""Exit status of a worker that waited for its own signal or for its agent, in vain."""

HOLD_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR2})
"""What :func:`wait_blocked` takes for the agent's stop."""

_AGENT_CHECK_S = 0.2
"""How often a holding worker looks whether its agent (its parent) is still there."""

SignalWait = Callable[[float], int | None]
"""Waits up to the given seconds for a stop signal: its number, or None if none came."""

_PEER_FAULT_PATTERNS = re.compile(
    r"gloo/transport|ProcessGroupGloo|Gloo connect|NCCL|TCPStore|c10d"
    r"|connection (?:reset|closed) by peer|broken pipe|socket timeout|communicator was aborted",
    re.IGNORECASE,
)
"""Only what collectives and the store say: a hold is free of the restart budget, so an
ordinary error (a data loader's timeout, say) must never be taken for a peer's fault."""


def is_peer_fault(exc: BaseException) -> bool:
    """True when ``exc`` looks like a collective failing because of a peer or the store.

    Gloo raises plain ``RuntimeError`` ("Connection reset by peer", "Timed out waiting
    ... for recv"), newer builds ``DistError`` subclasses; a genuine bug (a shape
    error, say) must not be mistaken for one and held, so the message decides. A process
    that never imported ``torch.distributed`` ran no collective: never a peer's fault.
    """
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return False
    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(exc, dist_error):
        return True
    if not isinstance(exc, RuntimeError):
        return isinstance(exc, (ConnectionError, TimeoutError))
    return bool(_PEER_FAULT_PATTERNS.search(str(exc)))


def wait_blocked(timeout: float) -> int | None:
    """:data:`SignalWait` for a process with no handlers of its own for the stop: blocks
    :data:`HOLD_SIGNALS` and takes one, so it cannot end the process by its default action
    before the hold returns its exit status."""
    signal.pthread_sigmask(signal.SIG_BLOCK, HOLD_SIGNALS)
    got = signal.sigtimedwait(HOLD_SIGNALS, timeout)
    return None if got is None else got.si_signo


def hold_for_agent(reason: str, *, setup_fault: bool = False,
                   timeout_s: float = HOLD_TIMEOUT_S, wait: SignalWait = wait_blocked,
                   on_reported: Callable[[], None] | None = None) -> int | None:
    """Report ``reason`` to the etcd-ext agent as a fault that is not this worker's (a
    peer's, or with ``setup_fault`` the node's own machinery's) and wait for its stop.

    Returns the exit status to leave with: 128 + the signal ``wait`` got, or
    :data:`EXIT_HOLD_TIMEOUT` after ``timeout_s`` or as soon as the agent (this process's
    parent) dies; None when no agent listens (stock torchrun: the caller fails as it would
    have). ``on_reported`` runs once the report is made, before the wait starts.
    """
    from elastic_ext.worker import control  # only now: the launcher's start stays light

    rank = os.environ.get("RANK", "?")
    report = control.report_setup_failure if setup_fault else control.report_peer_failure
    agent = os.getppid()
    if not report(f"rank {rank}: {reason}"):
        return None
    logger.warning("rank %s: %s; reported to the etcd-ext agent as not this worker's fault, "
                   "waiting up to %.0fs for it to stop this worker", rank, reason[:300],
                   timeout_s)
    if on_reported is not None:
        on_reported()
    flush_std_streams()
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        signum = wait(min(left, _AGENT_CHECK_S))
        if signum is not None:
            return 128 + signum
        if os.getppid() != agent:  # the agent died: nobody will stop us
            logger.error("rank %s: the agent died while this worker waited for it", rank)
            return EXIT_HOLD_TIMEOUT
    logger.error("rank %s: the agent did not stop this worker within %.0fs", rank, timeout_s)
    return EXIT_HOLD_TIMEOUT


def hold_after_peer_fault(exc: BaseException, *, timeout_s: float = HOLD_TIMEOUT_S,
                          wait: SignalWait = wait_blocked,
                          on_reported: Callable[[], None] | None = None) -> int | None:
    """:func:`hold_for_agent` for ``exc`` when it is a peer's fault (:func:`is_peer_fault`);
    None when it is not, or when no agent listens."""
    if not is_peer_fault(exc):
        return None
    return hold_for_agent(f"{type(exc).__name__}: {exc}", timeout_s=timeout_s, wait=wait,
                          on_reported=on_reported)


def exit_now(code: int) -> NoReturn:
    """Leave without interpreter teardown, which can block on a dead peer's process group
    (1.1-1.5 s for a DDP script's broken gloo group): what a held worker does once its
    agent's signal came. ``atexit`` handlers do not run, as for a worker without a handler
    that the signal itself ends under stock torchrun."""
    logger.info("exiting with status %d", code)
    logging.shutdown()
    flush_std_streams()
    os._exit(code)


def flush_std_streams() -> None:
    """Flush stdout and stderr before the process may end without interpreter teardown
    (``os._exit``, a signal); a missing or closed stream is passed over."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass


__all__ = [
    "EXIT_HOLD_TIMEOUT",
    "HOLD_SIGNALS",
    "HOLD_TIMEOUT_S",
    "SignalWait",
    "exit_now",
    "flush_std_streams",
    "hold_after_peer_fault",
    "hold_for_agent",
    "is_peer_fault",
    "wait_blocked",
]
