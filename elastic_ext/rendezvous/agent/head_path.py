"""A node's join of an open round by key, its wait for the round's closer, and the
rendezvous decided on the state's head (``head.py``) where the store keeps heads.

Most nodes of a large job neither close nor watch a round: at a round change they need
to join the next round and, once it closed, their own rank. ``HeadPath.step`` does that
from the head and the node's seat, a few hundred bytes, where reading the state was
29 KB per node at 1,024 nodes (O(N²) bytes for the job, issue 27). A node whose round
ended joins the next one by key before it is opened; the first of them opens it (the
whole-state path). Whatever the head cannot settle goes to the whole-state path
(``JoinSession``): the closer, a dead or idle closer, a full round, a stop, a node left
out or leaving, a seat that does not fit. Deciding on the head gives what ``policy.decide``
gives on the state: where it would differ, the step answers None.
"""

from __future__ import annotations

import logging
from typing import Protocol

from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError

from elastic_ext.rendezvous.agent.session_context import Memory, RunAccess
from elastic_ext.rendezvous.protocol.head import Head, Seat
from elastic_ext.rendezvous.protocol.joins import replacement_turn
from elastic_ext.rendezvous.protocol.state import Phase, Status
from elastic_ext.rendezvous.stores.contract import Token

logger = logging.getLogger(__name__)

WAKE_S = 1.0
"""How long a node in an open round it does not close waits on the state before it looks
whether the closer is still alive (the wait ends at once when the state changes)."""

CLOSER_REQUESTS = 10
"""About how many store requests a closer's decision on a round takes (read the joins,
probe the nodes it waits for, write the state, the seats), each, on a starved machine,
as slow as the waiter's own: the idle limit grows by that many of the slowest join count
the waiter read (``HeadPath.wait_for_the_round``)."""

WAITED = "waited"
"""``HeadPath.step``: it waited for the round to move; step again."""


class DeathJudge(Protocol):
    """The keeper, as the head path asks it: whether this node acts for a round's closer
    now (judged dead, and this node's turn came), told where this node joined."""

    def replaces(self, closer: str) -> bool: ...

    def place(self, round_: tuple[str, int], position: int) -> None: ...


class HeadPath:
    """One ``next_rendezvous`` call's join by key (the round, its place among the joiners)
    and its steps on the head."""

    def __init__(self, run: RunAccess, keeper: DeathJudge, memory: Memory) -> None:
        self._node = run.node
        self._settings = run.settings
        self._max_nodes = run.settings.max_nodes
        self._backend = run.backend
        self._clock = run.clock
        self._keeper = keeper
        self._memory = memory
        self.round: tuple[str, int] | None = None  # the round this call joined by key
        self.position = 0  # an upper bound of its place among the round's nodes
        self._count = 0  # the round's join keys when ours was written

    def join(self, generation: str, round_: int, in_state: int, entry: bytes) -> None:
        """Write this node's join key of the round (``joins.py``); ``in_state``: the
        members the state lists (they count before the keys)."""
        self._count = self._backend.join(generation, round_, self._node, entry)
        self.position = in_state + self._count
        self.round = (generation, round_)
        self._keeper.place(self.round, self.position)
        logger.debug("etcd-ext: joined open round %d as number %d", round_, self.position)

    def step(self, entry: bytes, deadline: float, timeout_message: str
             ) -> tuple[Seat, Head] | str | None:
        """One step on the head: this node's seat, once it has one that fits, and the head
        it fits; ``WAITED`` after a wait for the round to move; None where the whole state
        must decide. ``timeout_message``: what a timeout says.

        Raises:
            RendezvousTimeoutError: ``deadline`` passed while it waited.
            StoreUnavailableError: the store did not answer.
        """
        current = self._backend.head_after(None)
        if current is None:
            return None
        head, token = Head.from_bytes(current[0]), current[1]
        if head.status is not Status.ACTIVE or head.stop or self._node in head.excluded \
                or self._node in head.leaving:
            return None
        key = (head.generation, head.round)
        if head.phase is Phase.CLOSED:
            if key == self._memory.completed:
                return self._join_next(head, token, entry, deadline, timeout_message)
            seat = Seat.from_bytes(self._backend.read_seat(*key, self._node))
            return (seat, head) if seat is not None and seat.fits(head) else None
        closer = head.closer
        if closer is None or closer == self._node or self._memory.take_over == key \
                or self._keeper.replaces(closer):
            return None
        if self.round != key:
            if head.size >= self._max_nodes:
                return None  # it would wait to join: the state says where
            self.join(*key, head.size, entry)
        self.wait_for_the_round(key, closer, token, deadline, timeout_message)
        return WAITED

    def _join_next(self, head: Head, token: Token, entry: bytes, deadline: float,
                   timeout_message: str) -> str | None:
        """This node's round ended: it joins the next one by key before anyone opened it;
        the first to join opens it (on the whole state), the others wait for that, or take
        over when nobody did."""
        nxt = (head.generation, head.round + 1)
        if self.round != nxt:
            self.join(*nxt, 1, entry)
        if self._count == 1 or self._memory.take_over == nxt:
            return None
        self.wait_for_the_round(nxt, None, token, deadline, timeout_message)
        return WAITED

    def wait_for_the_round(self, key: tuple[str, int], closer: str | None, token: Token | None,
                           deadline: float, timeout_message: str) -> None:
        """Wait, without reading the round's joins, until the state changes, this node's
        turn to act for a dead closer came (``Keeper.replaces``), or the round stops moving
        (no new join) for longer than its closer should take, when this node takes over
        (``Memory.take_over``); a watch on etcd, not a poll. The idle limit grows with this
        node's join position, so that the earliest joiner takes over first rather than
        everyone at once (and by its turn, ``joins.replacement_turn``), and with the load: by
        ``CLOSER_REQUESTS`` times the slowest join count read meanwhile, so that a closer
        starved with its store (1,024 agents on two cores: 22 live closers' round 1 was
        taken over, each take-over reading the whole state) is not taken over while it
        works. The join count, a request, is read every half of that limit: every waiting
        agent reads it (once a second at 1,024 agents was 1,024 requests a second for as
        long as the round stayed open). Before it takes over it looks at the head once
        more (on etcd a watched key: no request): a round that moved while the count was
        read (a starved store answers in seconds) is its closer's still, and the whole
        state is not read.

        Raises:
            RendezvousTimeoutError: ``deadline`` passed (``timeout_message``).
        """
        timeouts = self._settings.timeouts
        spread = 1 + min(1.0, self.position / max(1, self._max_nodes))
        turn = replacement_turn(self.position) * timeouts.heartbeat if self.round == key \
            else 0.0
        idle_limit = (timeouts.last_call + timeouts.heartbeat) * spread + turn
        joins = self._count if self.round == key else 0
        moved_at = counted_at = self._clock.monotonic()
        while self._clock.monotonic() < deadline:
            if self._backend.wait_for_state(token, WAKE_S, self._clock) \
                    or (closer is not None and self._keeper.replaces(closer)):
                return
            now = self._clock.monotonic()
            if now - counted_at < idle_limit / 2:
                continue
            count = self._backend.count_joins(*key)
            counted_at = self._clock.monotonic()
            idle_limit = max(idle_limit, (timeouts.last_call + timeouts.heartbeat
                                          + CLOSER_REQUESTS * (counted_at - now)) * spread
                             + turn)
            if count != joins:
                joins, moved_at = count, now
            elif counted_at - moved_at >= idle_limit:
                if self._backend.wait_for_state(token, 0.0, self._clock):
                    return  # the round moved while we counted: its closer works; step again
                logger.info("etcd-ext: round %d is still open %.1fs after its last join "
                            "(limit %.1fs); deciding on it instead of its closer %s", key[1],
                            counted_at - moved_at, idle_limit, closer)
                self._memory.take_over = key
                return
        raise RendezvousTimeoutError(timeout_message)
