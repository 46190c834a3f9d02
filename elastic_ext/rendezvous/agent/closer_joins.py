"""What the closer of an open round knows of its join keys (``joins.py``), and its wait
for the next one.

The closer decides on the round with every join merged in, again at each join and as time
passes (the last call, a death judged). Reading every key at each join would be O(N²)
bytes for it at N joins one by one, so the keys are read again only when there are more
of them and they can make MIN nodes, and below MIN it waits for the joins that make it.
It waits on the store (``JoinBook.wait_for_joins``): on etcd a watch of the round's
joins, which also answers its reads of them; on the embedded store a ``TCPStore.wait``.
"""

from __future__ import annotations

from elastic_ext.rendezvous.protocol.clock import Clock
from elastic_ext.rendezvous.protocol.joins import with_joins
from elastic_ext.rendezvous.protocol.state import RunState
from elastic_ext.rendezvous.stores.contract import JoinBook

JoinsKey = tuple[str, int, int, RunState]
"""(generation, round, join count, state) as of the last read of the keys."""


class CloserJoins:
    """One rendezvous call's reads of the joins of the rounds it closes."""

    def __init__(self, backend: JoinBook, min_nodes: int, max_nodes: int) -> None:
        self._backend = backend
        self._min_nodes = min_nodes
        self._max_nodes = max_nodes
        self._read: tuple[JoinsKey, list[tuple[str, bytes]]] | None = None
        self._seen: tuple[str, int, int] | None = None  # the join count last seen

    def merged(self, state: RunState) -> RunState:
        """The open round ``state`` with its join keys merged in."""
        count = self._backend.count_joins(state.generation, state.round)
        self._seen = (state.generation, state.round, count)
        key = (state.generation, state.round, count, state)
        last = self._read
        below_min = last is not None and last[0][:2] == key[:2] and last[0][3] == state \
            and len(state.members) + count < self._min_nodes
        if last is None or (last[0] != key and not below_min):
            last = self._read = (key, self._backend.read_joins(state.generation, state.round))
        return with_joins(state, last[1], self._max_nodes)

    def drop(self, state: RunState, nodes: list[str]) -> None:
        """Delete ``nodes``' join keys of the round (dead, or left out of it)."""
        self._read = None
        if nodes:
            self._backend.drop_joins(state.generation, state.round, nodes)

    def wait(self, state: RunState, timeout: float, below_min_timeout: float,
             clock: Clock, spacing: float = 0.0) -> None:
        """Until a join comes to the round ``state`` after those last seen, or ``timeout``
        seconds of ``clock`` passed; while the joins cannot make MIN nodes, until they can,
        or ``below_min_timeout`` passed: nothing the closer decides then waits on a join,
        and deciding again at each of N joins was O(N²) for it. With MIN reached, the
        wait follows the load: ``spacing`` (how long the closer's last decision took)
        longer than ``timeout`` makes it wait that long for the joins that fill the round,
        so that the joins coming meanwhile are decided on together and a starved closer
        spends at most about half its time deciding."""
        seen = self._seen
        if seen is None or seen[:2] != (state.generation, state.round):
            clock.sleep(timeout)
            return
        at_least = seen[2] + 1
        making_min = self._min_nodes - len(state.members)
        if seen[2] < making_min:
            at_least, timeout = making_min, below_min_timeout
        elif spacing > timeout:
            at_least, timeout = self._max_nodes - len(state.members), spacing
        self._backend.wait_for_joins(state.generation, state.round, at_least, timeout, clock)
