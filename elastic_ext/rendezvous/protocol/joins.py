"""An open round's members as join keys, and the one node that closes the round.

At scale one compare-and-swapped document cannot take every join: N agents retry
against each other (issue 14 measured 92 % conflicts at 128 agents). So a node joins an
open round by writing its own key under the round (one write, ``StoreBackend.join``),
and one node, the round's *closer*, reads the keys and writes the state that closes the
round. The state document of an open round lists the closer first in ``members``
(the node that opened the round, or whoever wrote the state last with every join
merged in); everyone else waits for the state to change.

The same node watches the others' heartbeats for the whole job (``keeper``): the closer
while the round is open, rank 0 while it runs. Everything here is pure.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from elastic_ext.rendezvous.protocol.head import Head
from elastic_ext.rendezvous.protocol.state import NodeInfo, Phase, RunState, Status

MAX_ENTRY_BYTES = 64 * 1024


@dataclass(frozen=True)
class JoinEntry:
    """What a node writes to join an open round: where it would host the workers' store,
    and the nodes of its last round it could not reach (``state.unreachable``)."""

    info: NodeInfo
    unreachable: tuple[str, ...] = ()

    def to_bytes(self) -> bytes:
        return json.dumps({"addr": self.info.addr, "port": self.info.port,
                           "presence": self.info.presence,
                           "unreachable": list(self.unreachable)},
                          separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> JoinEntry | None:
        """Parse strictly; None for anything etcd-ext did not write (never executed)."""
        if len(raw) > MAX_ENTRY_BYTES:
            return None
        try:
            doc = json.loads(raw)
            addr, port, unreachable = doc["addr"], doc["port"], doc["unreachable"]
            presence = doc.get("presence")
            if not isinstance(addr, str) or not _is_port(port) \
                    or not (presence is None or _is_port(presence)) \
                    or not isinstance(unreachable, list) \
                    or not all(isinstance(n, str) for n in unreachable):
                return None
            return cls(NodeInfo(addr, port, presence), tuple(unreachable))
        except (ValueError, KeyError, TypeError, UnicodeDecodeError, RecursionError):
            return None


def _is_port(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 < value < 65536


def closer_of(state: RunState | None) -> str | None:
    """The node that closes an open round and watches every heartbeat meanwhile; rank 0
    watches while a round runs. None when nobody does (no state, or an empty round)."""
    if state is None:
        return None
    if state.phase is Phase.CLOSED:
        return state.order[0] if state.order else None
    return next(iter(state.members), None)


def replacement_turn(position: int) -> int:
    """The turn a joiner at ``position`` of an open round (1: the closer; 0: not known)
    takes to act for a closer that died or left the round idle: 0 for the next joiner (and
    for a place not known), then 1, 2, 2, 3, 3, 3, 3, 4, ...: at most 2^(k-1) joiners act
    at turn k. Everyone acting at once was the cascade of issue 43 (1,023 agents reading
    every heartbeat, every join and the whole round when the closer of 1,024 was judged
    dead); one turn is a heartbeat timeout, so a successor that died too costs one more."""
    return max(0, position - 2).bit_length()


class Succession:
    """When this node acts for a dead closer of the open round it joined: once the closer
    was judged dead ``replacement_turn`` heartbeat timeouts ago (``Keeper.replaces``)."""

    def __init__(self, clock: Callable[[], float], timeout: float) -> None:
        self._clock = clock
        self._timeout = timeout
        self.place: tuple[tuple[str, int] | None, int] = (None, 0)  # open round, position
        self._dead_since: dict[str, float] = {}  # when each node now dead was judged so

    def judged(self, dead: frozenset[str]) -> None:
        """The keeper's judgement at a tick: who is dead now."""
        now = self._clock()
        self._dead_since = {n: self._dead_since.get(n, now) for n in dead}

    def replaces(self, closer: str | None, head: Head | None) -> bool:
        """Whether this node acts for ``closer`` now: dead, and this node's turn came (its
        place counts in the round ``head`` names only; elsewhere it acts at once)."""
        if closer is None or closer not in self._dead_since:
            return False
        round_, position = self.place
        turn = replacement_turn(position) \
            if head is not None and round_ == (head.generation, head.round) else 0
        return self._clock() - self._dead_since[closer] >= turn * self._timeout


def with_joins(state: RunState, joins: Sequence[tuple[str, bytes]], max_nodes: int
               ) -> RunState:
    """The open round ``state`` with the nodes that joined by key, in join order: members
    up to ``max_nodes``, the rest waiting. Entries that do not parse and nodes left out
    of the job are ignored."""
    if state.phase is not Phase.OPEN or state.status is not Status.ACTIVE:
        return state
    members, waiting = dict(state.members), dict(state.waiting)
    unreachable = dict(state.unreachable)
    for node, raw in joins:
        entry = JoinEntry.from_bytes(raw)
        if entry is None or node in state.excluded or node in members:
            continue
        if len(members) < max_nodes:
            members[node] = entry.info
            waiting.pop(node, None)
        else:
            waiting.setdefault(node, entry.info)
        if entry.unreachable:
            unreachable[node] = entry.unreachable
    return replace(state, members=members, waiting=waiting, unreachable=unreachable)


def is_own_join(before: RunState, after: RunState, me: str) -> bool:
    """Whether ``after`` is ``before`` with only ``me`` added to the open round's members:
    a join, which goes to the store as a join key instead of a new state."""
    return (after.phase is Phase.OPEN and before.phase is Phase.OPEN
            and (after.generation, after.round) == (before.generation, before.round)
            and me not in before.members
            and set(after.members) == set(before.members) | {me}
            and after.status is before.status and after.excluded == before.excluded)


def removed_members(before: RunState, after: RunState) -> list[str]:
    """Members of the open round ``before`` that ``after`` drops from the same round
    (dead or left out): their join keys go too, or the next merge would add them back."""
    if before.phase is not Phase.OPEN or (after.generation, after.round) != \
            (before.generation, before.round):
        return []
    return sorted(set(before.members) - set(after.members) - set(after.waiting))
