"""What an agent tells about the rendezvous: a log line, torch's event, and a JSON line.

Operators read the log line (``etcd-ext event: ...``). Tools read the JSON lines
that ``--rdzv-conf events_file=PATH`` turns on, one object per event with ``time``,
``run_id``, ``node``, ``pid``, ``event`` (an :class:`EventKind` value), ``message``
and the fields of that kind, so nothing has to parse log text.
"""

from __future__ import annotations

import enum
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from torch.distributed.elastic.events import NodeState, construct_and_record_rdzv_event

logger = logging.getLogger(__name__)


class EventKind(str, enum.Enum):
    """The kinds of event, with the fields each carries besides the common ones."""

    STARTED = "started"  # store, hosts_store: this agent reached the store
    STATE = "state"  # note: this agent changed the run's state (round opened or closed, ...)
    JOINED = "joined"  # round, rank, world_size, master_addr, master_port
    LEAVING_ROUND = "leaving_round"  # round, why, reason: this agent saw a reason to restart
    RESTART = "restart"  # after_round, why: this agent is back in the rendezvous
    NODE_DEAD = "node_dead"  # peer: its heartbeat stopped moving
    NODE_LEFT = "node_left"  # peer: it left cleanly
    BUDGET_SPENT = "budget_spent"  # note: the job-wide restart budget is spent
    UNREACHABLE = "unreachable"  # peers, round: those nodes did not answer this agent at all
    EXCLUDED = "excluded"  # why: the other nodes cannot reach this one; it leaves the job
    FINISHED_AWAY = "finished_away"  # the job finished while this node was away; it exits
    NOTICE = "notice"  # why: a preemption notice reached this node (``drain.py``)
    LEFT_ON_NOTICE = "left_on_notice"  # why: this node leaves the job; the others train on
    JOB_STOPPING = "job_stopping"  # why: the whole job stops with a durable snapshot
    LEFT = "left"  # this agent left the run
    HUNG = "hung"  # why, culprits: no training step for longer than the hang limit
    SLOW = "slow"  # peer, own_s, others_s, step_s, gain, dropped: a straggler (``straggler.py``)


_NODE_STATES = {EventKind.JOINED: NodeState.RUNNING, EventKind.BUDGET_SPENT: NodeState.FAILED,
                EventKind.EXCLUDED: NodeState.FAILED, EventKind.LEFT: NodeState.SUCCEEDED}


class EventLog:
    """One agent's events; safe to use from the keeper thread and the agent's thread."""

    def __init__(self, run_id: str, node: str, hostname: str, path: Path | None = None,
                 listeners: Sequence[Callable[[EventKind, Mapping[str, Any]], None]] = ()
                 ) -> None:
        self._run_id = run_id
        self._node = node
        self._hostname = hostname
        self._listeners = tuple(listeners)
        self._lock = threading.Lock()
        self._fd: int | None = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def emit(self, kind: EventKind, message: str, **fields: Any) -> None:
        """Log ``message``, record it as torch's rendezvous event, and append the JSON line."""
        logger.info("etcd-ext event: %s", message)
        try:
            construct_and_record_rdzv_event(
                run_id=self._run_id, message=message,
                node_state=_NODE_STATES.get(kind, NodeState.RUNNING),
                name=f"etcd-ext.{self._node}", hostname=self._hostname, pid=os.getpid(),
                rank=fields.get("rank"))
        except Exception:  # events are best effort; never fail a rendezvous over them
            logger.debug("could not record rendezvous event", exc_info=True)
        for listener in self._listeners:
            try:
                listener(kind, fields)
            except Exception:
                logger.warning("etcd-ext: an event listener failed on %s", kind.value,
                               exc_info=True)
        with self._lock:
            if self._fd is None:
                return
            record = {"time": time.time(), "run_id": self._run_id, "node": self._node,
                      "pid": os.getpid(), "event": kind.value, "message": message, **fields}
            try:  # one write of one line with O_APPEND: lines of concurrent writers never mix
                os.write(self._fd, (json.dumps(record) + "\n").encode())
            except OSError as exc:
                logger.warning("etcd-ext: cannot append to the events file, stopping: %s", exc)
                self._close_locked()

    def close(self) -> None:
        with self._lock:
            self._close_locked()

    def _close_locked(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

