"""Free TCP ports: for each round's workers' store, and for the local job tooling."""

from __future__ import annotations

import socket


def free_ports(count: int, host: str = "") -> list[int]:
    """``count`` distinct ports that are free on ``host`` now (``""``: every interface).

    The sockets stay open until all are bound, so the ports differ from each other; a
    port is only free when this returns, so whoever binds it later can still lose a race.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sockets = [socket.socket(family) for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind((host, 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def free_port(host: str = "") -> int:
    """One port that is free on ``host`` now (``""``: every interface)."""
    return free_ports(1, host)[0]
