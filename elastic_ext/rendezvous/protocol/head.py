"""What an agent reads of a round change: the state's head and its own seat, a few bytes.

The state names every node (its ``members``, ``order``, ``previous``), so an agent that
read it at every round change read O(N) bytes, and N agents O(N²): 28 KB each at 1,024
nodes, compressed (issue 27). Most agents need none of it: a node that is not the
round's closer needs to know that a round opened or closed, with a few facts about it
(the *head*), and, once it closed, its own rank, the world size and the workers' store
(its *seat*). Both are derived here from the state, purely, by whoever writes it; stores
that keep them as keys of their own (etcd: ``head``, written in the state's transaction,
and ``seat/<generation>/<round>/<node>``, written before the closing write) let an agent
read a round change in a few hundred bytes. The closer, the node that watches everyone,
and the rare paths (a requeued job, a notice, a stop) read the whole state as before.

A seat is trusted only under a head with the same ``seal``, a digest of the round's
ranks and its master: a closing write that lost its compare-and-swap may leave seats of
a roster that never ran, and a later close of the same round with other nodes has
another seal.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from elastic_ext.rendezvous.errors import CorruptStateError
from elastic_ext.rendezvous.protocol.reach import ring_of
from elastic_ext.rendezvous.protocol.state import (
    NodeInfo,
    Phase,
    Reason,
    RunState,
    Status,
    parse_count,
    parse_node_info,
    parse_text,
)

MAX_HEAD_BYTES = 256 * 1024


def seal_of(state: RunState) -> str:
    """A digest of what a closed round's seats say (its ranks and its master); "" while
    the round is open."""
    if state.phase is not Phase.CLOSED or not state.order:
        return ""
    master = state.master()
    text = json.dumps([state.generation, state.round, list(state.order), master.addr,
                       master.port], separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:20]


@dataclass(frozen=True)
class Head:
    """The state without its lists of every node: what a node that neither closes nor
    watches the round decides on (``head_path``) and judges its round by (``keeper``)."""

    generation: str
    round: int
    phase: Phase
    status: Status
    opened_because: Reason
    restarts: int
    max_restarts: int | None
    progress_round: int
    closer: str | None  # ``joins.closer_of``: who closes the open round, or rank 0
    closer_info: NodeInfo | None
    size: int  # closed: the world size; open: the members the state lists
    waiting: tuple[str, ...]
    leaving: tuple[str, ...]  # this generation's nodes leaving on a notice
    leaving_members: tuple[str, ...]  # those of them in the round
    excluded: tuple[str, ...]
    stop: str
    seal: str

    @classmethod
    def of(cls, state: RunState) -> Head:
        closer = (state.order[0] if state.order else None) if state.phase is Phase.CLOSED \
            else next(iter(state.members), None)
        return cls(
            generation=state.generation, round=state.round, phase=state.phase,
            status=state.status, opened_because=state.opened_because,
            restarts=state.restarts, max_restarts=state.max_restarts,
            progress_round=state.progress_round, closer=closer,
            closer_info=state.members.get(closer) if closer is not None else None,
            size=len(state.order) if state.phase is Phase.CLOSED else len(state.members),
            waiting=tuple(state.waiting), leaving=tuple(state.leaving),
            leaving_members=tuple(n for n in state.leaving if n in state.members),
            excluded=tuple(state.excluded), stop=state.stop, seal=seal_of(state))

    def to_bytes(self) -> bytes:
        doc = {"generation": self.generation, "round": self.round,
               "phase": self.phase.value, "status": self.status.value,
               "opened_because": self.opened_because.value, "restarts": self.restarts,
               "max_restarts": self.max_restarts, "progress_round": self.progress_round,
               "closer": self.closer,
               "closer_info": self.closer_info.to_json() if self.closer_info else None,
               "size": self.size, "waiting": list(self.waiting), "leaving": list(self.leaving),
               "leaving_members": list(self.leaving_members),
               "excluded": list(self.excluded), "stop": self.stop, "seal": self.seal}
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> Head:
        """Parse strictly; anything unexpected is ``CorruptStateError``, never executed."""
        if len(raw) > MAX_HEAD_BYTES:
            raise CorruptStateError(f"the run's head is {len(raw)} bytes, over the limit")
        try:
            doc = json.loads(raw)
            info = doc["closer_info"]
            closer = doc["closer"]
            return cls(
                generation=parse_text(doc["generation"]), round=parse_count(doc["round"]),
                phase=Phase(doc["phase"]), status=Status(doc["status"]),
                opened_because=Reason(doc["opened_because"]),
                restarts=parse_count(doc["restarts"]),
                max_restarts=None if doc["max_restarts"] is None
                else parse_count(doc["max_restarts"]),
                progress_round=parse_count(doc["progress_round"]),
                closer=None if closer is None else parse_text(closer),
                closer_info=None if info is None else parse_node_info(info),
                size=parse_count(doc["size"]), waiting=_names(doc["waiting"]),
                leaving=_names(doc["leaving"]), leaving_members=_names(doc["leaving_members"]),
                excluded=_names(doc["excluded"]), stop=parse_text(doc["stop"]),
                seal=parse_text(doc["seal"]))
        except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError,
                RecursionError) as exc:
            raise CorruptStateError(f"the run's head key does not hold an etcd-ext head "
                                    f"({exc}); delete the run's keys or use another "
                                    "--rdzv-id") from exc


@dataclass(frozen=True)
class Seat:
    """One node's place in a closed round: all torch's agent needs to start its workers."""

    generation: str
    round: int
    rank: int
    world_size: int
    master_addr: str
    master_port: int
    seal: str
    node: NodeInfo  # where this node's agent is: the others probe it (``probes.py``)
    # the nodes it probes on the workers' network before they start, and where they are
    # (``reach.ring_of``): a few, so no node reads every seat to find them
    ring: tuple[tuple[str, NodeInfo], ...] = ()

    def fits(self, head: Head | None) -> bool:
        """Whether ``head`` is the closed round this seat was written for."""
        return head is not None and head.phase is Phase.CLOSED and \
            (head.generation, head.round, head.seal) == (self.generation, self.round, self.seal)

    def to_bytes(self) -> bytes:
        """A JSON list; the ring, when there is one, comes last (seats without it, written
        before it existed, still parse)."""
        doc: list[Any] = [self.generation, self.round, self.rank, self.world_size,
                          self.master_addr, self.master_port, self.seal, self.node.to_json()]
        if self.ring:
            doc.append([[name, info.to_json()] for name, info in self.ring])
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, raw: bytes | None) -> Seat | None:
        """Parse strictly; None for a missing value or anything etcd-ext did not write."""
        if raw is None or len(raw) > MAX_SEAT_BYTES:
            return None
        try:
            generation, round_, rank, world, addr, port, seal, node, *rest = json.loads(raw)
            if len(rest) > 1:
                return None
            ring = tuple((parse_text(name), parse_node_info(info))
                         for name, info in (rest[0] if rest else ()))
            seat = cls(parse_text(generation), parse_count(round_), parse_count(rank),
                       parse_count(world), parse_text(addr), parse_count(port),
                       parse_text(seal), parse_node_info(node), ring)
        except (ValueError, TypeError, UnicodeDecodeError, RecursionError):
            return None
        return seat if seat.rank < seat.world_size else None


MAX_SEAT_BYTES = 16 * 1024
"""A seat with its ring of ``2 x RING_SPAN`` nodes is well under 2 KB."""


def seats_of(state: RunState) -> dict[str, Seat]:
    """Every node's seat in the closed round ``state`` (none while it is open)."""
    seal = seal_of(state)
    if not seal:
        return {}
    master = state.master()
    return {node: Seat(state.generation, state.round, rank, len(state.order), master.addr,
                       master.port, seal, state.members[node], _ring(state, node))
            for rank, node in enumerate(state.order)}


def _ring(state: RunState, node: str) -> tuple[tuple[str, NodeInfo], ...]:
    return tuple((other, state.members[other]) for other in ring_of(state.order, node))


def seat_of(state: RunState, node: str) -> Seat | None:
    """``node``'s seat in the closed round ``state``; None if it has none."""
    if state.phase is not Phase.CLOSED or node not in state.members:
        return None
    master = state.master()
    return Seat(state.generation, state.round, state.rank_of(node), len(state.order),
                master.addr, master.port, seal_of(state), state.members[node],
                _ring(state, node))


def head_bytes_of(state: bytes) -> bytes:
    """The head of the state ``state`` (its JSON, unwrapped) as stored.

    Raises:
        CorruptStateError: ``state`` is not an etcd-ext state.
    """
    return Head.of(RunState.from_bytes(state)).to_bytes()


def _names(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise ValueError(f"expected a list, got {type(value).__name__}")
    return tuple(parse_text(n) for n in value)
