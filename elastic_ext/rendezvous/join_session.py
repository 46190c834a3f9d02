"""One ``next_rendezvous`` call: the join protocol that runs the pure ``policy.decide``.

A ``JoinSession`` lives for one call and owns what only that call needs (the open round
it joined by key, its place among the joiners, the joins it last read). It runs
``decide`` over the run's state until this node is in a closed round. In an open round
only its closer decides on every join (``joins.py``); the others join with one key write
and wait on the state (a watch on etcd), and the earliest of them takes over from a
closer that leaves the round idle. What outlives a call (the round this node last
joined, when each open round reached MIN nodes, ...) is the handler's ``Memory``, handed
to every session; the handles a session works with are the handler's ``NodeContext``.

``decide`` is the state machine; this module is its I/O, as in torch's
``dynamic_rendezvous.py``: it reads and compare-and-swaps the state, writes join keys,
and waits; a decision that ends this node's part is ``lifecycle.py``'s to raise.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field

from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError

from elastic_ext.control import AgentControl
from elastic_ext.net import free_port
from elastic_ext.rendezvous.backend import StoreBackend, Token
from elastic_ext.rendezvous.clock import Clock
from elastic_ext.rendezvous.closer_joins import CloserJoins
from elastic_ext.rendezvous.errors import StoreUnavailableError
from elastic_ext.rendezvous.events import EventKind, EventLog
from elastic_ext.rendezvous.joins import (
    JoinEntry,
    closer_of,
    is_own_join,
    removed_members,
)
from elastic_ext.rendezvous.keeper import Keeper
from elastic_ext.rendezvous.lifecycle import Lifecycle, read_state
from elastic_ext.rendezvous.policy import Joined, Limits, View, Write, decide
from elastic_ext.rendezvous.probes import Probes
from elastic_ext.rendezvous.settings import Settings
from elastic_ext.rendezvous.state import NodeInfo, Phase, Reason, RunState, Status

logger = logging.getLogger(__name__)

_POLL = 0.05
_WAKE_S = 1.0
"""How long a node in an open round it does not close waits on the state before it looks
whether the closer is still alive (the wait ends at once when the state changes)."""

_Known = tuple[RunState | None, Token | None]
"""The state and its token as a write or a wait left them, so the loop need not read."""


OLD_ROUND_GRACE_S = 60.0
"""How long a round's join keys and store outlive its completion: an agent far behind
(starved on a loaded machine) may still read them, and on the embedded store a key
deleted between its ``check`` and its ``multi_get`` made that read wait out
``connect_timeout`` and fail (seen at 1,024 agents on two cores, issue 27)."""


def wait_out_outage(backend: StoreBackend, clock: Clock, exc: StoreUnavailableError,
                    deadline: float) -> None:
    """Inside a rendezvous (and at an agent's first heartbeat) an outage is waited out until
    the join deadline when the store can come back (etcd); the embedded store dies with its
    host, so losing it ends the rendezvous at once: ``exc`` is raised again."""
    if not backend.outages_are_transient or clock.monotonic() > deadline:
        raise exc
    logger.warning("etcd-ext: store unreachable, still trying until the join timeout: %s", exc)
    clock.sleep(_POLL)


@dataclass
class Memory:
    """What one node carries from one ``next_rendezvous`` call to the next."""

    completed: tuple[str, int] | None = None  # (generation, round) it last joined
    last_order: tuple[str, ...] = ()  # the nodes of that round, by rank
    # when this node first saw each open round with MIN nodes (its last call counts from then)
    min_reached_at: dict[tuple[str, int], float] = field(default_factory=dict)
    last_written_note: str = ""  # logged when written: not logged again when read
    # when this node saw each round of its generation complete (rank 0 drops old rounds'
    # keys only ``OLD_ROUND_GRACE_S`` after)
    completed_at: dict[tuple[str, int], float] = field(default_factory=dict)
    # An open round whose idle closer this node took over. Kept across calls: after a call
    # that ended in an error, the next one on the same round decides on it at once.
    take_over: tuple[str, int] | None = None


@dataclass(frozen=True)
class NodeContext:
    """This node and what a session reaches the run through; the same for every call."""

    node: str
    addr: str
    settings: Settings
    limits: Limits
    backend: StoreBackend
    clock: Clock
    keeper: Keeper
    events: EventLog
    control: AgentControl
    probes: Probes
    lifecycle: Lifecycle


class JoinSession:
    """One call's way into a closed round; ``run`` once, then drop it."""

    def __init__(self, context: NodeContext, memory: Memory) -> None:
        self._node = context.node
        self._addr = context.addr
        self._settings = context.settings
        self._limits = context.limits
        self._backend = context.backend
        self._clock = context.clock
        self._keeper = context.keeper
        self._events = context.events
        self._control = context.control
        self._probes = context.probes
        self._lifecycle = context.lifecycle
        self._memory = memory
        self._my_join: tuple[str, int] | None = None  # the open round we joined by key
        self._my_join_position = 0
        self._my_join_count = 0  # the round's join keys when ours was written
        self._joins = CloserJoins(self._backend, self._limits.min_nodes,
                                  self._limits.max_nodes)
        self._read_at = float("-inf")  # when the loop last read the state itself

    def run(self) -> RunState:
        """The closed round this node is now a member of, recorded in ``Memory``.

        Raises:
            RendezvousTimeoutError: no round admitted this node within ``join_timeout``.
            RestartBudgetExhaustedError: the job's restart budget is spent.
            RendezvousClosedError: an operator closed the run.
            JobFinishedError: the job finished while this node was away.
            NodeExcludedError: the other nodes cannot reach this one.
            StoreUnavailableError: the store is gone and cannot come back (a lone
                embedded store), or stayed away past ``join_timeout``.
        """
        memory = self._memory
        pressure = self._keeper.pressure
        reenter = pressure.reason if memory.completed else Reason.START
        unreachable: frozenset[str] = frozenset()
        if memory.completed:
            why = pressure.why or "this node's workers failed"
            self._events.emit(EventKind.RESTART,
                              f"restart after round {memory.completed[1]}: {why}",
                              after_round=memory.completed[1], why=why)
            if reenter is Reason.FAILURE or not self._keeper.round_progressed():
                unreachable = self._probes.unreachable_peers(memory.last_order, memory.completed[1])
        self._keeper.watch_round(None)
        my_info = NodeInfo(self._addr, free_port("::" if ":" in self._addr else ""),
                           self._keeper.presence_port)
        my_entry = JoinEntry(my_info, tuple(sorted(unreachable))).to_bytes()
        fresh_generation = uuid.uuid4().hex[:12]
        deadline = self._clock.monotonic() + self._settings.timeouts.join
        last_note = ""
        full_next = False
        known: _Known | None = None  # what our last write saw
        while True:
            try:
                state, token = known if known is not None else self._read_state()
                known = None
                if state is None and memory.completed is not None \
                        and self._lifecycle.last_round_left(memory.last_order):
                    raise self._lifecycle.finished_away(None, memory.completed)
                if state is not None and self._joined_open_round(state) and not full_next \
                        and not self._must_see_the_whole_round(state):
                    known = self._wait_for_the_round(state, token, deadline)
                    continue
                full = full_next or self._must_see_the_whole_round(state)
                full_next = False
                seen = self._with_joins(state) if full else state
                # the nodes a round waits for are probed only once it could close (MIN)
                probe = full and seen is not None and len(seen.members) >= self._limits.min_nodes
                view = View(me=self._node, my_info=my_info,
                            dead=self._probes.dead_or_gone(seen, probe=probe),
                            completed=memory.completed,
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
                            self._joins.drop(seen, removed_members(seen, decision.state))
                        known = self._write(decision.state, token)
                    continue
            except StoreUnavailableError as exc:
                wait_out_outage(self._backend, self._clock, exc, deadline)
                continue
            if isinstance(decision, Joined):
                return self._joined(decision.state)
            self._lifecycle.stop_if_over(decision, memory.completed)
            if state is not None and state.note not in (last_note, memory.last_written_note):
                last_note = state.note
                logger.info("etcd-ext: %s", state.note)
            if self._clock.monotonic() > deadline:
                raise RendezvousTimeoutError(self._timeout_message(seen))
            if full:
                known = self._wait_as_closer(state, token, deadline)
            else:
                known = self._as_known(self._backend.wait_for_state(token, _WAKE_S, self._clock))

    def _read_state(self) -> _Known:
        self._read_at = self._clock.monotonic()
        return read_state(self._backend)

    def _wait_as_closer(self, state: RunState | None, token: Token | None, deadline: float
                        ) -> _Known | None:
        """Between the closer's decisions: until a join comes (joins are keys, not state
        changes; a watch on etcd) or ``_POLL`` passed (its other reasons to decide again
        come with time: the last call, a death judged), below MIN nodes until the joins can
        make MIN or ``_WAKE_S`` passed; then the state if it changed, as
        the store's notice of it brought it; else the state it decided on, read anew at
        least every ``_WAKE_S`` (a notice that never came). Never more than ``_POLL``
        past ``deadline``."""
        left = max(_POLL, deadline - self._clock.monotonic())
        if state is not None:
            self._joins.wait(state, _POLL, min(_WAKE_S, left), self._clock)
        change = self._backend.wait_for_state(token, 0.0, self._clock)
        if change is False and self._clock.monotonic() - self._read_at < _WAKE_S:
            return state, token
        return self._as_known(change)

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
        if closer is None or closer == self._node or self._keeper.dead_among({closer}) \
                or self._memory.take_over == (state.generation, state.round):
            return True
        return self._my_join == (state.generation, state.round) \
            and self._my_join_position >= self._limits.max_nodes

    @staticmethod
    def _as_known(change: bool | tuple[bytes, Token]) -> _Known | None:
        """The state a wait brought along, if it did (else the loop reads it)."""
        if isinstance(change, tuple):
            return RunState.from_bytes(change[0]), change[1]
        return None

    def _wait_for_the_round(self, state: RunState, token: Token | None, deadline: float
                            ) -> _Known | None:
        """Wait, without reading the round's joins, until the state changes (the new state,
        if the wait brought it along), the closer is judged dead, or the round stops moving
        (no new join) for longer than its closer should take, when this node takes over
        (``Memory.take_over``); a watch on etcd, not a poll. The idle limit grows with this
        node's join position, so that the earliest joiner takes over first rather than
        everyone at once. The join count, a request, is read every half of that limit:
        every waiting agent reads it (once a second at 1,024 agents was 1,024 requests a
        second for as long as the round stayed open)."""
        closer = closer_of(state)
        idle_limit = (self._settings.timeouts.last_call + self._settings.timeouts.heartbeat) \
            * (1 + min(1.0, self._my_join_position / max(1, self._limits.max_nodes)))
        joins = self._my_join_count
        moved_at = counted_at = self._clock.monotonic()
        while self._clock.monotonic() < deadline:
            change = self._backend.wait_for_state(token, _WAKE_S, self._clock)
            if change or (closer is not None and self._keeper.dead_among({closer})):
                return self._as_known(change)
            now = self._clock.monotonic()
            if now - counted_at < idle_limit / 2:
                continue
            counted_at = now
            count = self._backend.count_joins(state.generation, state.round)
            if count != joins:
                joins, moved_at = count, now
            elif now - moved_at >= idle_limit:
                logger.info("etcd-ext: round %d is still open %.1fs after its last join; "
                            "deciding on it instead of its closer %s", state.round,
                            now - moved_at, closer)
                self._memory.take_over = (state.generation, state.round)
                return None
        raise RendezvousTimeoutError(self._timeout_message(state))

    def _with_joins(self, state: RunState | None) -> RunState | None:
        """``state`` with the open round's join keys merged in; the keeper judges them too
        when this node watches everyone."""
        if state is None or state.phase is not Phase.OPEN or state.status is not Status.ACTIVE:
            return state
        merged = self._joins.merged(state)
        self._keeper.watch_also(merged.known_nodes())
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

    def _write(self, new: RunState, token: Token | None) -> _Known | None:
        """Compare-and-swap ``new``; the state as the store holds it now (ours or the one
        that won), so that the caller need not read it again; None if it vanished."""
        result = self._backend.set_state(new.to_bytes(), token)
        if result is not None and result[2] and new.note != self._memory.last_written_note:
            self._memory.last_written_note = new.note
            self._events.emit(EventKind.STATE, new.note, note=new.note, round=new.round,
                              phase=new.phase.value)
        if result is None:
            return None
        return (new if result[2] else RunState.from_bytes(result[0])), result[1]

    def _min_reached_for(self, state: RunState | None) -> float | None:
        """Seconds since this node saw the open round ``state`` reach MIN nodes (the last
        call); None while it has fewer."""
        if state is None or state.phase is not Phase.OPEN:
            return None
        key = (state.generation, state.round)
        if len(state.members) < self._settings.min_nodes:
            self._memory.min_reached_at.pop(key, None)
            return None
        now = self._clock.monotonic()
        return now - self._memory.min_reached_at.setdefault(key, now)

    def _joined(self, state: RunState) -> RunState:
        """Record that this node is in the closed round ``state`` (``Memory``, the keeper,
        its workers' control directory, the events) and return it."""
        self._probes.learn_addresses(state)
        self._keeper.watch_also(state.members)  # until the keeper reads this state itself
        self._memory.completed = (state.generation, state.round)
        self._memory.last_order = state.order
        self._keeper.watch_round(self._memory.completed)
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
        return state

    def _forget_old_rounds(self, state: RunState) -> None:
        """Rank 0 drops the stores and join keys of the rounds before ``state``'s that it saw
        complete ``OLD_ROUND_GRACE_S`` ago or more (tidying only), and every node forgets
        when older open rounds reached MIN nodes."""
        now = self._clock.monotonic()
        seen = self._memory.completed_at
        seen.setdefault((state.generation, state.round), now)
        recent = [r for (g, r), at in seen.items()
                  if g == state.generation and now - at < OLD_ROUND_GRACE_S]
        keep_from = min([state.round - 1, *recent])
        self._memory.completed_at = {(g, r): at for (g, r), at in seen.items()
                                     if g == state.generation and r >= keep_from}
        if state.rank_of(self._node) == 0:
            try:
                self._backend.drop_round_stores(state.generation, keep_from)
            except Exception as exc:  # tidying up only: the keys are removed with the run
                logger.debug("etcd-ext: could not drop old round stores: %s", exc)
        self._memory.min_reached_at = {k: v for k, v in self._memory.min_reached_at.items()
                                       if k == (state.generation, state.round)}

    def _timeout_message(self, state: RunState | None) -> str:
        """Why no round admitted this node, and what to change."""
        joined = len(state.members) if state and state.phase is Phase.OPEN else 0
        return (f"etcd-ext run {self._settings.run_id}: no round admitted this node within "
                f"join_timeout={self._settings.timeouts.join:g}s ({joined} node(s) joined, "
                f"--nnodes needs at least {self._settings.min_nodes}). Start more nodes, lower "
                "--nnodes MIN, or raise --rdzv-conf join_timeout")
