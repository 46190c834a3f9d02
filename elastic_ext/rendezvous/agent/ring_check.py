"""The probe of a node's ring neighbours when its round closes, before its workers start.

A node that reaches the store but not its peers (a firewall, the wrong interface) used to
cost the round's first collective its timeout (60 s in the trainer) before anyone probed.
Now every node, once it has its seat, connects to the presence ports of its ring
neighbours (``protocol/reach.py``: a few, named in its seat) at the addresses they
published for their workers, for at most ``reach_timeout``, retrying a failed connect
meanwhile. Those it could not reach it reports with its join of the next round instead of
starting its workers (``join_session.take_seat``), and the next round's closer leaves out
a node most of its probers reported (``policy.unreachable_by_most``). With two nodes
nobody can tell which side is cut off: this node says so and starts its workers.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from tenacity import Retrying, retry_if_result, stop_after_delay, wait_fixed

from elastic_ext.net import describe_interface
from elastic_ext.rendezvous.agent.events import EventKind, EventLog
from elastic_ext.rendezvous.agent.join_session import JoinSession
from elastic_ext.rendezvous.agent.presence import connects
from elastic_ext.rendezvous.agent.session_context import Memory, RunAccess, SessionParts
from elastic_ext.rendezvous.protocol.head import Seat
from elastic_ext.rendezvous.protocol.state import NodeInfo

logger = logging.getLogger(__name__)

DIAL_S = 0.25
"""One connect's limit: a live peer on a working path answers in a round trip, and a lost
SYN is retried by a new connect rather than by the kernel a second later."""
RETRY_WAIT_S = 0.05

Connect = Callable[[str, int, float], bool]


class RingCheck:
    """This node's probes of its ring neighbours at each round it takes a seat in."""

    def __init__(self, node: str, addr: str, timeout: float, events: EventLog,
                 connect: Connect | None = None) -> None:
        self._node = node
        self._addr = addr
        self._timeout = timeout
        self._events = events
        self._connect = connect or connects

    def unreachable(self, seat: Seat) -> frozenset[str]:
        """The ring neighbours of ``seat`` this node could not reach within
        ``reach_timeout``, when reporting them can leave one out (three nodes at least);
        empty when the check is off, or there is nothing to probe. Takes about a round
        trip when every neighbour answers, ``reach_timeout`` at most."""
        targets = {name: info for name, info in seat.ring if info.presence is not None}
        if self._timeout <= 0 or not targets:
            return frozenset()
        began = time.monotonic()
        names = sorted(targets)
        with ThreadPoolExecutor(max_workers=len(names)) as pool:
            reached = list(pool.map(lambda name: self._reach(targets[name]), names))
        silent = frozenset(n for n, ok in zip(names, reached, strict=True) if not ok)
        if not silent:
            return silent
        took = time.monotonic() - began
        where = describe_interface(self._addr)
        peers = ", ".join(f"{n} at {targets[n].addr}:{targets[n].presence}" for n in sorted(silent))
        judged = seat.world_size >= 3
        message = (f"round {seat.round}: could not reach {peers} on the workers' network within "
                   f"{took:.2f}s, from this node's {self._addr} on {where}"
                   + ("" if judged else "; with two nodes nobody can tell which side is cut "
                      "off: starting the workers anyway (their first collective will time out "
                      "if the network stays cut)"))
        logger.warning("etcd-ext: %s", message)
        if len(silent) == len(targets):
            logger.error("etcd-ext: this node reached none of its %d ring neighbours: its "
                         "workers' address %s (%s) may be the wrong one (set --local-addr or "
                         "ELASTIC_EXT_IFNAME to the interface its peers reach), or a firewall "
                         "drops its peers' connections", len(targets), self._addr, where)
        self._events.emit(EventKind.UNREACHABLE, message, peers=sorted(silent),
                          round=seat.round, before_start=True, addr=self._addr,
                          interface=where, seconds=round(took, 3))
        return silent if judged else frozenset()

    def _reach(self, info: NodeInfo) -> bool:
        """Connect to ``info``'s presence port until it works or ``reach_timeout`` passed."""
        assert info.presence is not None
        port = info.presence
        deadline = time.monotonic() + self._timeout

        def attempt() -> bool:
            left = deadline - time.monotonic()
            return self._connect(info.addr, port, max(0.01, min(DIAL_S, left)))

        retrying = Retrying(stop=stop_after_delay(self._timeout), wait=wait_fixed(RETRY_WAIT_S),
                            retry=retry_if_result(lambda ok: not ok),
                            retry_error_callback=lambda _: False)
        return bool(retrying(attempt))


def take_seat(run: RunAccess, parts: SessionParts, memory: Memory) -> Seat:
    """This node's seat in a closed round whose ring neighbours it reached (or whose
    unreachable ones cannot be judged): each seat it is given is checked first, and a
    round it cannot train in is left for the next, with its report, at once.

    Raises what ``JoinSession.run`` raises.
    """
    check = RingCheck(run.node, parts.addr, parts.reach_timeout, parts.events)
    seat = JoinSession(run, parts, memory).run()
    while silent := check.unreachable(seat):
        seat = JoinSession(run, parts, memory, reported=silent).run()
    return seat
