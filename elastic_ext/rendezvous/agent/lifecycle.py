"""The run's lifecycle as one node sees it: marking the run finished, budget-spent or
closed, leaving it, the last node out removing the run's keys, and the errors that end
a node's part (its job finished while it was away, the budget is spent, the run closed,
the node left out).

A status change is compare-and-swapped like every state write and retried through store
outages for ``close_timeout``; leaving is best effort (a silent node's heartbeat expires
anyway).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import replace

from tenacity import Retrying, retry_if_exception_type, stop_after_delay, wait_fixed
from torch.distributed.elastic.rendezvous.api import RendezvousClosedError

from elastic_ext.net import describe_interface
from elastic_ext.rendezvous.agent.events import EventKind, EventLog
from elastic_ext.rendezvous.agent.keeper import Keeper
from elastic_ext.rendezvous.errors import (
    JobFinishedError,
    NodeExcludedError,
    NodeLeftError,
    RestartBudgetExhaustedError,
    StoreUnavailableError,
)
from elastic_ext.rendezvous.protocol.liveness import LEFT
from elastic_ext.rendezvous.protocol.policy import (
    BudgetSpent,
    Closed,
    Decision,
    Excluded,
    Finished,
    Left,
)
from elastic_ext.rendezvous.protocol.state import RunState, Status
from elastic_ext.rendezvous.settings import Settings
from elastic_ext.rendezvous.stores.contract import StoreBackend, Token
from elastic_ext.torch_compat import check_in_at_exit_barrier

logger = logging.getLogger(__name__)


def read_state(backend: StoreBackend) -> tuple[RunState | None, Token | None]:
    """The run's state and the token to compare-and-swap it with; ``(None, None)`` when
    the run has none (not started yet, or its keys were removed).

    Raises:
        StoreUnavailableError: the store could not be reached.
        CorruptStateError: the state key holds something else.
    """
    current = backend.get_state()
    if current is None:
        return None, None
    raw, token = current
    return RunState.from_bytes(raw), token


class Lifecycle:
    """How one node ends its part in the run, and what it tells the others on the way."""

    def __init__(self, node: str, settings: Settings, backend: StoreBackend, keeper: Keeper,
                 events: EventLog, addr: str = "") -> None:
        """``addr``: the address this node published for its workers, named when it is
        left out for being unreachable."""
        self._node = node
        self._addr = addr
        self._settings = settings
        self._backend = backend
        self._keeper = keeper
        self._events = events

    def is_closed(self) -> bool:
        """Whether an operator closed the run for good (``close``): no agent rejoins it.

        Raises:
            StoreUnavailableError: the store could not be reached.
        """
        state, _ = read_state(self._backend)
        return state is not None and state.status is Status.CLOSED

    def close(self) -> None:
        """Close the run for good, so that every agent's next rendezvous ends it.

        Raises:
            StoreUnavailableError: the store stayed unreachable for ``close_timeout``.
        """
        self._update_status(Status.CLOSED, f"closed by {self._node}")

    def leave(self, completed: tuple[str, int] | None, *, gave_up: bool,
              succeeded: Callable[[], bool]) -> bool:
        """Leave the run; True if the others were told, False if the store could not be
        (never raises: the heartbeat expires anyway).

        If this node's workers failed for good (``gave_up``) the whole job's budget is
        spent; if the workers of the round it last joined (``completed``) completed the
        training (``succeeded``, asked only then) the run is finished, unless the job was
        stopping or this node leaving on a preemption notice. The last node out of a
        finished or closed run removes its keys.
        """
        try:
            if gave_up and self._settings.max_restarts is not None:
                self._update_status(Status.BUDGET_SPENT,
                                    f"restart budget spent: node {self._node} used up "
                                    f"--max-restarts={self._settings.max_restarts} and left")
            elif completed is not None and succeeded():
                generation = completed[0]
                self._update_status(
                    Status.FINISHED, f"finished: the workers of round {completed[1]} "
                                     f"completed (node {self._node})",
                    only_if=lambda state: state.status is Status.ACTIVE
                    and state.generation == generation and not state.stop
                    and self._node not in state.leaving)
            self._keeper.stop()
            self._backend.leave(self._node)
            self._events.emit(EventKind.LEFT, f"node {self._node} left")
            self._remove_run_if_everyone_left()
            return True
        except Exception as exc:  # leaving is best effort: the heartbeat expires anyway
            logger.warning("etcd-ext: could not announce our exit: %s", exc)
            return False

    def leave_on_signal(self, completed: tuple[str, int] | None, name: str) -> str | None:
        """After signal ``name`` stopped torch's agent and its workers (a pod deleted, one
        node's job cancelled): leave the run, so the others restart at once, and check in at
        the round's exit barrier, so that none waits for this node there. Returns the line
        to end on when the others train on without this node; None when they cannot (fewer
        than MIN would be left: the whole job stops with a durable snapshot) or it is not
        known. Never raises."""
        try:
            state, _ = read_state(self._backend)
            if completed is not None and state is not None \
                    and state.generation == completed[0] and self._node in state.order:
                check_in_at_exit_barrier(self._backend.round_store(*completed), len(state.order))
        except Exception as exc:
            logger.warning("etcd-ext: could not read the run before leaving: %s", exc)
            state = None
        if not self.leave(completed, gave_up=False, succeeded=lambda: False) or state is None \
                or completed is None or state.generation != completed[0] \
                or state.status is not Status.ACTIVE or state.stop:
            return None
        others = set(state.order) - {self._node}
        others -= self._keeper.dead_among(others)
        if len(others) >= self._settings.min_nodes:
            message = (f"etcd-ext: {name} stopped this node's agent; node {self._node} left "
                       f"the job, the other {len(others)} node(s) train on")
            self._events.emit(EventKind.LEFT_ON_NOTICE, message, why=name)
            return message
        try:
            self.stop_job(f"{name} to node {self._node}'s agent: the {len(others)} node(s) "
                          f"left would be fewer than --nnodes MIN={self._settings.min_nodes}; "
                          "the whole job stops with a durable snapshot")
        except Exception as exc:
            logger.warning("etcd-ext: could not stop the job: %s", exc)
        return None

    def last_round_left(self, last_order: Iterable[str]) -> bool:
        """Whether every other node of our last round (``last_order``) left or lost its
        heartbeat key: a missing state then means the last of them removed the finished
        run's keys, not that a new job is to start.

        Raises:
            StoreUnavailableError: the store could not be reached.
        """
        return self._all_gone(set(last_order) - {self._node})

    def stop_if_over(self, decision: Decision, completed: tuple[str, int] | None) -> None:
        """Raise what torch's agent stops on when ``decision`` ends this node's part in the
        job; else nothing. ``completed`` is the round this node last joined.

        Raises:
            RestartBudgetExhaustedError: the job's restart budget is spent.
            RendezvousClosedError: an operator closed the run.
            JobFinishedError: the job finished while this node was away.
            NodeLeftError: this node left the job on a preemption notice.
            NodeExcludedError: the other nodes cannot reach this one.
        """
        run_id = self._settings.run_id
        if isinstance(decision, BudgetSpent):
            message = (f"etcd-ext run {run_id}: {decision.state.note}; "
                       "every agent stops. Fix the failing workers, then start the job "
                       "again (a new job resets the budget)")
            logger.error(message)
            self._events.emit(EventKind.BUDGET_SPENT, message, note=decision.state.note)
            raise RestartBudgetExhaustedError(message)
        if isinstance(decision, Closed):
            raise RendezvousClosedError(f"etcd-ext run {run_id} was closed")
        if isinstance(decision, Finished):
            raise self.finished_away(decision.state, completed)
        if isinstance(decision, Left):
            message = (f"etcd-ext run {run_id}: node {self._node} left the job on a preemption "
                       f"notice ({decision.state.leaving[self._node]}); the other nodes train "
                       "on without it")
            logger.warning(message)
            self._events.emit(EventKind.LEFT_ON_NOTICE, message,
                              why=decision.state.leaving[self._node])
            raise NodeLeftError(message)
        if isinstance(decision, Excluded):
            message = (f"etcd-ext run {run_id}: node {self._node} was left "
                       f"out of the job: {decision.state.excluded[self._node]}. Its workers "
                       "cannot train with nodes that cannot reach it"
                       + (f" at {self._addr}, on {describe_interface(self._addr)}"
                          if self._addr else "")
                       + ": check the network between the nodes (firewall, routes, "
                       "--local-addr or ELASTIC_EXT_IFNAME), then start it again to rejoin")
            logger.error(message)
            self._events.emit(EventKind.EXCLUDED, message, why=decision.state.excluded[self._node])
            raise NodeExcludedError(message)

    def finished_away(self, state: RunState | None,
                      completed: tuple[str, int] | None) -> JobFinishedError:
        """The error that ends this node's part when its job finished while it was away
        (``state`` marked finished, or None when the run's keys are already removed),
        logged and recorded, for the caller to raise: nothing is left to rejoin."""
        after = f"round {completed[1]}" if completed else "the rendezvous"
        how = state.note if state is not None else "its keys are removed"
        message = (f"etcd-ext run {self._settings.run_id}: the job finished while this node "
                   f"was away (after {after}; {how}); nothing left to do here")
        logger.warning(message)
        self._events.emit(EventKind.FINISHED_AWAY, message)
        return JobFinishedError(message)

    def _remove_run_if_everyone_left(self) -> None:
        """The last agent to leave a finished (or closed) run removes its keys, so a finished
        job leaves nothing.

        Each agent marks itself left before it looks, so of agents leaving together the
        last one sees all the others gone; a node its keeper judged dead (its heartbeat key
        outlives it by the lease) counts as gone. The keys of a run that did not finish
        stay: a node that was away (frozen, cut off) and comes back must read why it ended
        (the budget spent, say), not take a missing state for a finish; a new job with
        the same run id finds every node of it gone and starts a new generation.
        """
        state, _ = read_state(self._backend)
        if state is None or state.status not in (Status.FINISHED, Status.CLOSED):
            return
        others = state.known_nodes() - {self._node}
        if self._all_gone(others - self._keeper.dead_among(others)):
            self._backend.remove_run()
            logger.info("etcd-ext: last node out; removed the keys of run %s",
                        self._settings.run_id)

    def _all_gone(self, nodes: set[str]) -> bool:
        """Whether each of ``nodes`` left (its heartbeat says so) or has no heartbeat key."""
        beats = self._backend.read_beats(sorted(nodes))
        return all(value is None or value == LEFT for value in beats.values())

    def _update_status(self, status: Status, note: str,
                       only_if: Callable[[RunState], bool] = lambda state: True) -> None:
        """Compare-and-swap the run's ``status`` (with ``note``) unless it has it already,
        there is no state, or ``only_if`` says no; retried through outages."""
        kind = EventKind.BUDGET_SPENT if status is Status.BUDGET_SPENT else EventKind.STATE
        if self._update(lambda state: replace(state, status=status, note=note)
                        if state.status is not status and only_if(state) else None):
            self._events.emit(kind, note, note=note, status=status.value)

    def stop_job(self, why: str) -> None:
        """Stop the whole job with a durable snapshot (``drain.py``): every agent tells its
        workers, which commit at their next step boundary and exit 0.

        Raises:
            StoreUnavailableError: the store stayed unreachable for ``close_timeout``.
        """
        if self._update(lambda state: replace(state, stop=why, notices={}, note=why)
                        if state.status is Status.ACTIVE and not state.stop else None):
            self._events.emit(EventKind.JOB_STOPPING, why, why=why)

    def _update(self, change: Callable[[RunState], RunState | None]) -> bool:
        """Compare-and-swap ``change(state)`` until it is written (True) or there is nothing
        to write (``change`` gives None, or there is no state); retried through outages for
        ``close_timeout``."""
        retrying = Retrying(stop=stop_after_delay(self._settings.timeouts.close),
                            wait=wait_fixed(0.1),
                            retry=retry_if_exception_type(StoreUnavailableError), reraise=True)
        for attempt in retrying:
            with attempt:
                while True:
                    state, token = read_state(self._backend)
                    changed = change(state) if state is not None else None
                    if changed is None:
                        return False
                    result = self._backend.set_state(changed.to_bytes(), token)
                    if result is not None and result[2]:
                        return True
        return False
