"""A node-local channel between workers and their etcd-ext agent: the files both ends
agree on. The agent's end is ``elastic_ext.agent.control``, the workers' end
``elastic_ext.worker.control``.

A worker whose collective fails because a *peer* went away is not at fault, and
restarting it through torch's failure path would spend one of ``--max-restarts``
on every survivor. Instead the worker reports the fault here and waits; the agent
sees the report, treats it as a membership change and restarts its workers
without charging the restart budget (see ``Keeper``).

The agent creates a directory and exports its path in ``ELASTIC_EXT_CONTROL_DIR``
before it starts workers, so every worker inherits it. The directory lives in the
node's memory (``/dev/shm`` where there is one) because it also holds ``state/``,
where workers keep the state of their last completed step for the next workers on
the node (``elastic_ext.worker.snapshot.local``). It is the agent's: removed when the agent
ends, and when an agent that was killed left one, by the next agent on the node.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
from pathlib import Path

from elastic_ext.procinfo import pid_alive

logger = logging.getLogger(__name__)

CONTROL_DIR_ENV = "ELASTIC_EXT_CONTROL_DIR"
STATE_SUBDIR = "state"
ROUND_FILE = "round"
PEER_LOST = "lost-"
SETUP_FAULT = "setup-"
LEAVING = "leaving-"
PROGRESS = "progress-"
BEAT = "beat-"  # a worker's beacon (worker/progress.py), by local rank
PREEMPT = "preempt"
NOTICE = "notice"
DOORBELL = "doorbell"  # a FIFO: a worker rings it after it recorded a notice
DONE = "done"
DIR_PREFIX = "elastic-ext-ctl-"
NODE_MEMORY = Path("/dev/shm")


def node_memory_directory() -> Path:
    """Node memory when the machine has a writable tmpfs there, the temporary directory else."""
    if NODE_MEMORY.is_dir() and os.access(NODE_MEMORY, os.W_OK | os.X_OK):
        return NODE_MEMORY
    return Path(tempfile.gettempdir())


def remove_abandoned(base: Path, prefix: str = DIR_PREFIX) -> list[Path]:
    """Remove this user's directories ``<prefix><pid>-*`` in ``base`` whose owner is dead
    (killed, so it could not clean up); returns what was removed. By default the agents'
    control directories, whose kept state is in RAM."""
    owned = re.compile(rf"^{re.escape(prefix)}(\d+)-")
    removed: list[Path] = []
    try:
        entries = list(base.iterdir())
    except OSError:
        return removed
    for entry in entries:
        match = owned.match(entry.name)
        try:
            if not match or entry.stat().st_uid != os.getuid() or pid_alive(int(match[1])):
                continue
        except OSError:
            continue
        shutil.rmtree(entry, ignore_errors=True)
        logger.info("removed %s, left by a process that is gone", entry)
        removed.append(entry)
    return removed


def atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def record_notice(directory: Path, why: str) -> bool:
    """Record a node's notice once (the first one says when); False if it cannot be."""
    target = directory / NOTICE
    if target.exists():
        return True
    try:
        atomic_write(target, why[:100])
    except OSError as exc:
        logger.warning("could not record the preemption notice (%s): %s", why, exc)
        return False
    ring(directory)
    return True


def ring(directory: Path) -> None:
    """Ring the agent's notice doorbell without ever blocking (this may run in a signal
    handler): nothing happens when no agent waits on it."""
    try:
        bell = os.open(directory / DOORBELL, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:  # no reader (the agent is gone) or no doorbell
        return
    try:
        os.write(bell, b"!")
    except OSError:  # full: the agent has wake-ups enough to read
        pass
    finally:
        os.close(bell)
