"""A node-local channel from workers to their etcd-ext agent.

A worker whose collective fails because a *peer* went away is not at fault, and
restarting it through torch's failure path would spend one of ``--max-restarts``
on every survivor. Instead the worker reports the fault here and waits; the agent
sees the report, treats it as a membership change and restarts its workers
without charging the restart budget (see ``Keeper``).

The agent creates a directory and exports its path in ``ELASTIC_EXT_CONTROL_DIR``
before it starts workers, so every worker inherits it. The directory lives in the
node's memory (``/dev/shm`` where there is one) because it also holds ``state/``,
where workers keep the state of their last completed step for the next workers on
the node (``elastic_ext.snapshot.local``). It is the agent's: removed when the agent
ends, and when an agent that was killed left one, by the next agent on the node.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from elastic_ext.procinfo import pid_alive

logger = logging.getLogger(__name__)

CONTROL_DIR_ENV = "ELASTIC_EXT_CONTROL_DIR"
STATE_SUBDIR = "state"
_ROUND_FILE = "round"
_PEER_LOST = "lost-"
_SETUP_FAULT = "setup-"
_LEAVING = "leaving-"
_PROGRESS = "progress-"
_PREEMPT = "preempt"
_NOTICE = "notice"
_DOORBELL = "doorbell"  # a FIFO: a worker rings it after it recorded a notice
_DONE = "done"
_DIR_PREFIX = "elastic-ext-ctl-"
_NODE_MEMORY = Path("/dev/shm")


def node_memory_directory() -> Path:
    """Node memory when the machine has a writable tmpfs there, the temporary directory else."""
    if _NODE_MEMORY.is_dir() and os.access(_NODE_MEMORY, os.W_OK | os.X_OK):
        return _NODE_MEMORY
    return Path(tempfile.gettempdir())


def remove_abandoned(base: Path, prefix: str = _DIR_PREFIX) -> list[Path]:
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
        if path is None:
            base = node_memory_directory()
            remove_abandoned(base)
            path = Path(tempfile.mkdtemp(prefix=f"{_DIR_PREFIX}{os.getpid()}-", dir=base))
            os.environ[CONTROL_DIR_ENV] = str(path)
            # torch's agent skips the rendezvous shutdown when a signal stops it, so the
            # state kept in node memory must not depend on it to be freed.
            atexit.register(self.close)
        self.path = path
        (self.path / STATE_SUBDIR).mkdir(mode=0o700, parents=True, exist_ok=True)
        if not (self.path / _DOORBELL).exists():
            os.mkfifo(self.path / _DOORBELL, 0o600)
        self.on_notice: Callable[[], None] | None = None
        """Called after the agent's own notice is recorded (the keeper acts on it at once)."""
        self._caught: int | None = None  # the signal ``catch_preemption`` took

    def publish_round(self, round_: int) -> None:
        for stale in [*self.path.glob("fault-*"), *self.path.glob(f"{_PEER_LOST}*"),
                      *self.path.glob(f"{_SETUP_FAULT}*"), *self.path.glob(f"{_LEAVING}*"),
                      *self.path.glob(f"{_PROGRESS}*")]:
            stale.unlink(missing_ok=True)
        _atomic_write(self.path / _ROUND_FILE, str(round_))

    def publish_preemption(self, why: str) -> None:
        """Tell the workers to stop at their next step boundary with a durable snapshot,
        for this agent's life: the workers running now see it at their next boundary,
        workers started later at their first (the whole job stops: ``drain.py``)."""
        _atomic_write(self.path / _PREEMPT, why[:100])

    def notice(self) -> str | None:
        """The preemption notice this node got (the agent's signal, or a worker's report),
        if any; the keeper settles it with the other nodes' (``drain.py``)."""
        try:
            return (self.path / _NOTICE).read_text() or "preemption notice"
        except OSError:
            return None

    def wait_for_notice(self, stopped: threading.Event) -> bool:
        """Block until this node has a notice (True), or until ``stopped`` is set and
        :meth:`ring` called (False). A read of the doorbell FIFO, which whoever records a
        notice rings: a wait, not a look at the directory every few milliseconds (which
        at hundreds of agents per machine is thousands of wake-ups a second)."""
        try:  # read and write: our own writer keeps the FIFO from ever reading end of file
            bell = os.open(self.path / _DOORBELL, os.O_RDWR)
        except OSError as exc:  # the directory is gone: the agent is leaving
            logger.debug("no notice doorbell to wait on: %s", exc)
            return False
        try:
            while not stopped.is_set():
                if self.notice() is not None:
                    return True
                os.read(bell, 512)
            return False
        finally:
            os.close(bell)

    def ring(self) -> None:
        """Wake :meth:`wait_for_notice` (to see a notice, or that it should stop)."""
        _ring(self.path)

    def catch_preemption(self, signum: int = signal.SIGUSR2) -> bool:
        """In the agent: record ``signum`` (SLURM's advance notice) as this node's notice
        (:meth:`notice`) instead of dying of it or ignoring it. Leaves a handler someone
        else installed alone; False when it did not install one."""
        if threading.current_thread() is not threading.main_thread():
            return False
        if signal.getsignal(signum) not in (signal.SIG_DFL, signal.SIG_IGN):
            return False
        name = signal.Signals(signum).name

        def record(received: int, frame: FrameType | None) -> None:
            if _record_notice(self.path, f"{name} to the agent"):
                logger.warning("etcd-ext: %s received: this node leaves the job, or the whole "
                               "job stops with a snapshot if the others would be too few", name)
                if self.on_notice is not None:
                    self.on_notice()

        signal.signal(signum, record)
        self._caught = signum
        return True

    def record_progress(self) -> None:
        """What a worker's ``report_progress`` records for the current round, for agents
        whose workers are simulated (``benchmarks/scale.py``)."""
        round_ = (self.path / _ROUND_FILE).read_text().strip()
        _atomic_write(self.path / f"{_PROGRESS}{round_}", "")

    def progress_reported(self, round_: int) -> bool:
        """Whether a worker of ``round_`` completed a training step (``report_progress``)."""
        return (self.path / f"{_PROGRESS}{round_}").exists()

    def done_reported(self) -> bool:
        """Whether a worker said training completed (``report_done``)."""
        return (self.path / _DONE).exists()

    def publish_leaving(self, round_: int, reason: str) -> None:
        """Tell the workers of ``round_`` that the SIGTERM coming is this agent restarting
        them for a new round (``reason``: the keeper's), not the job being stopped: the
        state kept on the node is enough, no durable snapshot is needed."""
        _atomic_write(self.path / f"{_LEAVING}{round_}", reason[:100])

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
        if self._caught is not None and threading.current_thread() is threading.main_thread():
            # The agent is leaving: a notice now means nothing, and must not kill it while
            # the interpreter ends (which puts back the default disposition, death).
            signal.signal(self._caught, signal.SIG_IGN)
            self._caught = None
        if not self._exported:
            return
        if os.environ.get(CONTROL_DIR_ENV) == str(self.path):
            del os.environ[CONTROL_DIR_ENV]
        shutil.rmtree(self.path, ignore_errors=True)


def _round_file(kind: str) -> Path | None:
    """In a worker: the control file of ``kind`` for the current round (None: no agent)."""
    path = os.environ.get(CONTROL_DIR_ENV)
    if not path:
        return None
    try:
        round_ = (Path(path) / _ROUND_FILE).read_text().strip()
    except OSError:
        return None
    return Path(path) / f"{kind}{round_}"


def current_round() -> int:
    """In a worker: the rendezvous round its agent is in (0 without an etcd-ext agent)."""
    path = os.environ.get(CONTROL_DIR_ENV)
    if not path:
        return 0
    try:
        return int((Path(path) / _ROUND_FILE).read_text().strip())
    except (OSError, ValueError):
        return 0


def peer_lost() -> bool:
    """In a worker: whether its agent found a peer of this round dead or hung."""
    marker = _round_file(_PEER_LOST)
    return marker is not None and marker.exists()


def leaving_reason() -> str | None:
    """In a worker: why its agent is restarting this round's workers, if it is (see
    :meth:`AgentControl.publish_leaving`); None under another agent or for a real stop."""
    marker = _round_file(_LEAVING)
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
    marker = _round_file(_PROGRESS)
    if marker is None or str(marker) == _progress_told:
        return
    try:
        _atomic_write(marker, "")
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
        return (Path(path) / _PREEMPT).read_text() or "preemption"
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
        _atomic_write(Path(path) / _DONE, "")
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
    return _record_notice(Path(path), why)


def _record_notice(directory: Path, why: str) -> bool:
    """Record a node's notice once (the first one says when); False if it cannot be."""
    target = directory / _NOTICE
    if target.exists():
        return True
    try:
        _atomic_write(target, why[:100])
    except OSError as exc:
        logger.warning("could not record the preemption notice (%s): %s", why, exc)
        return False
    _ring(directory)
    return True


def _ring(directory: Path) -> None:
    """Ring the agent's notice doorbell without ever blocking (this may run in a signal
    handler): nothing happens when no agent waits on it."""
    try:
        bell = os.open(directory / _DOORBELL, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:  # no reader (the agent is gone) or no doorbell
        return
    try:
        os.write(bell, b"!")
    except OSError:  # full: the agent has wake-ups enough to read
        pass
    finally:
        os.close(bell)


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
    return _report(_SETUP_FAULT, reason)


def _report(kind: str, reason: str) -> bool:
    marker = _round_file(kind)
    if marker is None:
        return False
    try:
        _atomic_write(marker, reason[:500])
    except OSError as exc:
        logger.warning("could not report a fault to the agent: %s", exc)
        return False
    return True
