"""The state of the last completed step, kept in the node's memory for the next workers.

A worker that leaves without a durable snapshot (a peer failed, or its agent restarts
it for a new round) writes what its model, optimizer and scheduler hold into the
directory its etcd-ext agent keeps in node memory (``elastic_ext.agent.control``). The files
are a snapshot's (payload, then a manifest with the payload's sha256), one step is
kept, and RNG states are left out: every rank that holds a step then writes the same
bytes, so ranks can compare checksums before one of them hands its copy to the rest.
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from elastic_ext.procinfo import pid_alive
from elastic_ext.worker import control
from elastic_ext.worker.snapshot.durable import newest_valid, write_snapshot
from elastic_ext.worker.snapshot.layout import Manifest, manifest_name, payload_name
from elastic_ext.worker.snapshot.retention import newest_first, stale_tmp_files

logger = logging.getLogger("elastic_ext.worker.snapshot")  # the whole package logs under one name

KEPT_STEPS = 1
"""One step per node: the newest is the only one a hand-off can use."""
_LOCK_FILE = ".lock"


class LocalCopies:
    """A node's kept copies in ``directory``; the workers of one node share it."""

    def __init__(self, directory: Path) -> None:
        """Sweeps the temporary files of this host's writers that died mid-write (a worker
        killed while keeping): nobody else would, and they hold node memory."""
        self.directory = directory
        try:
            for name in stale_tmp_files(os.listdir(directory), socket.gethostname(), pid_alive):
                logger.info("removing %s, left by a worker that died keeping its state",
                            directory / name)
                (directory / name).unlink(missing_ok=True)
        except OSError:
            pass  # no directory yet, or gone with its agent: nothing to sweep

    @classmethod
    def of_this_node(cls) -> LocalCopies | None:
        """The copies the agent of this worker keeps, or None without an etcd-ext agent."""
        directory = control.local_state_dir()
        return cls(directory) if directory is not None else None

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """The node's workers write one at a time, so a step is written once per node."""
        with open(self.directory / _LOCK_FILE, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def write(self, step: int, tree: Any) -> Manifest | None:
        """Keep ``tree`` (state dicts and plain values, no RNG states) as the state of
        ``step``; None when a worker of this node already kept that step, or when the
        copy could not be written (logged: the next round falls back to peers or disk)."""
        try:
            with self._locked():
                if (self.directory / manifest_name(step)).exists():
                    return None
                return write_snapshot(self.directory, step, tree, KEPT_STEPS,
                                      round_=control.current_round())
        except (OSError, RuntimeError) as exc:
            logger.warning("could not keep the state of step %d in %s: %s", step,
                           self.directory, exc)
            return None

    def drop_older_than(self, step: int) -> None:
        """Remove the kept copies of steps before ``step`` (a newer durable snapshot or
        restored state exists): node memory is not kept for a copy nobody would choose."""
        try:
            with self._locked():
                for old in newest_first(os.listdir(self.directory)):
                    if old < step:
                        (self.directory / manifest_name(old)).unlink(missing_ok=True)
                        (self.directory / payload_name(old)).unlink(missing_ok=True)
                        logger.info("removed the kept state of step %d: step %d is newer", old,
                                    step)
        except OSError as exc:
            logger.warning("could not remove old kept state in %s: %s", self.directory, exc)

    def newest(self) -> Manifest | None:
        """The newest copy whose checksum verifies; a corrupt or truncated one is skipped
        with a warning naming its file."""
        return newest_valid(self.directory)


__all__ = ["KEPT_STEPS", "LocalCopies"]
