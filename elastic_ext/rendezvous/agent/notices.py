"""The agent's part in preemption notices: carry this node's notice to the run's state,
settle it with the other nodes' (the pure rules are ``drain.py``), and pass a whole-job
stop on to the workers. The keeper calls it at every tick, off its lock.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from elastic_ext.agent.control import AgentControl
from elastic_ext.rendezvous.agent.events import EventKind, EventLog
from elastic_ext.rendezvous.protocol.clock import Clock
from elastic_ext.rendezvous.protocol.drain import NOTICE_SETTLE_S, settled, with_notice
from elastic_ext.rendezvous.protocol.head import Head
from elastic_ext.rendezvous.protocol.policy import Limits
from elastic_ext.rendezvous.protocol.state import RunState
from elastic_ext.rendezvous.stores.contract import StateDocument

logger = logging.getLogger(__name__)

NOTICE_FALLBACK_S = 2.0
"""A notice the store cannot take this long stops this node's workers with a durable
snapshot at their next step boundary, as without other nodes to settle it with."""


class NoticeRelay:
    """One agent's notice, from its signal (or a worker's report) to the run's state.

    ``wake`` asks the keeper for a tick now: when the agent's own signal came or a worker
    passed a notice on (``start`` watches for it), after a write, and once the notice has
    waited ``NOTICE_SETTLE_S``.
    """

    def __init__(self, backend: StateDocument, node: str, *, limits: Limits,
                 control: AgentControl, events: EventLog, clock: Clock,
                 wake: Callable[[], None]) -> None:
        self._backend = backend
        self._node = node
        self._limits = limits
        self._control = control
        self._events = events
        self._clock = clock
        self._wake = wake
        self._seen: float | None = None  # when this node's notice was first seen
        self._recorded: float | None = None  # when it was written to the state
        self._stop_told = False  # the workers were told the job stops (durable snapshot)
        self._stop_checked: object | None = None  # the state token whose stop was not ours
        self._closed = threading.Event()
        control.on_notice = wake

    def start(self) -> None:
        """Wait for a notice a worker passes on (the agent's own wakes the keeper itself):
        a thread blocked on the control directory's doorbell (``AgentControl.ring``)."""
        def watch() -> None:
            if self._control.wait_for_notice(self._closed):
                self._wake()
        threading.Thread(target=watch, name="etcd-ext-notices", daemon=True).start()

    def close(self) -> None:
        self._closed.set()
        self._control.ring()

    def act(self, head: Head | None, token: object | None, dead: frozenset[str],
            read_state: Callable[[], tuple[RunState | None, object | None]]) -> None:
        """Pass a whole-job stop on to the workers; record this node's notice in the state,
        then settle it ``NOTICE_SETTLE_S`` later (``drain.py``). Decided on the state's
        head (``head.py``); the whole state is read (``read_state``) only for a stop or a
        notice of this node's."""
        if head is not None and head.stop:
            if self._stop_told or self._stop_checked == token:
                return
            # Only the stop of a job this node trains in (this round or the last): a new
            # job's agent may read the old job's state, even wait to join it, before it
            # starts a new generation, and its workers must not stop at their first step.
            self._stop_checked = token
            state, _ = read_state()
            if state is not None and state.stop and \
                    self._node in {*state.members, *state.previous}:
                self._stop_told = True
                self._control.publish_preemption(state.stop)
                self._events.emit(EventKind.JOB_STOPPING, state.stop, why=state.stop)
            return
        why = self._notice()
        if why is None or self._stop_told or head is None or self._node in head.leaving:
            return
        state, token = read_state()
        if state is None:
            return
        if self._recorded is None:
            recorded = with_notice(state, self._node, why)
            if recorded is None or self._write(recorded, token):
                self._recorded = self._clock.monotonic()
                threading.Timer(NOTICE_SETTLE_S, self._wake).start()
        elif self._clock.monotonic() - self._recorded >= NOTICE_SETTLE_S:
            decided = settled(state, dead, self._limits)
            if decided is not None:
                self._write(decided, token)

    def without_store(self) -> None:
        """A notice the store has not taken for ``NOTICE_FALLBACK_S``: nobody can settle
        it, so this node's workers stop with a durable snapshot at their next boundary."""
        why = self._notice()
        if why is None or self._stop_told or self._recorded is not None or self._seen is None \
                or self._clock.monotonic() - self._seen < NOTICE_FALLBACK_S:
            return
        self._stop_told = True
        message = (f"preemption notice ({why}) and the store unreachable for "
                   f"{NOTICE_FALLBACK_S:.0f}s: this node's workers stop with a snapshot")
        logger.warning("etcd-ext: %s", message)
        self._control.publish_preemption(message)

    def _notice(self) -> str | None:
        """This node's notice, if any (and the event, the first time)."""
        why = self._control.notice()
        if why is not None and self._seen is None:
            self._seen = self._clock.monotonic()
            self._events.emit(EventKind.NOTICE, f"preemption notice to {self._node}: {why}",
                              why=why)
        return why

    def _write(self, state: RunState, token: object | None) -> bool:
        """Compare-and-swap ``state``; True when written (then the keeper ticks at once)."""
        try:
            result = self._backend.set_state(state.to_bytes(), token)
        except Exception as exc:  # the next tick tries again
            logger.debug("etcd-ext: could not write the state: %s", exc)
            return False
        written = result is not None and result[2]
        if written:
            logger.info("etcd-ext: %s", state.note)
            self._wake()
        return written
