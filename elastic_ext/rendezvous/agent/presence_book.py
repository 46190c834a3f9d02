"""Where the other agents listen: each node's presence port and address, as the keeper
read them from heartbeats and states and the rendezvous from the states it read.

A plain record, no sockets: the probes (``presence.py``) take their targets from it. The
keeper's lock guards it (the keeper's thread and the rendezvous both write it).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from elastic_ext.rendezvous.protocol.state import NodeInfo
from elastic_ext.rendezvous.stores.wire import presence_port_of

Target = tuple[str, int]
"""A presence port to dial: the node's address and its port."""


class PresenceBook:
    """The presence ports and addresses one agent knows of the others."""

    def __init__(self, me: str) -> None:
        self._me = me
        self._ports: dict[str, int] = {}  # presence ports from the heartbeats last read
        self._addrs: dict[str, str] = {}  # node addresses from the states read

    def unknown(self, nodes: Iterable[str]) -> list[str]:
        """Of ``nodes``, those whose presence port is not known (sorted, never ``me``)."""
        return sorted(n for n in nodes if n not in self._ports and n != self._me)

    def learn(self, ports: Mapping[str, int], addrs: Mapping[str, str] | None = None) -> None:
        """Ports (and addresses) read elsewhere (the state names them); a node's own port
        is never dialled."""
        self._ports.update({n: p for n, p in ports.items() if n != self._me})
        self._addrs.update(addrs or {})

    def learn_beats(self, beats: Mapping[str, bytes | None]) -> None:
        """The ports the heartbeats name (a heartbeat carries its agent's port)."""
        for node, value in beats.items():
            port = presence_port_of(value)
            if port is not None:
                self._ports[node] = port

    def learn_infos(self, infos: Mapping[str, NodeInfo]) -> None:
        """Where a state's nodes are; a port a heartbeat named stays (it is newer)."""
        for node, info in infos.items():
            self._addrs[node] = info.addr
            if info.presence is not None:
                self._ports.setdefault(node, info.presence)

    def targets(self, nodes: Iterable[str], addrs: Mapping[str, str] | None = None, *,
                others_only: bool = False) -> dict[str, Target]:
        """Where to dial those of ``nodes`` whose port and address are known (the address
        from ``addrs`` when given, else from the book); ``others_only``: never ``me``."""
        addrs = self._addrs if addrs is None else addrs
        return {n: (addrs[n], self._ports[n]) for n in nodes
                if n in self._ports and n in addrs and not (others_only and n == self._me)}
