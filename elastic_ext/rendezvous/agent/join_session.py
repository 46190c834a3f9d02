"""One ``next_rendezvous`` call: the join protocol that runs the pure ``policy.decide``.

A ``JoinSession`` lives for one call and owns what only that call needs (the open round
it joined by key, its place among the joiners, the joins it last read). It runs
``decide`` over the run's state until this node is in a closed round. In an open round
only its closer decides on every join (``joins.py``); the others join with one key write
and wait on the state (a watch of its head on etcd), and the earliest of them takes over
from a closer that leaves the round idle. Where the store keeps heads, every step the head
and this node's seat can settle is taken on them (``head_path.py``): a round change in a
few hundred bytes instead of the whole state. What outlives a call (the round this node last
joined, when each open round reached MIN nodes, ...) is the handler's ``Memory``, handed
to every session; the handles a session works with are the handler's ``RunAccess`` and
``SessionParts``.

``decide`` is the state machine; this module is its I/O, as in torch's
``dynamic_rendezvous.py``: it reads and compare-and-swaps the state, writes join keys,
and waits; a decision that ends this node's part is ``lifecycle.py``'s to raise.
"""

from __future__ import annotations

import logging
import uuid

from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError

from elastic_ext.net import free_port
from elastic_ext.rendezvous.agent.closer_joins import CloserJoins
from elastic_ext.rendezvous.agent.events import EventKind
from elastic_ext.rendezvous.agent.head_path import WAITED, HeadPath
from elastic_ext.rendezvous.agent.head_path import WAKE_S as _WAKE_S
from elastic_ext.rendezvous.agent.lifecycle import read_state
from elastic_ext.rendezvous.agent.session_context import (
    Memory,
    RunAccess,
    SessionParts,
    wait_out_outage,
)
from elastic_ext.rendezvous.errors import StoreUnavailableError
from elastic_ext.rendezvous.protocol.head import Head, Seat, seat_of
from elastic_ext.rendezvous.protocol.joins import (
    JoinEntry,
    closer_of,
    is_own_join,
    removed_members,
)
from elastic_ext.rendezvous.protocol.policy import Joined, Limits, View, Write, decide
from elastic_ext.rendezvous.protocol.state import NodeInfo, Phase, Reason, RunState, Status
from elastic_ext.rendezvous.stores.contract import Token

logger = logging.getLogger(__name__)

_POLL = 0.05

_Known = tuple[RunState | None, Token | None]
"""The state and its token as a write or a wait left them, so the loop need not read."""


OLD_ROUND_GRACE_S = 60.0
"""How long a round's join keys and store outlive its completion: an agent far behind
(starved on a loaded machine) may still read them, and on the embedded store a key
deleted between its ``check`` and its ``multi_get`` made that read wait out
``connect_timeout`` and fail (seen at 1,024 agents on two cores, issue 27)."""


class JoinSession:
    """One call's way into a closed round; ``run`` once, then drop it."""

    def __init__(self, run: RunAccess, parts: SessionParts, memory: Memory,
                 reported: frozenset[str] = frozenset()) -> None:
        """``reported``: the nodes of this node's round it could not reach before its
        workers started (``ring_check.py``): it leaves that round for the next at once."""
        self._reported = reported
        self._node = run.node
        self._settings = run.settings
        self._limits = Limits.of(run.settings)
        self._backend = run.backend
        self._clock = run.clock
        self._addr = parts.addr
        self._keeper = parts.keeper
        self._events = parts.events
        self._control = parts.control
        self._probes = parts.probes
        self._lifecycle = parts.lifecycle
        self._memory = memory
        self._path = HeadPath(run, parts.keeper, memory)  # our join by key, the head's steps
        self._joins = CloserJoins(self._backend, self._limits.min_nodes,
                                  self._limits.max_nodes)
        self._read_at = float("-inf")  # when the loop last read the state itself

    def run(self) -> Seat:
        """This node's seat in the closed round it is now a member of, recorded in
        ``Memory``.

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
        unreachable = self._reported
        if unreachable:
            reenter = Reason.FAILURE  # that round cannot train; free if it loses a node
        if memory.completed:
            why = f"could not reach {', '.join(sorted(unreachable))} before the workers " \
                "started" if unreachable else pressure.why or "this node's workers failed"
            self._events.emit(EventKind.RESTART,
                              f"restart after round {memory.completed[1]}: {why}",
                              after_round=memory.completed[1], why=why)
            if not unreachable and (reenter is Reason.FAILURE
                                    or not self._keeper.round_progressed()):
                unreachable = self._probes.unreachable_peers(self._last_order(),
                                                             memory.completed[1])
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
            began = self._clock.monotonic()  # the closer's next wait follows its decision's
            try:
                if known is None and not full_next and self._backend.keeps_heads:
                    step = self._path.step(my_entry, deadline, self._timeout_message(None))
                    if isinstance(step, tuple):
                        return self._joined(step[0], step[1], None)
                    if step == WAITED:
                        continue
                state, token = known if known is not None else self._read_state()
                known = None
                if state is None and memory.completed is not None \
                        and self._lifecycle.last_round_left(
                            memory.last_order if memory.last_order is not None
                            else [n for n in [memory.last_rank0] if n]):
                    raise self._lifecycle.finished_away(None, memory.completed)
                if state is not None and self._joined_open_round(state) and not full_next \
                        and not self._must_see_the_whole_round(state):
                    self._wait_for_the_round(state, token, deadline)
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
                state = decision.state
                seat = seat_of(state, self._node)
                assert seat is not None  # Joined: a closed round with this node in it
                return self._joined(seat, Head.of(state), state)
            self._lifecycle.stop_if_over(decision, memory.completed)
            if state is not None and state.note not in (last_note, memory.last_written_note):
                last_note = state.note
                logger.info("etcd-ext: %s", state.note)
            if self._clock.monotonic() > deadline:
                raise RendezvousTimeoutError(self._timeout_message(seen))
            if full:
                known = self._wait_as_closer(state, token, deadline,
                                             self._clock.monotonic() - began)
            else:
                known = self._as_known(self._backend.wait_for_state(token, _WAKE_S, self._clock))

    def _read_state(self) -> _Known:
        self._read_at = self._clock.monotonic()
        return read_state(self._backend)

    def _wait_as_closer(self, state: RunState | None, token: Token | None, deadline: float,
                        decided_in: float = 0.0) -> _Known | None:
        """Between the closer's decisions: until a join comes (joins are keys, not state
        changes; a watch on etcd) or ``_POLL`` passed (its other reasons to decide again
        come with time: the last call, a death judged), below MIN nodes until the joins can
        make MIN or ``_WAKE_S`` passed, and with MIN at least as long as its last decision
        took (``decided_in``, up to ``_WAKE_S``: ``CloserJoins.wait``); then the state if it
        changed, as the store's notice of it brought it; else the state it decided on, read
        anew at least every ``_WAKE_S`` (a notice that never came). Never more than
        ``_POLL`` past ``deadline``."""
        left = max(_POLL, deadline - self._clock.monotonic())
        if state is not None:
            self._joins.wait(state, _POLL, min(_WAKE_S, left), self._clock,
                             spacing=min(_WAKE_S, left, decided_in))
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
            and self._path.round == (state.generation, state.round)

    def _must_see_the_whole_round(self, state: RunState | None) -> bool:
        """Whether this node decides on the open round with every join read: it is the
        round's closer, the closer is dead, or its own join filled the round. Everyone
        else decides on the state alone: joining is one key write, then it waits."""
        if state is None or state.phase is not Phase.OPEN or state.status is not Status.ACTIVE:
            return False
        closer = closer_of(state)
        if closer is None or closer == self._node or self._keeper.replaces(closer) \
                or self._memory.take_over == (state.generation, state.round):
            return True
        return self._path.round == (state.generation, state.round) \
            and self._path.position >= self._limits.max_nodes

    @staticmethod
    def _as_known(change: bool | tuple[bytes, Token]) -> _Known | None:
        """The state a wait brought along, if it did (else the loop reads it)."""
        if isinstance(change, tuple):
            return RunState.from_bytes(change[0]), change[1]
        return None

    def _wait_for_the_round(self, state: RunState, token: Token | None, deadline: float
                            ) -> None:
        """``HeadPath.wait_for_the_round`` of the open round ``state``."""
        self._path.wait_for_the_round((state.generation, state.round), closer_of(state),
                                      token, deadline, self._timeout_message(state))

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
        if self._path.round != (state.generation, state.round) or again:
            # Members in the state (the closer) plus the join keys, this one's included: an
            # upper bound of the round's size once this node is in (a merged state counts
            # some twice, which costs one more look at the round, nothing else).
            self._path.join(state.generation, state.round, len(state.members), entry)

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

    def _joined(self, seat: Seat, head: Head, state: RunState | None) -> Seat:
        """Record that this node has ``seat`` in the closed round ``head`` (``Memory``, the
        keeper, its workers' control directory, the events) and return it; ``state``: the
        whole state, when this node read it."""
        if state is not None:
            self._probes.learn_addresses(state)
        self._keeper.watch_also(state.members if state is not None else ())
        self._memory.completed = (seat.generation, seat.round)
        self._memory.last_order = state.order if state is not None else None
        self._memory.last_rank0 = head.closer
        self._memory.last_seal = seat.seal
        self._memory.last_ring = seat.ring if seat.ring else None
        self._keeper.watch_round(self._memory.completed)
        self._control.publish_round(seat.round)
        self._events.emit(EventKind.JOINED,
                          f"joined round {seat.round} as rank {seat.rank} of {seat.world_size}",
                          generation=seat.generation, round=seat.round, rank=seat.rank,
                          world_size=seat.world_size, master_addr=seat.master_addr,
                          master_port=seat.master_port,
                          opened_because=head.opened_because.value, restarts=head.restarts,
                          max_restarts=head.max_restarts)
        logger.info("etcd-ext: round %d of run %s: rank %d of %d, workers' store at %s:%d",
                    seat.round, self._settings.run_id, seat.rank, seat.world_size,
                    seat.master_addr, seat.master_port)
        self._forget_old_rounds(seat)
        return seat

    def _last_order(self) -> tuple[str, ...]:
        """The nodes of the round this node last ran in that it probes: its ring, which its
        seat named (``reach.py``: O(N) probes for the job); else all of them, when it took
        its seat without reading them from the round's seats, which say where they are."""
        memory = self._memory
        if memory.last_ring is not None:
            self._probes.learn_nodes(dict(memory.last_ring))
            return tuple(name for name, _ in memory.last_ring)
        if memory.last_order is not None or memory.completed is None:
            return memory.last_order or ()
        try:
            nodes = {node: seat for node, raw in self._backend.read_seats(*memory.completed)
                     if (seat := Seat.from_bytes(raw)) is not None
                     and seat.seal == memory.last_seal}
        except StoreUnavailableError:
            nodes = {}  # probe whom we know
        self._probes.learn_nodes({node: seat.node for node, seat in nodes.items()})
        memory.last_order = tuple(sorted(nodes, key=lambda node: nodes[node].rank)) \
            or tuple(n for n in [memory.last_rank0] if n)
        return memory.last_order

    def _forget_old_rounds(self, seat: Seat) -> None:
        """Rank 0 drops the stores join keys and seats of the rounds before ``seat``'s that it saw
        complete ``OLD_ROUND_GRACE_S`` ago or more (tidying only), and every node forgets
        when older open rounds reached MIN nodes."""
        now = self._clock.monotonic()
        seen = self._memory.completed_at
        seen.setdefault((seat.generation, seat.round), now)
        recent = [r for (g, r), at in seen.items()
                  if g == seat.generation and now - at < OLD_ROUND_GRACE_S]
        keep_from = min([seat.round - 1, *recent])
        self._memory.completed_at = {(g, r): at for (g, r), at in seen.items()
                                     if g == seat.generation and r >= keep_from}
        if seat.rank == 0:
            try:
                self._backend.drop_round_stores(seat.generation, keep_from)
            except Exception as exc:  # tidying up only: the keys are removed with the run
                logger.debug("etcd-ext: could not drop old round stores: %s", exc)
        self._memory.min_reached_at = {k: v for k, v in self._memory.min_reached_at.items()
                                       if k == (seat.generation, seat.round)}

    def _timeout_message(self, state: RunState | None) -> str:
        """Why no round admitted this node, and what to change."""
        joined = len(state.members) if state and state.phase is Phase.OPEN else 0
        return (f"etcd-ext run {self._settings.run_id}: no round admitted this node within "
                f"join_timeout={self._settings.timeouts.join:g}s ({joined} node(s) joined, "
                f"--nnodes needs at least {self._settings.min_nodes}). Start more nodes, lower "
                "--nnodes MIN, or raise --rdzv-conf join_timeout")
