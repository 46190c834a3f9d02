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

The keeper holds a connection to the port of each node it watches (``PresenceWatch``):
when an agent dies, its kernel closes that connection, and the keeper's next tick reads
it as ended, with no probe and no heartbeat timeout. A frozen agent's kernel keeps it
open; a dead machine or a cut network says nothing: those wait for the heartbeat. An
ended connection alone is no proof: a proxy, a load balancer or a NAT on the path may end
an idle one, and some networks accept any connection and close it. So the watch dials
again at once: only a refusal (nobody listens any more) makes the node gone; a port that
still answers was a middlebox, and one whose connections keep ending at once is left to
its heartbeat.

The same ports tell whether nodes can reach each other at all: after a round that
failed, or ended before a training step, each agent checks that it can connect to the
other nodes of that round (a frozen agent's kernel still answers). A node most others
cannot reach, though the store can, is left out (``policy.unreachable_by_most``).
"""

from __future__ import annotations

import errno
import logging
import resource
import selectors
import socket
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor

from elastic_ext.rendezvous.agent.wakeup import Wakeup

logger = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 0.2
CONFIRM_S = 0.05
"""How long a watch waits on its second dial to a node whose held connection ended: a dead
agent's kernel refuses within a round trip."""
STRIKES = 3
"""Held connections to a live port that end within ``SHORT_LIVED_S`` of being made, this
many in a row: the path ends them (a middlebox), so the watch stops holding one."""
SHORT_LIVED_S = 60.0
REPROBE_AFTER_S = 0.2
REACH_TIMEOUT_S = 1.0
_REACH_THREADS = 32


class PresenceListener:
    """This agent's port: listening is the whole job (the kernel answers connects).

    Connections are accepted in :meth:`drain` so that the backlog never fills (a full
    backlog drops SYNs, which reads as "no answer", never as gone), and held open until
    the other side closes them: a watcher reads our death from their end
    (``PresenceWatch``).
    """

    def __init__(self) -> None:
        try:
            sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            sock.bind(("::", 0))
        except OSError:  # no IPv6 on this host
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("", 0))
        sock.listen(socket.SOMAXCONN)  # a new watcher of 1,024 nodes: all connect at once
        sock.setblocking(False)
        self._sock = sock
        self._held = selectors.DefaultSelector()
        self.port: int = sock.getsockname()[1]

    def drain(self) -> None:
        """Accept what waits; close the held connections whose other side closed."""
        while True:
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, OSError):
                break
            conn.setblocking(False)
            self._held.register(conn, selectors.EVENT_READ, conn)
        for key, _ in self._held.select(timeout=0):
            held: socket.socket = key.data
            if _ended(held):
                self._held.unregister(held)
                held.close()

    def close(self) -> None:
        """Idempotent."""
        held = self._held.get_map()
        for key in list(held.values()) if held is not None else []:
            key.fileobj.close()  # type: ignore[union-attr]
        self._held.close()
        self._sock.close()


def _ended(sock: socket.socket) -> bool:
    """Whether a readable held connection was closed (or reset) by its other end; nobody
    sends on one, so anything read is ignored."""
    try:
        return not sock.recv(64)
    except BlockingIOError:
        return False
    except OSError:
        return True


class PresenceWatch:
    """Connections held to the presence ports of the nodes a keeper watches; each
    :meth:`gone_among` tells, without waiting, which agents are gone for sure: the
    connection was refused (nobody listens) or ended (the agent's process died, and its
    kernel closed it). A connection that cannot be made (a silent machine) is tried again
    at a later call. Not thread-safe: the keeper's tick calls it."""

    def __init__(self) -> None:
        self._selector = selectors.DefaultSelector()
        self._conns: dict[tuple[str, int], socket.socket] = {}
        self._gone: set[tuple[str, int]] = set()
        self._made_at: dict[tuple[str, int], float] = {}
        self._strikes: dict[tuple[str, int], int] = {}  # short-lived connections in a row
        self._fd_room = _fd_room()
        self._told_room = False

    def gone_among(self, targets: Mapping[str, tuple[str, int]]) -> frozenset[str]:
        """Of ``targets`` (node -> address and presence port), those found gone; holds a
        connection to each of the others from now on, and drops those to anyone else."""
        wanted = set(targets.values())
        for key in [k for k in self._conns if k not in wanted]:
            self._drop(key)
        for key in wanted - self._conns.keys() - self._gone - self._ended_by_the_path():
            if len(self._conns) < self._fd_room:
                self._connect(key)
            elif not self._told_room:
                self._told_room = True
                logger.warning("etcd-ext: watching more nodes than the open-files limit lets "
                               "this agent hold connections to (%d); the others' deaths are "
                               "found by their heartbeat. Raise `ulimit -n` to find every "
                               "killed agent at once", self._fd_room)
        for selected, events in self._selector.select(timeout=0):
            self._settle(selected.data, events)
        self._gone &= wanted
        return frozenset(node for node, key in targets.items() if key in self._gone)

    def wait(self, timeout: float, wakeup: Wakeup) -> None:
        """Until ``timeout`` seconds passed, ``wakeup`` was set, or a held connection
        ended (its agent died: found now, not at the next tick); connects that complete
        meanwhile are settled here."""
        deadline = time.monotonic() + timeout
        self._selector.register(wakeup, selectors.EVENT_READ, None)
        try:
            gone = len(self._gone)
            while not wakeup.is_set() and len(self._gone) == gone:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                for selected, events in self._selector.select(left):
                    if selected.data is not None:
                        self._settle(selected.data, events)
        finally:
            self._selector.unregister(wakeup)

    def _connect(self, key: tuple[str, int]) -> None:
        try:
            family, kind, proto, _, addr = socket.getaddrinfo(*key, type=socket.SOCK_STREAM)[0]
            sock = socket.socket(family, kind, proto)
        except OSError:
            return  # an address we cannot use: judged by its heartbeat alone
        sock.setblocking(False)
        code = sock.connect_ex(addr)
        if code == errno.ECONNREFUSED:
            sock.close()
            self._found_gone(key)
            return
        if code not in (0, errno.EINPROGRESS):
            sock.close()  # no route, say: tried again at the next call
            return
        self._conns[key] = sock
        self._made_at[key] = time.monotonic()
        self._selector.register(sock, selectors.EVENT_WRITE if code else selectors.EVENT_READ,
                                key)

    def _settle(self, key: tuple[str, int], events: int) -> None:
        sock = self._conns[key]
        if events & selectors.EVENT_WRITE:  # the connect finished, one way or the other
            code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if code == 0:
                self._selector.modify(sock, selectors.EVENT_READ, key)
                return
            self._drop(key)
            if code == errno.ECONNREFUSED:
                self._found_gone(key)
            return
        if _ended(sock):
            lived = time.monotonic() - self._made_at.get(key, 0.0)
            self._drop(key)
            answer = _dial(*key, CONFIRM_S)
            if answer == "refused":
                self._found_gone(key)
            elif answer == "connected":  # the port answers: the path ended the connection
                strikes = self._strikes.get(key, 0) + 1 if lived < SHORT_LIVED_S else 1
                self._strikes[key] = strikes
                if strikes == STRIKES:
                    logger.warning(
                        "etcd-ext: connections to the agent at %s:%d end while its port "
                        "still answers (a proxy, load balancer or NAT on the path?): its "
                        "death will be found by its heartbeat, not at once", *key)

    def _ended_by_the_path(self) -> set[tuple[str, int]]:
        """The ports whose held connections the path keeps ending: not held any more."""
        return {key for key, strikes in self._strikes.items() if strikes >= STRIKES}

    def _found_gone(self, key: tuple[str, int]) -> None:
        logger.info("etcd-ext: the agent at %s:%d is gone (its presence port closed)", *key)
        self._gone.add(key)

    def _drop(self, key: tuple[str, int]) -> None:
        self._made_at.pop(key, None)
        sock = self._conns.pop(key)
        self._selector.unregister(sock)
        sock.close()

    def close(self) -> None:
        for key in list(self._conns):
            self._drop(key)
        self._selector.close()


def _fd_room() -> int:
    """How many connections a watch may hold: half the soft limit on open files, less
    room for the rest. Never raised here: the workers inherit the agent's limits."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    return max(0, min(soft, 1 << 20) // 2 - 256)


def _dial(addr: str, port: int, timeout: float) -> str:
    """``connected``, ``refused`` (nobody listens there) or ``silent`` (no answer in time)."""
    try:
        with socket.create_connection((addr, port), timeout=timeout):
            return "connected"
    except ConnectionRefusedError:
        return "refused"
    except OSError:
        return "silent"


def connects(addr: str, port: int, timeout: float) -> bool:
    """Whether a connection to ``addr:port`` was made within ``timeout``: the path there
    works both ways (a refusal or no answer: it does not, for the workers either)."""
    return _dial(addr, port, timeout) == "connected"


def refuses(addr: str, port: int, timeout: float = PROBE_TIMEOUT_S) -> bool:
    """True only when ``addr:port`` actively refused a connection: nobody listens there."""
    return _dial(addr, port, timeout) == "refused"


class PresenceProbe:
    """Which nodes are gone for sure, probing each at most every ``REPROBE_AFTER_S``, for
    the rendezvous, which needs the answer before it can close a round."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._gone: set[tuple[str, int]] = set()
        self._probed_at: dict[tuple[str, int], float] = {}

    def known_gone(self, addr: str, port: int) -> bool:
        """Whether a probe already found nobody listening at ``addr:port``."""
        with self._lock:
            return (addr, port) in self._gone

    def gone_among(self, targets: Mapping[str, tuple[str, int]]) -> frozenset[str]:
        """Of ``targets`` (node -> address and port), those whose port refuses now, probed
        in parallel: the call takes about ``PROBE_TIMEOUT_S`` however many are silent."""
        claimed = [key for key in set(targets.values()) if self._claim(key)]
        if claimed:
            with ThreadPoolExecutor(max_workers=min(_REACH_THREADS, len(claimed))) as pool:
                list(pool.map(self._probe, claimed))
        return frozenset(node for node, key in targets.items() if self.known_gone(*key))

    def _claim(self, key: tuple[str, int]) -> bool:
        """Whether to probe ``key`` now (not known gone, not probed moments ago)."""
        now = time.monotonic()
        with self._lock:
            if key in self._gone or now - self._probed_at.get(key, -REPROBE_AFTER_S) \
                    < REPROBE_AFTER_S:
                return False
            self._probed_at[key] = now
            return True

    def _probe(self, key: tuple[str, int]) -> None:
        if refuses(*key):
            logger.info("etcd-ext: nobody listens at %s:%d any more: not waiting for that "
                        "node", *key)
            with self._lock:
                self._gone.add(key)


ANSWER_FRESH_S = 2.0
"""How long a probe's answer stands for ``AnswerProbe``: a node still for longer is dialed again."""


class AnswerProbe:
    """Whose machine answers a connection now, asked without waiting: a keeper that
    doubts itself (``watcher.Doubt``) spares a still node whose machine's kernel still
    accepts a fresh connection (a starved agent, a starved store), and not one whose
    machine is silent (off the network). A held connection cannot tell: one made before
    the machine vanished stays open on this side. Each ask starts, in the background, a
    dial to every node without an answer of the last ``ANSWER_FRESH_S``; until it is back,
    the node counts as answering (the keeper waits rather than guess), and a dial that
    finds a machine silent calls ``on_silent`` (the keeper ticks again at once instead of
    a tick later: eight dropped machines are found within the timeout and a second)."""

    def __init__(self, fresh_s: float = ANSWER_FRESH_S,
                 on_silent: Callable[[], None] | None = None) -> None:
        self._fresh_s = fresh_s
        self._on_silent = on_silent
        self._lock = threading.Lock()
        self._answered: dict[tuple[str, int], tuple[float, bool]] = {}  # when, answered
        self._asked: set[tuple[str, int]] = set()  # dials in flight
        self._pool: ThreadPoolExecutor | None = None

    def answering(self, targets: Mapping[str, tuple[str, int]]) -> frozenset[str]:
        """Of ``targets`` (node -> presence address and port), those not known silent."""
        now = time.monotonic()
        with self._lock:
            due = [key for key in set(targets.values()) if key not in self._asked
                   and now - self._answered.get(key, (-self._fresh_s, True))[0] >= self._fresh_s]
            self._asked.update(due)
            silent = {key for key, (_, answered) in self._answered.items() if not answered}
            if due and self._pool is None:
                self._pool = ThreadPoolExecutor(_REACH_THREADS, thread_name_prefix="etcd-ext-ask")
        for key in due:
            assert self._pool is not None
            self._pool.submit(self._dial, key)
        return frozenset(node for node, key in targets.items() if key not in silent)

    def _dial(self, key: tuple[str, int]) -> None:
        answered = _dial(*key, PROBE_TIMEOUT_S) != "silent"  # a refusal answers too
        with self._lock:
            self._answered[key] = (time.monotonic(), answered)
            self._asked.discard(key)
        if not answered and self._on_silent is not None:
            self._on_silent()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


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
