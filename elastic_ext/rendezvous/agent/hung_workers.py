"""What an agent does to its own workers once its round is judged hung (``protocol/hang.py``)
and torch's agent has read the pressure: torch stops the workers next, on the free path,
with SIGTERM and 30 s before SIGKILL, which a stopped or deadlocked worker would spend.
"""

from __future__ import annotations

import logging
import os
import signal
import threading

from elastic_ext.agent.control import AgentControl
from elastic_ext.procinfo import pid_alive
from elastic_ext.rendezvous.agent.events import EventKind, EventLog
from elastic_ext.rendezvous.protocol.hang import BLAMES_TO_LEAVE, Hung

logger = logging.getLogger(__name__)

STOP_GRACE_S = 3.5
"""How long this node's other workers get to leave on torch's SIGTERM (the workers' own
stop grace is 3 s) before they are killed too."""


def kill_quietly(pid: int, *, only_if_alive: bool = False) -> None:
    """SIGKILL ``pid`` (it may have exited meanwhile: then nothing, and with
    ``only_if_alive`` not a word)."""
    if only_if_alive and not pid_alive(pid):
        return
    try:
        os.kill(pid, signal.SIGKILL)
        logger.warning("etcd-ext: killed hung worker pid %d", pid)
    except (ProcessLookupError, PermissionError) as exc:
        logger.info("etcd-ext: could not kill hung worker pid %d: %s", pid, exc)


def stop_hung_workers(hung: Hung, *, leave_the_job: bool, events: EventLog,
                      control: AgentControl) -> None:
    """Kill the culprits now (a stopped process keeps torch's SIGTERM pending), the other
    workers if they are still there after ``STOP_GRACE_S`` (they were told the peers are
    lost and leave at once unless they are stuck too), and when a culprit cannot be killed,
    or this node was to blame ``BLAMES_TO_LEAVE`` times in a row, take the node out of the
    job as a preemption notice would (``drain.py``)."""
    events.emit(EventKind.HUNG, f"round hung: {hung.why}", why=hung.why,
                culprits=[c.how for c in hung.culprits])
    culprits = {c.pid for c in hung.culprits}
    for culprit in hung.culprits:
        if culprit.killable:
            kill_quietly(culprit.pid)
    rest = [pid for pid in hung.workers if pid not in culprits]

    def kill_the_rest() -> None:
        for pid in rest:
            kill_quietly(pid, only_if_alive=True)

    timer = threading.Timer(STOP_GRACE_S, kill_the_rest)
    timer.daemon = True
    timer.start()
    if hung.unkillable or leave_the_job:
        why = ("a worker cannot be killed" if hung.unkillable
               else f"blamed for {BLAMES_TO_LEAVE} hangs in a row")
        logger.error("etcd-ext: this node leaves the job: %s (%s)", why, hung.why)
        control.leave_the_job(f"hang: {why}")
