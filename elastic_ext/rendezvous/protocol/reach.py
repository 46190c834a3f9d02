"""Who probes whom on the workers' network when a round closes, and who is cut off.

A node that reaches the store but not its peers (a firewall, the wrong interface) makes
every collective of its round wait for the collective timeout. So when a round closes,
before its workers start, each node probes its *ring* neighbours: the ``RING_SPAN`` nodes
on each side of it in the round's rank order, on the address its workers will use. That
is O(N) probes for the job, 2 x ``RING_SPAN`` per node, and every node is probed by as
many. A node reports those it could not reach, and a node that most of its own probers,
two at least, could not reach is left out (``cut_off_in_ring``): one bad link costs a
round restart, not a node. With two nodes (one prober each) nobody can tell which side
is cut off, so nothing is reported (``judgeable``). Pure: the probes are the agent's
(``agent/ring_check.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

RING_SPAN = 2
"""Neighbours probed on each side: with two, an island of two nodes cut off together is
still left out (each has three of four probers outside it)."""


def ring_of(order: Sequence[str], node: str, span: int = RING_SPAN) -> tuple[str, ...]:
    """The nodes ``node`` probes in the round ``order`` (by rank), nearest first; the same
    nodes probe it. Empty when ``node`` is not in the round."""
    if node not in order:
        return ()
    rank, size = order.index(node), len(order)
    ring: list[str] = []
    for distance in range(1, span + 1):
        for other in (order[(rank + distance) % size], order[(rank - distance) % size]):
            if other != node and other not in ring:
                ring.append(other)
    return tuple(ring)


def judgeable(order: Sequence[str], node: str, span: int = RING_SPAN) -> bool:
    """Whether reports about ``node`` can ever leave it out: it has two probers at least."""
    return len(ring_of(order, node, span)) >= 2


def cut_off_in_ring(order: Sequence[str], members: Sequence[str],
                    reports: Mapping[str, Sequence[str]], skip: Sequence[str] = (),
                    span: int = RING_SPAN) -> dict[str, list[str]]:
    """The nodes of the round ``order`` that more than half of their ring probers, two at
    least, reported unreachable, with those probers; only reports of ``members`` (of the
    round that follows) count, and ``skip`` (left out already) is not judged again."""
    out: dict[str, list[str]] = {}
    present = set(members)
    for node in order:
        if node in skip:
            continue
        probers = ring_of(order, node, span)
        reporters = sorted(p for p in probers if p in present and node in reports.get(p, ()))
        if len(reporters) >= 2 and 2 * len(reporters) > len(probers):
            out[node] = reporters
    return out
