"""Is anyone home? A listening socket per agent, probed when a round waits for a node.

A round after a failure waits up to ``last_call_timeout`` for the members of the
previous round that have not rejoined, because a live one may still be stopping its
workers, and a dead one is only known dead once its heartbeat has been still for
``heartbeat_timeout``. But an agent that died (killed, crashed, out of memory) on a
machine that is still up leaves a closed port behind: the kernel refuses a
connection at once. Each agent listens on a port it puts in its heartbeat; a round
stops waiting for a node whose port refuses. Anything but a refusal (a timeout, a
frozen agent, a dead machine, a firewall that drops) says nothing, and the round
waits as before.
"""

from __future__ import annotations

import logging
import socket
import time

logger = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 0.2
REPROBE_AFTER_S = 0.2


class PresenceListener:
    """This agent's port: listening is the whole job (the kernel answers connects).

    Connections are accepted and closed in :meth:`drain` so that the backlog never
    fills (a full backlog drops SYNs, which reads as "no answer", never as gone).
    """

    def __init__(self) -> None:
        try:
            sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            sock.bind(("::", 0))
        except OSError:  # no IPv6 on this host
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("", 0))
        sock.listen(64)
        sock.setblocking(False)
        self._sock = sock
        self.port: int = sock.getsockname()[1]

    def drain(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, OSError):
                return
            conn.close()

    def close(self) -> None:
        self._sock.close()


def refuses(addr: str, port: int, timeout: float = PROBE_TIMEOUT_S) -> bool:
    """True only when ``addr:port`` actively refused a connection: nobody listens there."""
    try:
        with socket.create_connection((addr, port), timeout=timeout):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:
        return False


class PresenceProbe:
    """Which nodes are gone for sure, probing each at most every ``REPROBE_AFTER_S``."""

    def __init__(self) -> None:
        self._gone: set[tuple[str, int]] = set()
        self._probed_at: dict[tuple[str, int], float] = {}

    def gone(self, addr: str, port: int) -> bool:
        key = (addr, port)
        if key in self._gone:
            return True
        now = time.monotonic()
        if now - self._probed_at.get(key, -REPROBE_AFTER_S) < REPROBE_AFTER_S:
            return False
        self._probed_at[key] = now
        if refuses(addr, port):
            logger.info("etcd-ext: nobody listens at %s:%d any more: not waiting for that node",
                        addr, port)
            self._gone.add(key)
            return True
        return False
