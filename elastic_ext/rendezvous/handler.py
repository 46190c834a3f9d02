"""The ``etcd-ext`` rendezvous handler torch's elastic agent drives.

Each call to ``next_rendezvous`` runs the pure ``decide`` over the run's state until
this node is in a closed round. In an open round only its closer decides on every join
(``joins.py``); the others join with one key write and wait on the state (a watch on
etcd). The keeper thread (``keeper.py``) tells torch's agent,
through ``num_nodes_waiting``, when to leave it. The store is reached only through
the ``StoreBackend`` contract, and time only through the injected ``Clock``, so the
whole handler runs in-process against an in-memory backend in the fast tests.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Protocol

from tenacity import Retrying, retry_if_exception_type, stop_after_delay, wait_fixed
from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)

from elastic_ext.control import AgentControl
from elastic_ext.net import free_port
from elastic_ext.rendezvous.backend import StoreBackend, Token, presence_port_of
from elastic_ext.rendezvous.clock import SYSTEM_CLOCK, Clock
from elastic_ext.rendezvous.errors import (
    JobFinishedError,
    NodeExcludedError,
    RestartBudgetExhaustedError,
    StoreUnavailableError,
)
from elastic_ext.rendezvous.events import EventKind, EventLog
from elastic_ext.rendezvous.joins import (
    JoinEntry,
    closer_of,
    is_own_join,
    removed_members,
    with_joins,
)
from elastic_ext.rendezvous.keeper import Keeper
from elastic_ext.rendezvous.liveness import LEFT
from elastic_ext.rendezvous.prometheus import AgentMetrics
from elastic_ext.rendezvous.settings import Settings
from elastic_ext.rendezvous.state import (
    BudgetSpent,
    Closed,
    Decision,
    Excluded,
    Finished,
    Joined,
    Limits,
    NodeInfo,
    Phase,
    Reason,
    RunState,
    Status,
    View,
    Write,
    decide,
)
from elastic_ext.torch_compat import agent_gave_up, workers_succeeded

logger = logging.getLogger(__name__)

_POLL = 0.05
_WAKE_S = 1.0
"""How long a node in an open round it does not close waits on the state before it looks
whether the closer is still alive (the wait ends at once when the state changes)."""


def make_node_id() -> str:
    host = "".join(c if c.isalnum() or c in "-_." else "-" for c in socket.gethostname())[:40]
    return f"{host}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


STARTER_READY_TIMEOUT_S = 60.0
"""The longest a node joining a running job waits for its warm-start server."""


class WorkerStarter(Protocol):
    """What the agent owns to start its workers (the warm-start server)."""

    def wait_ready(self, timeout: float) -> bool:
        """Block until workers can start fast, at most ``timeout`` seconds; False if not."""

    def close(self) -> None:
        """Stop it; the agent is leaving."""


class EtcdExtRendezvousHandler(RendezvousHandler):
    """torch's ``RendezvousHandler`` over a :class:`StoreBackend`.

    ``node_id``, ``control``, ``clock`` and ``keeper_thread=False`` are for tests: a
    fixed name, a control directory of their own, simulated time, and a keeper they
    tick themselves. ``starter`` is what starts the workers fast (the warm-start
    server): a node joining a running job waits for it before it makes the job restart,
    and it is closed when the handler shuts down.
    """

    def __init__(self, settings: Settings, backend: StoreBackend, *, backend_name: str,
                 events_file: Path | None = None, node_id: str | None = None,
                 control: AgentControl | None = None, clock: Clock = SYSTEM_CLOCK,
                 keeper_thread: bool = True, metrics: AgentMetrics | None = None,
                 starter: WorkerStarter | None = None) -> None:
        self._settings = settings
        self._backend = backend
        self._backend_name = backend_name
        self._node = node_id or make_node_id()
        self._addr = settings.local_addr or socket.getfqdn()
        self._clock = clock
        self._limits = Limits(settings.min_nodes, settings.max_nodes,
                              settings.timeouts.last_call, settings.max_restarts)
        self._control = control or AgentControl()
        self._metrics = metrics
        self._starter = starter
        self._addrs: dict[str, str] = {}  # every node's address seen in the state
        self._events = EventLog(settings.run_id, self._node, self._addr, events_file,
                                listeners=[metrics.on_event] if metrics else [])
        self.keeper = Keeper(backend.clone(), self._node,
                             interval=settings.timeouts.heartbeat_interval,
                             timeout=settings.timeouts.heartbeat, limits=self._limits,
                             control=self._control, events=self._events, clock=clock)
        if metrics is not None:
            metrics.watch_peers(self.keeper.peer_silence)
        self._keeper_thread = keeper_thread
        self._keeper_started = False
        self._completed: tuple[str, int] | None = None
        self._last_order: tuple[str, ...] = ()  # the nodes of the round we last joined
        self._min_reached_at: dict[tuple[str, int], float] = {}
        self._last_written_note = ""
        self._my_join: tuple[str, int] | None = None  # the open round we joined by key
        self._my_join_position = 0
        self._my_join_count = 0  # the round's join keys when ours was written
        self._take_over: tuple[str, int] | None = None  # an open round its closer left idle
        self._joins_read: tuple[tuple[str, int, int, RunState], list[tuple[str, bytes]]] \
            | None = None
        self._events.emit(EventKind.STARTED,
                          f"node {self._node} on the {backend.name} store"
                          + (", which it hosts" if backend.hosts_store else ""),
                          store=backend.name, hosts_store=backend.hosts_store,
                          metrics_port=metrics.port if metrics else None)

    # -- torch's contract ------------------------------------------------------------------
    def get_backend(self) -> str:
        return self._backend_name

    @property
    def use_agent_store(self) -> bool:
        # Workers build their own store at the round's rank-0 node on a fresh port, so a
        # dead rank-0 node or a joining node never leaves them pointing at a stale store.
        return False

    def get_run_id(self) -> str:
        return self._settings.run_id

    @property
    def node_id(self) -> str:
        return self._node

    def next_rendezvous(self) -> RendezvousInfo:
        self._start_keeper()
        if self._completed is None:
            self._wait_for_starter_before_joining_a_running_job()
        pressure = self.keeper.pressure
        reenter = pressure.reason if self._completed else Reason.START
        unreachable: frozenset[str] = frozenset()
        if self._completed:
            why = pressure.why or "this node's workers failed"
            self._events.emit(EventKind.RESTART, f"restart after round {self._completed[1]}: {why}",
                              after_round=self._completed[1], why=why)
            if reenter is Reason.FAILURE or not self.keeper.round_progressed():
                unreachable = self._unreachable_peers()
        self.keeper.watch_round(None)
        my_info = NodeInfo(self._addr, free_port("::" if ":" in self._addr else ""),
                           self.keeper.presence_port)
        my_entry = JoinEntry(my_info, tuple(sorted(unreachable))).to_bytes()
        fresh_generation = uuid.uuid4().hex[:12]
        deadline = self._clock.monotonic() + self._settings.timeouts.join
        last_note = ""
        full_next = False
        self._my_join = None
        known: tuple[RunState | None, Token | None] | None = None  # what our last write saw
        while True:
            try:
                state, token = known if known is not None else self._read()
                known = None
                if state is None and self._completed is not None and self._last_round_left():
                    raise JobFinishedError(self._finished_message(None))
                if state is not None and self._joined_open_round(state) and not full_next \
                        and not self._must_see_the_whole_round(state):
                    known = self._wait_for_the_round(state, token, deadline)
                    continue
                full = full_next or self._must_see_the_whole_round(state)
                full_next = False
                seen = self._with_joins(state) if full else state
                view = View(me=self._node, my_info=my_info,
                            dead=self._dead_or_gone(seen, probe=full), completed=self._completed,
                            min_reached_for=self._min_reached_for(seen),
                            reenter_reason=reenter, fresh_generation=fresh_generation,
                            unreachable=unreachable)
                decision = decide(seen, view, self._limits)
                if isinstance(decision, Write):
                    if seen is not None and is_own_join(seen, decision.state, self._node):
                        self._join(seen, my_entry, again=full)
                    elif not full and self._joins_matter(seen):
                        full_next = True  # decide that on the whole round, joins included
                    else:
                        if seen is not None:
                            self._drop_joins(seen, removed_members(seen, decision.state))
                        known = self._write(decision.state, token)
                    continue
            except StoreUnavailableError as exc:
                self._wait_out_outage(exc, deadline)
                continue
            if isinstance(decision, Joined):
                return self._joined(decision.state)
            self._stop_if_over(decision)
            if state is not None and state.note not in (last_note, self._last_written_note):
                last_note = state.note
                logger.info("etcd-ext: %s", state.note)
            if self._clock.monotonic() > deadline:
                raise RendezvousTimeoutError(self._timeout_message(seen))
            if full:
                self._clock.sleep(_POLL)  # the closer: joins come as keys, not state changes
            else:
                known = self._as_known(self._backend.wait_for_state(token, _WAKE_S, self._clock))

    def _stop_if_over(self, decision: Decision) -> None:
        """Raise what torch's agent stops on when ``decision`` ends this node's part in the
        job (budget spent, run closed, job finished, node left out); else nothing."""
        if isinstance(decision, BudgetSpent):
            message = (f"etcd-ext run {self._settings.run_id}: {decision.state.note}; "
                       "every agent stops. Fix the failing workers, then start the job "
                       "again (a new job resets the budget)")
            logger.error(message)
            self._events.emit(EventKind.BUDGET_SPENT, message, note=decision.state.note)
            raise RestartBudgetExhaustedError(message)
        if isinstance(decision, Closed):
            raise RendezvousClosedError(f"etcd-ext run {self._settings.run_id} was closed")
        if isinstance(decision, Finished):
            raise JobFinishedError(self._finished_message(decision.state))
        if isinstance(decision, Excluded):
            message = (f"etcd-ext run {self._settings.run_id}: node {self._node} was left "
                       f"out of the job: {decision.state.excluded[self._node]}. Its workers "
                       "cannot train with nodes that cannot reach it: check the network "
                       "between the nodes (firewall, routes, --local-addr), then start it "
                       "again to rejoin")
            logger.error(message)
            self._events.emit(EventKind.EXCLUDED, message,
                              why=decision.state.excluded[self._node])
            raise NodeExcludedError(message)

    def is_closed(self) -> bool:
        state, _ = self._read()
        return state is not None and state.status is Status.CLOSED

    def set_closed(self) -> None:
        self._update_status(Status.CLOSED, f"closed by {self._node}")

    def num_nodes_waiting(self) -> int:
        self.keeper.check_worker_report()
        return self.keeper.pressure.count

    def shutdown(self) -> bool:
        """Leave the run. If our workers failed for good, the whole job's budget is spent."""
        gave_up = agent_gave_up()
        try:
            if gave_up and self._settings.max_restarts is not None:
                self._update_status(Status.BUDGET_SPENT,
                                    f"restart budget spent: node {self._node} used up "
                                    f"--max-restarts={self._settings.max_restarts} and left")
            elif self._completed is not None and workers_succeeded():
                generation = self._completed[0]
                self._update_status(
                    Status.FINISHED, f"finished: the workers of round {self._completed[1]} "
                                     f"completed (node {self._node})",
                    only_if=lambda state: state.status is Status.ACTIVE
                    and state.generation == generation)
            self.keeper.stop()
            self._backend.leave(self._node)
            self._events.emit(EventKind.LEFT, f"node {self._node} left")
            self._remove_run_if_everyone_left()
            return True
        except Exception as exc:  # leaving is best effort: the heartbeat expires anyway
            logger.warning("etcd-ext: could not announce our exit: %s", exc)
            return False
        finally:
            self._control.close()
            self._events.close()
            self._backend.close()
            if self._metrics is not None:
                self._metrics.close()
            if self._starter is not None:
                self._starter.close()

    # -- internals ---------------------------------------------------------------------------
    def _wait_out_outage(self, exc: StoreUnavailableError, deadline: float) -> None:
        """Inside a rendezvous an outage is waited out until the join deadline when the
        store can come back (an etcd cluster, an embedded store with other candidate
        hosts to move to); a lone embedded store does not, so losing it ends the
        rendezvous at once."""
        if not self._backend.outages_are_transient or self._clock.monotonic() > deadline:
            raise exc
        logger.warning("etcd-ext: store unreachable, still trying until the join timeout: %s",
                       exc)
        self._clock.sleep(_POLL)

    @staticmethod
    def _joins_matter(state: RunState | None) -> bool:
        """Whether ``state`` is an open round, whose members are partly join keys."""
        return state is not None and state.phase is Phase.OPEN \
            and state.status is Status.ACTIVE

    def _joined_open_round(self, state: RunState | None) -> bool:
        """Whether ``state`` is the open round this node joined by key (``joins.py``)."""
        return state is not None and state.phase is Phase.OPEN \
            and state.status is Status.ACTIVE and self._node not in state.excluded \
            and self._my_join == (state.generation, state.round)

    def _must_see_the_whole_round(self, state: RunState | None) -> bool:
        """Whether this node decides on the open round with every join read: it is the
        round's closer, the closer is dead, or its own join filled the round. Everyone
        else decides on the state alone: joining is one key write, then it waits."""
        if state is None or state.phase is not Phase.OPEN or state.status is not Status.ACTIVE:
            return False
        closer = closer_of(state)
        if closer is None or closer == self._node or self.keeper.dead_among({closer}) \
                or self._take_over == (state.generation, state.round):
            return True
        return self._my_join == (state.generation, state.round) \
            and self._my_join_position >= self._limits.max_nodes

    @staticmethod
    def _as_known(change: bool | tuple[bytes, Token]
                  ) -> tuple[RunState | None, Token | None] | None:
        """The state a wait brought along, if it did (else the loop reads it)."""
        if isinstance(change, tuple):
            return RunState.from_bytes(change[0]), change[1]
        return None

    def _wait_for_the_round(self, state: RunState, token: Token | None, deadline: float
                            ) -> tuple[RunState | None, Token | None] | None:
        """Wait, without reading the round's joins, until the state changes (the new state,
        if the wait brought it along), the closer is judged dead, or the round stops moving
        (no new join) for longer than its closer should take, when this node takes over
        (``_take_over``); a watch on etcd, not a poll. The idle limit grows with this
        node's join position, so that the earliest joiner takes over first rather than
        everyone at once."""
        closer = closer_of(state)
        idle_limit = (self._settings.timeouts.last_call + self._settings.timeouts.heartbeat) \
            * (1 + min(1.0, self._my_join_position / max(1, self._limits.max_nodes)))
        joins = self._my_join_count
        moved_at = self._clock.monotonic()
        while self._clock.monotonic() < deadline:
            change = self._backend.wait_for_state(token, _WAKE_S, self._clock)
            if change or (closer is not None and self.keeper.dead_among({closer})):
                return self._as_known(change)
            count = self._backend.count_joins(state.generation, state.round)
            if count != joins:
                joins, moved_at = count, self._clock.monotonic()
            elif self._clock.monotonic() - moved_at >= idle_limit:
                logger.info("etcd-ext: round %d is still open %.1fs after its last join; "
                            "deciding on it instead of its closer %s", state.round,
                            self._clock.monotonic() - moved_at, closer)
                self._take_over = (state.generation, state.round)
                return None
        raise RendezvousTimeoutError(self._timeout_message(state))

    def _with_joins(self, state: RunState | None) -> RunState | None:
        """``state`` with the open round's join keys merged in; the keeper judges them too
        when this node watches everyone."""
        if state is None or state.phase is not Phase.OPEN or state.status is not Status.ACTIVE:
            return state
        # The closer looks every _POLL: it reads the join keys again only when there are
        # more of them (or the state changed), so a 1,024-node round costs it tens of
        # reads, not one per join.
        key = (state.generation, state.round,
               self._backend.count_joins(state.generation, state.round), state)
        if self._joins_read is None or self._joins_read[0] != key:
            self._joins_read = (key, self._backend.read_joins(state.generation, state.round))
        merged = with_joins(state, self._joins_read[1], self._limits.max_nodes)
        self.keeper.watch_also(merged.known_nodes())
        return merged

    def _join(self, state: RunState, entry: bytes, again: bool) -> None:
        """Join the open round with one key write (``joins.py``), once per round; ``again``
        when the whole round was read and this node is not in it (a node that judged it
        dead dropped its key)."""
        key = (state.generation, state.round)
        if self._my_join == key and not again:
            return
        # Members in the state (the closer) plus the join keys, this one's included: an
        # upper bound of the round's size once this node is in (a merged state counts
        # some twice, which costs one more look at the round, nothing else).
        self._my_join_count = self._backend.join(state.generation, state.round, self._node,
                                                 entry)
        self._my_join_position = len(state.members) + self._my_join_count
        self._my_join = key
        logger.debug("etcd-ext: joined open round %d as number %d", state.round,
                     self._my_join_position)

    def _drop_joins(self, state: RunState, nodes: list[str]) -> None:
        self._joins_read = None
        if nodes:
            self._backend.drop_joins(state.generation, state.round, nodes)

    def _unreachable_peers(self) -> frozenset[str]:
        """The nodes of our last round that do not answer at all, so the next round can
        leave out a node the others cannot reach (``state.unreachable_by_most``)."""
        others = set(self._last_order) - {self._node}
        if not others:
            return frozenset()
        unknown = self.keeper.ports_unknown(others)
        if unknown:
            try:
                self.keeper.learn_ports(self._ports_in(self._backend.read_beats(unknown)))
            except StoreUnavailableError:
                pass  # probe whom we can
        silent = self.keeper.unreachable_among(others, self._addrs)
        if silent:
            self._events.emit(EventKind.UNREACHABLE,
                              f"no answer from {', '.join(sorted(silent))}",
                              peers=sorted(silent), round=self._completed[1]
                              if self._completed else None)
        return silent

    def _last_round_left(self) -> bool:
        """Whether every other node of our last round left or lost its heartbeat key: a
        missing state then means the last of them removed the finished run's keys."""
        others = sorted(set(self._last_order) - {self._node})
        beats = self._backend.read_beats(others)
        return all(value is None or value == LEFT for value in beats.values())

    def _finished_message(self, state: RunState | None) -> str:
        after = f"round {self._completed[1]}" if self._completed else "the rendezvous"
        how = state.note if state is not None else "its keys are removed"
        message = (f"etcd-ext run {self._settings.run_id}: the job finished while this node "
                   f"was away (after {after}; {how}); nothing left to do here")
        logger.warning(message)
        self._events.emit(EventKind.FINISHED_AWAY, message)
        return message

    def _remove_run_if_everyone_left(self) -> None:
        """The last agent to leave removes the run's keys, so a finished job leaves nothing.

        Each agent marks itself left before it looks, so of agents leaving together the
        last one sees all the others gone. A crashed job's keys stay until a new job
        with the same run id finds every node dead and starts a new generation.
        """
        state, _ = self._read()
        if state is None:
            return
        others = sorted(state.known_nodes() - {self._node})
        beats = self._backend.read_beats(others)
        if all(value is None or value == LEFT for value in beats.values()):
            self._backend.remove_run()
            logger.info("etcd-ext: last node out; removed the keys of run %s",
                        self._settings.run_id)

    def _wait_for_starter_before_joining_a_running_job(self) -> None:
        """A newcomer to a job that trains makes every node restart its workers the moment
        it asks to join; it asks once its own workers can start fast, so the others train
        on meanwhile instead of waiting for its imports. (At a job's start everyone waits
        for everyone anyway, so nobody waits for this.)"""
        if self._starter is None:
            return
        try:
            state, _ = self._read()
        except StoreUnavailableError:
            return
        if state is None or state.phase is not Phase.CLOSED or state.status is not Status.ACTIVE \
                or self._node in state.members:
            return
        began = self._clock.monotonic()
        ready = self._starter.wait_ready(STARTER_READY_TIMEOUT_S)
        logger.info("etcd-ext: joining the running job %s after %.1fs for its workers' warm start"
                    "%s", self._settings.run_id, self._clock.monotonic() - began,
                    "" if ready else " (not ready; joining anyway)")

    def _dead_or_gone(self, state: RunState | None, probe: bool) -> frozenset[str]:
        """The keeper's dead, and with ``probe`` (this node sees the whole open round) in a
        round this node waits in, those of the nodes it would wait for whose agent is gone
        for sure (``presence``)."""
        if state is None:
            return frozenset()
        self._learn_addresses(state)
        dead = self.keeper.dead_among(state.known_nodes())
        if not probe or state.phase is not Phase.OPEN or self._node not in state.members:
            return dead
        awaited = (set(state.previous) | set(state.waiting)) - set(state.members) - dead
        awaited.discard(self._node)
        unknown = self.keeper.ports_unknown(awaited)
        if unknown:
            self.keeper.learn_ports(self._ports_in(self._backend.read_beats(unknown)))
        return dead | self.keeper.gone_among(awaited, self._addrs)

    @staticmethod
    def _ports_in(beats: dict[str, bytes | None]) -> dict[str, int]:
        """The presence ports heartbeat values name (states written before ports were in
        them)."""
        return {n: port for n, value in beats.items()
                if (port := presence_port_of(value)) is not None}

    def _learn_addresses(self, state: RunState) -> None:
        """Every node's address and presence port the state names (for probes)."""
        nodes = {**state.members, **state.waiting}
        for node, info in nodes.items():
            self._addrs[node] = info.addr
        self.keeper.learn_ports({n: i.presence for n, i in nodes.items() if i.presence},
                                {n: i.addr for n, i in nodes.items()})

    def _start_keeper(self) -> None:
        if self._keeper_started:
            return
        # Fail fast and clearly if the store is unreachable.
        self._backend.beat(self._node, self.keeper.presence_port)
        self.keeper.tick()
        if self._keeper_thread:
            self.keeper.start()
        self._keeper_started = True

    def _read(self) -> tuple[RunState | None, Token | None]:
        current = self._backend.get_state()
        if current is None:
            return None, None
        raw, token = current
        return RunState.from_bytes(raw), token

    def _write(self, new: RunState, token: Token | None
               ) -> tuple[RunState | None, Token | None] | None:
        """Compare-and-swap ``new``; the state as the store holds it now (ours or the one
        that won), so that the caller need not read it again; None if it vanished."""
        result = self._backend.set_state(new.to_bytes(), token)
        if result is not None and result[2] and new.note != self._last_written_note:
            self._last_written_note = new.note
            self._events.emit(EventKind.STATE, new.note, note=new.note, round=new.round,
                              phase=new.phase.value)
        if result is None:
            return None
        return (new if result[2] else RunState.from_bytes(result[0])), result[1]

    def _min_reached_for(self, state: RunState | None) -> float | None:
        if state is None or state.phase is not Phase.OPEN:
            return None
        key = (state.generation, state.round)
        if len(state.members) < self._settings.min_nodes:
            self._min_reached_at.pop(key, None)
            return None
        now = self._clock.monotonic()
        return now - self._min_reached_at.setdefault(key, now)

    def _joined(self, state: RunState) -> RendezvousInfo:
        self._my_join = None
        self._learn_addresses(state)
        self.keeper.watch_also(state.members)  # until the keeper reads this state itself
        self._completed = (state.generation, state.round)
        self._last_order = state.order
        self.keeper.watch_round(self._completed)
        self._control.publish_round(state.round)
        rank = state.rank_of(self._node)
        master = state.master()
        self._events.emit(EventKind.JOINED,
                          f"joined round {state.round} as rank {rank} of {len(state.order)}",
                          generation=state.generation, round=state.round, rank=rank,
                          world_size=len(state.order), master_addr=master.addr,
                          master_port=master.port, opened_because=state.opened_because.value,
                          restarts=state.restarts, max_restarts=state.max_restarts)
        logger.info("etcd-ext: round %d of run %s: rank %d of %d, workers' store at %s:%d",
                    state.round, self._settings.run_id, rank, len(state.order), master.addr,
                    master.port)
        self._forget_old_rounds(state)
        return RendezvousInfo(
            store=self._backend.round_store(state.generation, state.round),
            rank=rank, world_size=len(state.order),
            bootstrap_store_info=RendezvousStoreInfo(master.addr, master.port))

    def _forget_old_rounds(self, state: RunState) -> None:
        if state.rank_of(self._node) == 0:
            try:
                self._backend.drop_round_stores(state.generation, state.round - 1)
            except Exception as exc:  # tidying up only: the keys are removed with the run
                logger.debug("etcd-ext: could not drop old round stores: %s", exc)
        self._min_reached_at = {k: v for k, v in self._min_reached_at.items()
                                if k == (state.generation, state.round)}

    def _update_status(self, status: Status, note: str,
                       only_if: Callable[[RunState], bool] = lambda state: True) -> None:
        kind = EventKind.BUDGET_SPENT if status is Status.BUDGET_SPENT else EventKind.STATE
        retrying = Retrying(stop=stop_after_delay(self._settings.timeouts.close),
                            wait=wait_fixed(0.1),
                            retry=retry_if_exception_type(StoreUnavailableError), reraise=True)
        for attempt in retrying:
            with attempt:
                while True:
                    state, token = self._read()
                    if state is None or state.status is status or not only_if(state):
                        return
                    result = self._backend.set_state(
                        replace(state, status=status, note=note).to_bytes(), token)
                    if result is not None and result[2]:
                        self._events.emit(kind, note, note=note, status=status.value)
                        return

    def _timeout_message(self, state: RunState | None) -> str:
        joined = len(state.members) if state and state.phase is Phase.OPEN else 0
        return (f"etcd-ext run {self._settings.run_id}: no round admitted this node within "
                f"join_timeout={self._settings.timeouts.join:g}s ({joined} node(s) joined, "
                f"--nnodes needs at least {self._settings.min_nodes}). Start more nodes, lower "
                "--nnodes MIN, or raise --rdzv-conf join_timeout")
