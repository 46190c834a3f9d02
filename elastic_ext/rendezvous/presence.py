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
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor

logger = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 0.2
PROBE_THREADS = 8
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
    """Which nodes are gone for sure, probing each at most every ``REPROBE_AFTER_S``.

    ``gone_among`` probes now, in parallel, and waits (the rendezvous, which needs the
    answer before it can close a round); ``probe_later`` returns at once and probes on the
    probe's own threads (the keeper, whose tick and lock must never wait on a silent
    machine), calling ``on_gone`` when a node turns out gone, and ``known_gone`` says what
    the probes found so far. At most ``PROBE_THREADS`` probes run at a time, each at most
    ``PROBE_TIMEOUT_S``: a probe that would queue behind them is left for a later call.
    """

    def __init__(self, on_gone: Callable[[], None] | None = None) -> None:
        self._on_gone = on_gone
        self._lock = threading.Lock()
        self._gone: set[tuple[str, int]] = set()
        self._probed_at: dict[tuple[str, int], float] = {}
        self._in_flight: set[tuple[str, int]] = set()
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False

    def known_gone(self, addr: str, port: int) -> bool:
        """Whether a probe already found nobody listening at ``addr:port``."""
        with self._lock:
            return (addr, port) in self._gone

    def gone_among(self, targets: Mapping[str, tuple[str, int]]) -> frozenset[str]:
        """Of ``targets`` (node -> address and port), those whose port refuses now, probed
        in parallel: the call takes about ``PROBE_TIMEOUT_S`` however many are silent."""
        claimed = [key for key in set(targets.values()) if self._claim(key, capped=False)]
        if claimed:
            with ThreadPoolExecutor(max_workers=min(_REACH_THREADS, len(claimed))) as pool:
                list(pool.map(self._probe, claimed))
        return frozenset(node for node, key in targets.items() if self.known_gone(*key))

    def probe_later(self, addr: str, port: int) -> None:
        """Probe ``addr:port`` on the probe's threads unless it is known gone, being probed,
        was probed within ``REPROBE_AFTER_S``, or ``PROBE_THREADS`` probes are running;
        never waits."""
        if not self._claim((addr, port), capped=True):
            return
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=PROBE_THREADS,
                                                thread_name_prefix="etcd-ext-probe")
            self._pool.submit(self._probe, (addr, port))

    def close(self) -> None:
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    def _claim(self, key: tuple[str, int], *, capped: bool) -> bool:
        """Whether to probe ``key`` now; if so, it counts as in flight from here."""
        now = time.monotonic()
        with self._lock:
            if self._closed or key in self._gone or key in self._in_flight \
                    or (capped and len(self._in_flight) >= PROBE_THREADS) \
                    or now - self._probed_at.get(key, -REPROBE_AFTER_S) < REPROBE_AFTER_S:
                return False
            self._probed_at[key] = now
            self._in_flight.add(key)
            return True

    def _probe(self, key: tuple[str, int]) -> None:
        try:
            gone = refuses(*key)
        finally:
            with self._lock:
                self._in_flight.discard(key)
        if not gone:
            return
        logger.info("etcd-ext: nobody listens at %s:%d any more: not waiting for that node", *key)
        with self._lock:
            self._gone.add(key)
        if self._on_gone is not None:
            self._on_gone()


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
