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

The same ports tell whether nodes can reach each other at all: after a round that
failed, or ended before a training step, each agent checks that it can connect to the
other nodes of that round (a frozen agent's kernel still answers). A node most others
cannot reach, though the store can, is left out (``policy.unreachable_by_most``).
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

logger = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 0.2
REPROBE_AFTER_S = 0.2
REACH_TIMEOUT_S = 1.0
_REACH_THREADS = 32


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


def _dial(addr: str, port: int, timeout: float) -> str:
    """``connected``, ``refused`` (nobody listens there) or ``silent`` (no answer in time)."""
    try:
        with socket.create_connection((addr, port), timeout=timeout):
            return "connected"
    except ConnectionRefusedError:
        return "refused"
    except OSError:
        return "silent"


def refuses(addr: str, port: int, timeout: float = PROBE_TIMEOUT_S) -> bool:
    """True only when ``addr:port`` actively refused a connection: nobody listens there."""
    return _dial(addr, port, timeout) == "refused"


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


def answers(addr: str, port: int, timeout: float = REACH_TIMEOUT_S) -> bool:
    """Whether ``addr:port``'s machine answered at all: a connection or a refusal. False
    when nothing came back in ``timeout`` (dropped packets, no route)."""
    return _dial(addr, port, timeout) != "silent"


def unreachable_among(targets: Mapping[str, tuple[str, int]],
                      timeout: float = REACH_TIMEOUT_S) -> frozenset[str]:
    """The nodes of ``targets`` (node -> presence address and port) that do not answer,
    probed in parallel so that the whole check takes about ``timeout``."""
    if not targets:
        return frozenset()
    nodes = sorted(targets)
    with ThreadPoolExecutor(max_workers=min(_REACH_THREADS, len(nodes))) as pool:
        replies = list(pool.map(lambda n: answers(*targets[n], timeout=timeout), nodes))
    silent = frozenset(n for n, ok in zip(nodes, replies, strict=True) if not ok)
    if silent:
        logger.warning("etcd-ext: no answer from %s within %.1fs", ", ".join(sorted(silent)),
                       timeout)
    return silent
