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

from elastic_ext.rendezvous.backend import StoreBackend, Token
from elastic_ext.rendezvous.errors import (
    JobFinishedError,
    NodeExcludedError,
    RestartBudgetExhaustedError,
    StoreUnavailableError,
)
from elastic_ext.rendezvous.events import EventKind, EventLog
from elastic_ext.rendezvous.keeper import Keeper
from elastic_ext.rendezvous.liveness import LEFT
from elastic_ext.rendezvous.policy import BudgetSpent, Closed, Decision, Excluded, Finished
from elastic_ext.rendezvous.settings import Settings
from elastic_ext.rendezvous.state import RunState, Status

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
                 events: EventLog) -> None:
        self._node = node
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
        spent; if the workers of the round it last joined (``completed``) succeeded
        (``succeeded``, asked only then) the run is finished. The last node out removes
        the run's keys.
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
                    and state.generation == generation)
            self._keeper.stop()
            self._backend.leave(self._node)
            self._events.emit(EventKind.LEFT, f"node {self._node} left")
            self._remove_run_if_everyone_left()
            return True
        except Exception as exc:  # leaving is best effort: the heartbeat expires anyway
            logger.warning("etcd-ext: could not announce our exit: %s", exc)
            return False

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
        if isinstance(decision, Excluded):
            message = (f"etcd-ext run {run_id}: node {self._node} was left "
                       f"out of the job: {decision.state.excluded[self._node]}. Its workers "
                       "cannot train with nodes that cannot reach it: check the network "
                       "between the nodes (firewall, routes, --local-addr), then start it "
                       "again to rejoin")
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
        """The last agent to leave removes the run's keys, so a finished job leaves nothing.

        Each agent marks itself left before it looks, so of agents leaving together the
        last one sees all the others gone. A crashed job's keys stay until a new job
        with the same run id finds every node dead and starts a new generation.
        """
        state, _ = read_state(self._backend)
        if state is None:
            return
        if self._all_gone(state.known_nodes() - {self._node}):
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
        retrying = Retrying(stop=stop_after_delay(self._settings.timeouts.close),
                            wait=wait_fixed(0.1),
                            retry=retry_if_exception_type(StoreUnavailableError), reraise=True)
        for attempt in retrying:
            with attempt:
                while True:
                    state, token = read_state(self._backend)
                    if state is None or state.status is status or not only_if(state):
                        return
                    result = self._backend.set_state(
                        replace(state, status=status, note=note).to_bytes(), token)
                    if result is not None and result[2]:
                        self._events.emit(kind, note, note=note, status=status.value)
                        return
