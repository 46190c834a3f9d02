"""A node-local channel from workers to their etcd-ext agent.

A worker whose collective fails because a *peer* went away is not at fault, and
restarting it through torch's failure path would spend one of ``--max-restarts``
on every survivor. Instead the worker reports the fault here and waits; the agent
sees the report, treats it as a membership change and restarts its workers
without charging the restart budget (see ``Keeper``).

The agent creates a directory and exports its path in ``ELASTIC_EXT_CONTROL_DIR``
before it starts workers, so every worker inherits it.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

CONTROL_DIR_ENV = "ELASTIC_EXT_CONTROL_DIR"
_ROUND_FILE = "round"
_PEER_LOST = "lost-"
_SETUP_FAULT = "setup-"


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class AgentControl:
    """The agent's end: publishes the current round, reads workers' fault reports.

    By default it makes a fresh private directory and exports it to the workers the
    agent starts (through this process's environment); ``path`` uses a given directory
    and exports nothing (in-process tests).
    """

    def __init__(self, path: Path | None = None) -> None:
        self._exported = path is None
        self.path = Path(tempfile.mkdtemp(prefix="elastic-ext-ctl-")) if path is None else path
        if self._exported:
            os.environ[CONTROL_DIR_ENV] = str(self.path)

    def publish_round(self, round_: int) -> None:
        for stale in [*self.path.glob("fault-*"), *self.path.glob(f"{_PEER_LOST}*"),
                      *self.path.glob(f"{_SETUP_FAULT}*")]:
            stale.unlink(missing_ok=True)
        _atomic_write(self.path / _ROUND_FILE, str(round_))

    def publish_peer_lost(self, round_: int, why: str) -> None:
        """Tell the workers of ``round_`` that a peer is dead or hung: the stop that follows
        cannot wait for a step boundary (every collective would wait on that peer)."""
        _atomic_write(self.path / f"{_PEER_LOST}{round_}", why[:500])

    def fault_reported(self, round_: int) -> str | None:
        """The reason a worker gave for a peer fault in ``round_``, if any."""
        try:
            return (self.path / f"fault-{round_}").read_text() or "peer fault"
        except FileNotFoundError:
            return None

    def setup_fault_reported(self, round_: int) -> str | None:
        """What a worker's launcher said about a fault of the node's own machinery (the
        warm-start server died) in ``round_``, if anything."""
        try:
            return (self.path / f"{_SETUP_FAULT}{round_}").read_text() or "setup fault"
        except FileNotFoundError:
            return None

    def close(self) -> None:
        if not self._exported:
            return
        if os.environ.get(CONTROL_DIR_ENV) == str(self.path):
            del os.environ[CONTROL_DIR_ENV]
        shutil.rmtree(self.path, ignore_errors=True)


def peer_lost() -> bool:
    """In a worker: whether its agent found a peer of this round dead or hung."""
    path = os.environ.get(CONTROL_DIR_ENV)
    if not path:
        return False
    try:
        round_ = (Path(path) / _ROUND_FILE).read_text().strip()
        return (Path(path) / f"{_PEER_LOST}{round_}").exists()
    except OSError:
        return False


def report_peer_failure(reason: str) -> bool:
    """Tell the agent a collective failed because of a peer; False if nobody listens."""
    return _report("fault-", reason)


def report_setup_failure(reason: str) -> bool:
    """Tell the agent this worker died because of the node's own machinery (its
    warm-start server), not of anything it did: a free restart, started cold next time
    so it cannot repeat. False if nobody listens."""
    return _report(_SETUP_FAULT, reason)


def _report(kind: str, reason: str) -> bool:
    path = os.environ.get(CONTROL_DIR_ENV)
    if not path:
        return False
    try:
        round_ = (Path(path) / _ROUND_FILE).read_text().strip()
        _atomic_write(Path(path) / f"{kind}{round_}", reason[:500])
    except OSError as exc:
        logger.warning("could not report a fault to the agent: %s", exc)
        return False
    return True
