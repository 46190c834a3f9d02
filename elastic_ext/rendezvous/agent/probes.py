"""What the rendezvous learns by probing other agents (``presence.py``, through the keeper).

The keeper owns the probes and the presence ports it reads itself (its ``PresenceBook``);
the rendezvous adds the addresses and ports the states it reads name, and asks two things:
which nodes of its last round do not answer at all (reported with its join,
``policy.unreachable_by_most``) and which nodes an open round would wait for whose agent
is gone for sure.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from elastic_ext.rendezvous.agent.events import EventKind, EventLog
from elastic_ext.rendezvous.agent.keeper import Keeper
from elastic_ext.rendezvous.errors import StoreUnavailableError
from elastic_ext.rendezvous.protocol.state import NodeInfo, Phase, RunState
from elastic_ext.rendezvous.stores.contract import Heartbeats
from elastic_ext.rendezvous.stores.wire import presence_port_of


class Probes:
    """One node's probes of the others, with every address it saw in a state (kept for
    the node's life: a round's nodes are probed after the round ended)."""

    def __init__(self, node: str, backend: Heartbeats, keeper: Keeper,
                 events: EventLog) -> None:
        self._node = node
        self._backend = backend
        self._keeper = keeper
        self._events = events
        self._addrs: dict[str, str] = {}  # every node's address seen in the state

    def learn_addresses(self, state: RunState) -> None:
        """Remember every node's address and presence port ``state`` names, so that a probe
        can reach them later without reading their heartbeats."""
        self.learn_nodes({**state.members, **state.waiting})

    def learn_nodes(self, nodes: Mapping[str, NodeInfo]) -> None:
        """Remember where ``nodes`` are (from a state, or from a round's seats)."""
        for node, info in nodes.items():
            self._addrs[node] = info.addr
        self._keeper.learn_ports({n: i.presence for n, i in nodes.items() if i.presence},
                                 {n: i.addr for n, i in nodes.items()})

    def unreachable_peers(self, round_nodes: Iterable[str], round_: int | None
                          ) -> frozenset[str]:
        """The nodes of our last round (``round_nodes``, round number ``round_``) that do
        not answer at all, so the next round can leave out a node the others cannot
        reach. Probes whom it can while the store is down: never raises for that."""
        others = set(round_nodes) - {self._node}
        if not others:
            return frozenset()
        try:
            self._learn_ports_of(others)
        except StoreUnavailableError:
            pass  # probe whom we can
        silent = self._keeper.unreachable_among(others, self._addrs)
        if silent:
            self._events.emit(EventKind.UNREACHABLE,
                              f"no answer from {', '.join(sorted(silent))}",
                              peers=sorted(silent), round=round_)
        return silent

    def dead_or_gone(self, state: RunState | None, probe: bool) -> frozenset[str]:
        """The keeper's dead, and with ``probe`` (this node sees the whole open round) in a
        round this node waits in, those of the nodes it would wait for whose agent is gone
        for sure (``presence``): a round need not wait a heartbeat timeout for them.

        Raises:
            StoreUnavailableError: their presence ports had to be read from the store.
        """
        if state is None:
            return frozenset()
        self.learn_addresses(state)
        dead = self._keeper.dead_among(state.known_nodes())
        if not probe or state.phase is not Phase.OPEN or self._node not in state.members:
            return dead
        awaited = (set(state.previous) | set(state.waiting)) - set(state.members) - dead
        awaited.discard(self._node)
        self._learn_ports_of(awaited)
        return dead | self._keeper.gone_among(awaited, self._addrs)

    def _learn_ports_of(self, nodes: Iterable[str]) -> None:
        """Read the presence ports of those of ``nodes`` the keeper does not know from
        their heartbeats (states written before ports were in them)."""
        unknown = self._keeper.ports_unknown(nodes)
        if unknown:
            beats = self._backend.read_beats(unknown)
            self._keeper.learn_ports({n: port for n, value in beats.items()
                                      if (port := presence_port_of(value)) is not None})
