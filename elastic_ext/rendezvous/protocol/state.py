"""The run's shared state: its schema and its strict JSON encoding.

The state is one JSON document under ``<prefix>/<run_id>/state``, written only
with compare-and-swap. Data only: nothing in it is ever executed or unpickled.
What agents do with it (the pure ``decide`` every agent runs over it) is in
``policy.py``.

Liveness is not in the state: each agent judges other nodes from heartbeat
counters it watches with its own monotonic clock (see ``liveness.py``), so clocks
on different machines never have to agree.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from elastic_ext.rendezvous.errors import CorruptStateError

STATE_VERSION = 1
MAX_STATE_BYTES = 1 << 20


class Phase(str, enum.Enum):
    OPEN = "open"  # admitting nodes into ``round``
    CLOSED = "closed"  # ``round`` is running with ``order``


class Status(str, enum.Enum):
    ACTIVE = "active"
    BUDGET_SPENT = "budget_spent"
    CLOSED = "closed"  # closed for good by an operator (``set_closed``)
    FINISHED = "finished"  # the workers of a round completed: the job is done


class Reason(str, enum.Enum):
    """Why a round was opened; decides whether closing it charges the restart budget."""

    START = "start"
    MEMBERSHIP = "membership"  # a node died, left, or waits to join: free
    FAILURE = "failure"  # a worker failed; free only if membership changed after all


@dataclass(frozen=True)
class NodeInfo:
    """Where a node's rank-0 worker would host the workers' store if it gets rank 0, and
    where its agent answers presence probes (``presence.py``), so that nobody reads every
    heartbeat to learn the ports."""

    addr: str
    port: int
    presence: int | None = None

    def to_json(self) -> list[Any]:
        """``[addr, port]``, with the presence port only when known (older states)."""
        return [self.addr, self.port] if self.presence is None \
            else [self.addr, self.port, self.presence]


@dataclass(frozen=True)
class RunState:
    """The run's one shared document: its generation, the current round and the budget."""

    generation: str
    round: int
    phase: Phase
    members: Mapping[str, NodeInfo]  # open: joined so far; closed: the round's nodes
    order: tuple[str, ...] = ()  # closed: node ids by rank
    waiting: Mapping[str, NodeInfo] = field(default_factory=dict)
    previous: tuple[str, ...] = ()  # open: the last closed round's order
    opened_because: Reason = Reason.START
    restarts: int = 0
    max_restarts: int | None = None  # the job's budget, fixed when its generation starts
    status: Status = Status.ACTIVE
    note: str = ""
    progress_round: int = 0  # the last round whose workers completed a training step
    # open: nodes each member could not reach (it probes after a round without progress)
    unreachable: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    excluded: Mapping[str, str] = field(default_factory=dict)  # node -> why, this generation
    # Preemption notices (``drain.py``): received, not yet decided (node -> why); the nodes
    # that leave the job on theirs, free (node -> why, this generation); and why the whole
    # job stops with a durable snapshot ("" while it does not).
    notices: Mapping[str, str] = field(default_factory=dict)
    leaving: Mapping[str, str] = field(default_factory=dict)
    stop: str = ""

    def known_nodes(self) -> set[str]:
        """Every node this state names: the round's, those waiting, the last round's."""
        return set(self.members) | set(self.waiting) | set(self.previous)

    def rank_of(self, node: str) -> int:
        """``node``'s rank in the closed round; ValueError if it is not in it."""
        return self.order.index(node)

    def master(self) -> NodeInfo:
        """Where rank 0 hosts the workers' store in the closed round."""
        return self.members[self.order[0]]

    # -- encoding -----------------------------------------------------------------------
    def to_bytes(self) -> bytes:
        """Compact JSON, what ``from_bytes`` parses: every agent reads it at every change."""
        doc = {
            "v": STATE_VERSION, "generation": self.generation, "round": self.round,
            "phase": self.phase.value, "status": self.status.value,
            "members": {k: v.to_json() for k, v in self.members.items()},
            "order": list(self.order),
            "waiting": {k: v.to_json() for k, v in self.waiting.items()},
            "previous": list(self.previous), "opened_because": self.opened_because.value,
            "restarts": self.restarts, "max_restarts": self.max_restarts, "note": self.note,
            "progress_round": self.progress_round,
            "unreachable": {k: list(v) for k, v in self.unreachable.items()},
            "excluded": dict(self.excluded),
        }
        for key, value in (("notices", dict(self.notices)), ("leaving", dict(self.leaving)),
                           ("stop", self.stop)):
            if value:  # absent when empty: states without a notice read as before
                doc[key] = value
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> RunState:
        """Parse strictly; anything unexpected is ``CorruptStateError``, never executed."""
        if len(raw) > MAX_STATE_BYTES:
            raise CorruptStateError(f"state is {len(raw)} bytes, over the {MAX_STATE_BYTES} limit")
        try:
            doc = json.loads(raw)
            if doc.get("v") != STATE_VERSION:
                raise ValueError(f"unknown state version {doc.get('v')!r}")
            state = cls(
                generation=parse_text(doc["generation"]), round=parse_count(doc["round"]),
                phase=Phase(doc["phase"]), status=Status(doc["status"]),
                members=_nodes(doc["members"]), order=tuple(parse_text(n) for n in doc["order"]),
                waiting=_nodes(doc["waiting"]),
                previous=tuple(parse_text(n) for n in doc["previous"]),
                opened_because=Reason(doc["opened_because"]),
                restarts=parse_count(doc["restarts"]), note=parse_text(doc.get("note", "")),
                max_restarts=None if doc.get("max_restarts") is None
                else parse_count(doc["max_restarts"]),
                progress_round=parse_count(doc.get("progress_round", 0)),
                unreachable={parse_text(k): tuple(parse_text(n) for n in _list(v))
                             for k, v in _mapping(doc.get("unreachable", {})).items()},
                excluded=_reasons(doc.get("excluded", {})),
                notices=_reasons(doc.get("notices", {})),
                leaving=_reasons(doc.get("leaving", {})), stop=parse_text(doc.get("stop", "")),
            )
        except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError,
                RecursionError) as exc:
            raise CorruptStateError(f"the run's state key does not hold an etcd-ext state "
                                    f"({exc}); delete the key or use another --rdzv-id") from exc
        if state.phase is Phase.CLOSED and set(state.order) != set(state.members):
            raise CorruptStateError("the run's state lists a round whose order and members differ")
        return state


def parse_text(value: Any) -> str:
    if not isinstance(value, str) or len(value) > 4096:
        raise ValueError(f"expected a short string, got {type(value).__name__}")
    return value


def parse_count(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"expected a non-negative integer, got {value!r}")
    return value


def _mapping(value: Any) -> dict[Any, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"expected a mapping, got {type(value).__name__}")
    return value


def _list(value: Any) -> list[Any]:
    if not isinstance(value, list):
        raise ValueError(f"expected a list, got {type(value).__name__}")
    return value


def _reasons(value: Any) -> dict[str, str]:
    return {parse_text(k): parse_text(v) for k, v in _mapping(value).items()}


def _nodes(doc: Any) -> dict[str, NodeInfo]:
    if not isinstance(doc, dict):
        raise ValueError("expected a mapping of nodes")
    return {parse_text(node): parse_node_info(info) for node, info in doc.items()}


def parse_node_info(info: Any) -> NodeInfo:
    """``NodeInfo.to_json`` parsed strictly (ValueError, TypeError)."""
    addr, port, *presence = info
    if len(presence) > 1:
        raise ValueError("a node is [address, port] or [address, port, presence port]")
    for value in (port, *presence):
        if not 0 < parse_count(value) < 65536:
            raise ValueError(f"bad port {value!r}")
    return NodeInfo(parse_text(addr), port, presence[0] if presence else None)
