"""The workers' end of the control channel (``elastic_ext.control_channel``): what a
worker reads of its agent and reports to it. Every function is a no-op answer without
an etcd-ext agent (``ELASTIC_EXT_CONTROL_DIR`` unset)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from elastic_ext.control_channel import (
    CONTROL_DIR_ENV,
    DONE,
    LEAVING,
    PEER_LOST,
    PREEMPT,
    PROGRESS,
    ROUND_FILE,
    SETUP_FAULT,
    STATE_SUBDIR,
    atomic_write,
    record_notice,
)

logger = logging.getLogger(__name__)


def _round_file(kind: str) -> Path | None:
    """In a worker: the control file of ``kind`` for the current round (None: no agent)."""
    path = os.environ.get(CONTROL_DIR_ENV)
    if not path:
        return None
    try:
        round_ = (Path(path) / ROUND_FILE).read_text().strip()
    except OSError:
        return None
    return Path(path) / f"{kind}{round_}"


def current_round() -> int:
    """In a worker: the rendezvous round its agent is in (0 without an etcd-ext agent)."""
    path = os.environ.get(CONTROL_DIR_ENV)
    if not path:
        return 0
    try:
        return int((Path(path) / ROUND_FILE).read_text().strip())
    except (OSError, ValueError):
        return 0


def peer_lost() -> bool:
    """In a worker: whether its agent found a peer of this round dead or hung."""
    marker = _round_file(PEER_LOST)
    return marker is not None and marker.exists()


def leaving_reason() -> str | None:
    """In a worker: why its agent is restarting this round's workers, if it is (see
    :meth:`AgentControl.publish_leaving`); None under another agent or for a real stop."""
    marker = _round_file(LEAVING)
    if marker is None:
        return None
    try:
        return marker.read_text() or "restart"
    except OSError:
        return None


_progress_told: str | None = None  # the control file this process last wrote


def report_progress() -> None:
    """In a worker: a training step of this round completed. Written once per round; the
    agent counts rounds that end before any step (``Limits.stalled_rounds``)."""
    global _progress_told
    marker = _round_file(PROGRESS)
    if marker is None or str(marker) == _progress_told:
        return
    try:
        atomic_write(marker, "")
    except OSError as exc:
        logger.warning("could not tell the agent about training progress: %s", exc)
        return
    _progress_told = str(marker)


def preemption_requested() -> str | None:
    """In a worker: why its agent says the whole job stops with a durable snapshot
    (:meth:`AgentControl.publish_preemption`), if it does."""
    path = os.environ.get(CONTROL_DIR_ENV)
    if not path:
        return None
    try:
        return (Path(path) / PREEMPT).read_text() or "preemption"
    except OSError:
        return None


def agent_listens() -> bool:
    """In a worker: whether an etcd-ext agent started it (and so takes its notices)."""
    return bool(os.environ.get(CONTROL_DIR_ENV))


def report_done() -> bool:
    """In a worker: training completed, its last step is done. Only this tells the agent
    that the job finished: a worker that exits 0 may have been stopped (a preemption).
    False if no etcd-ext agent listens."""
    path = os.environ.get(CONTROL_DIR_ENV)
    if not path:
        return False
    try:
        atomic_write(Path(path) / DONE, "")
    except OSError as exc:
        logger.warning("could not tell the agent that training completed: %s", exc)
        return False
    return True


def report_notice(why: str) -> bool:
    """In a worker: a preemption notice reached this worker (its guard's handler, or the
    warm-start server's until the script installs its own). The agent settles it with the
    other nodes' notices (``drain.py``) and tells the workers what to do. False if no
    etcd-ext agent listens."""
    path = os.environ.get(CONTROL_DIR_ENV)
    if not path:
        return False
    return record_notice(Path(path), why)


def local_state_dir() -> Path | None:
    """In a worker: the node-memory directory its agent gives it for the state of the last
    completed step; None when no etcd-ext agent started this worker."""
    path = os.environ.get(CONTROL_DIR_ENV)
    if not path:
        return None
    state = Path(path) / STATE_SUBDIR
    return state if state.is_dir() else None


def report_peer_failure(reason: str) -> bool:
    """Tell the agent a collective failed because of a peer; False if nobody listens."""
    return _report("fault-", reason)


def report_setup_failure(reason: str) -> bool:
    """Tell the agent this worker died because of the node's own machinery (its
    warm-start server), not of anything it did: a free restart, started cold next time
    so it cannot repeat. False if nobody listens."""
    return _report(SETUP_FAULT, reason)


def _report(kind: str, reason: str) -> bool:
    marker = _round_file(kind)
    if marker is None:
        return False
    try:
        atomic_write(marker, reason[:500])
    except OSError as exc:
        logger.warning("could not report a fault to the agent: %s", exc)
        return False
    return True
