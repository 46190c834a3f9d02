"""The agent's end of the control channel (``elastic_ext.control_channel``): it publishes
the current round and reads its workers' reports."""

from __future__ import annotations

import atexit
import json
import logging
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from elastic_ext.control_channel import (
    BEAT,
    CONTROL_DIR_ENV,
    DIR_PREFIX,
    DONE,
    DOORBELL,
    LEAVING,
    NOTICE,
    PEER_LOST,
    PREEMPT,
    PROGRESS,
    ROUND_FILE,
    SETUP_FAULT,
    STATE_SUBDIR,
    atomic_write,
    node_memory_directory,
    record_notice,
    remove_abandoned,
    ring,
)
from elastic_ext.procinfo import process_state
from elastic_ext.rendezvous.protocol.hang import Beacon

logger = logging.getLogger(__name__)


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
            path = Path(tempfile.mkdtemp(prefix=f"{DIR_PREFIX}{os.getpid()}-", dir=base))
            os.environ[CONTROL_DIR_ENV] = str(path)
            # torch's agent skips the rendezvous shutdown when a signal stops it, so the
            # state kept in node memory must not depend on it to be freed.
            atexit.register(self.close)
        self.path = path
        (self.path / STATE_SUBDIR).mkdir(mode=0o700, parents=True, exist_ok=True)
        if not (self.path / DOORBELL).exists():
            os.mkfifo(self.path / DOORBELL, 0o600)
        self.on_notice: Callable[[], None] | None = None
        """Called after the agent's own notice is recorded (the keeper acts on it at once)."""
        self._caught: int | None = None  # the signal ``catch_preemption`` took

    def publish_round(self, round_: int) -> None:
        for stale in [*self.path.glob("fault-*"), *self.path.glob(f"{PEER_LOST}*"),
                      *self.path.glob(f"{SETUP_FAULT}*"), *self.path.glob(f"{LEAVING}*"),
                      *self.path.glob(f"{PROGRESS}*"), *self.path.glob(f"{BEAT}*")]:
            stale.unlink(missing_ok=True)
        atomic_write(self.path / ROUND_FILE, str(round_))

    def publish_preemption(self, why: str) -> None:
        """Tell the workers to stop at their next step boundary with a durable snapshot,
        for this agent's life: the workers running now see it at their next boundary,
        workers started later at their first (the whole job stops: ``drain.py``)."""
        atomic_write(self.path / PREEMPT, why[:100])

    def notice(self) -> str | None:
        """The preemption notice this node got (the agent's signal, or a worker's report),
        if any; the keeper settles it with the other nodes' (``drain.py``)."""
        try:
            return (self.path / NOTICE).read_text() or "preemption notice"
        except OSError:
            return None

    def wait_for_notice(self, stopped: threading.Event) -> bool:
        """Block until this node has a notice (True), or until ``stopped`` is set and
        :meth:`ring` called (False). A read of the doorbell FIFO, which whoever records a
        notice rings: a wait, not a look at the directory every few milliseconds (which
        at hundreds of agents per machine is thousands of wake-ups a second)."""
        try:  # read and write: our own writer keeps the FIFO from ever reading end of file
            bell = os.open(self.path / DOORBELL, os.O_RDWR)
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
        ring(self.path)

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
            if record_notice(self.path, f"{name} to the agent"):
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
        round_ = (self.path / ROUND_FILE).read_text().strip()
        atomic_write(self.path / f"{PROGRESS}{round_}", "")

    def progress_reported(self, round_: int) -> bool:
        """Whether a worker of ``round_`` completed a training step (``report_progress``)."""
        return (self.path / f"{PROGRESS}{round_}").exists()

    def done_reported(self) -> bool:
        """Whether a worker said training completed (``report_done``)."""
        return (self.path / DONE).exists()

    def publish_leaving(self, round_: int, reason: str) -> None:
        """Tell the workers of ``round_`` that the SIGTERM coming is this agent restarting
        them for a new round (``reason``: the keeper's), not the job being stopped: the
        state kept on the node is enough, no durable snapshot is needed."""
        atomic_write(self.path / f"{LEAVING}{round_}", reason[:100])

    def publish_peer_lost(self, round_: int, why: str) -> None:
        """Tell the workers of ``round_`` that a peer is dead or hung: the stop that follows
        cannot wait for a step boundary (every collective would wait on that peer)."""
        atomic_write(self.path / f"{PEER_LOST}{round_}", why[:500])

    def fault_reported(self, round_: int) -> str | None:
        """The reason a worker gave for a peer fault in ``round_``, if any. Asked ten times
        a second by every agent (``num_nodes_waiting``), so by name, not through pathlib:
        an idle agent spent most of its CPU building paths here (a py-spy profile)."""
        text = _text_of(f"{self.path}/fault-{round_}")
        return None if text is None else text or "peer fault"

    def setup_fault_reported(self, round_: int) -> str | None:
        """What a worker's launcher said about a fault of the node's own machinery (the
        warm-start server died) in ``round_``, if anything."""
        text = _text_of(f"{self.path}/{SETUP_FAULT}{round_}")
        return None if text is None else text or "setup fault"

    def leave_the_job(self, why: str) -> None:
        """This node leaves the job as on a preemption notice (the others train on without
        it, or the whole job stops with a snapshot if they would be too few: ``drain.py``)."""
        if record_notice(self.path, why) and self.on_notice is not None:
            self.on_notice()

    def beacons(self) -> list[Beacon]:
        """What this agent's workers last beat (``worker/progress.py``), with their
        processes' state as ``/proc`` says now; a beacon that cannot be read is skipped."""
        out: list[Beacon] = []
        now = time.time()
        try:
            with os.scandir(self.path) as entries:
                beats = [entry for entry in entries if entry.name.startswith(BEAT)]
        except FileNotFoundError:  # the agent is closing
            return out
        for entry in beats:
            try:
                with open(entry.path) as file:
                    doc = json.loads(file.read())
                pid = int(doc["pid"])
                out.append(Beacon(
                    local_rank=int(entry.name[len(BEAT):]), pid=pid, round=int(doc["round"]),
                    step=int(doc["step"]), steps_in_round=int(doc["steps_in_round"]),
                    step_s=None if doc["step_s"] is None else float(doc["step_s"]),
                    own_s=None if doc.get("own_s") is None else float(doc["own_s"]),
                    paused=bool(doc["paused"]), waiting=bool(doc["waiting"]),
                    where=str(doc["where"]), backend=str(doc["backend"]),
                    silent_s=max(0.0, now - float(doc["at"])), process=process_state(pid)))
            except (OSError, ValueError, KeyError, TypeError):
                continue
        return out

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


def _text_of(name: str) -> str | None:
    """The file's text; None when there is no such file."""
    try:
        with open(name) as file:
            return file.read()
    except FileNotFoundError:
        return None
