"""Who keeps a copy of whose shard, and who sends which chunk after a node is lost.

Sharded state (FSDP2, HSDP) has no rank that holds all of it, so surviving a node needs
a second copy of every shard on another node. This module decides, with no I/O and no
torch.distributed calls, so that every rank computes the same answer from the same facts:

* :func:`keeper` - where rank ``r``'s copy lives. Under HSDP the replica twin (the rank
  with the same shard coordinate in another replica group) already holds the same
  chunks, so the copy costs nothing; otherwise a buddy ring over nodes puts it on the
  rank ``ranks_per_node`` ahead, which is on the next node.
* :func:`schedule` - for each chunk a rank asks for after a reshard, the rank that sends
  it: itself when it holds it, else the least-loaded live holder.
* :func:`lost_chunks` and :func:`fragile_nodes` - the coverage checks: which chunks no
  live rank holds, and which single node's loss would lose some.

A chunk is named as DCP names it: the state's fully qualified name and the chunk's
offsets in the global tensor (``()`` for a non-tensor item). Ranks are global ranks,
numbered node by node (torchrun's layout: node ``r // ranks_per_node``).
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from elastic_ext.worker.snapshot.errors import SnapshotError

logger = logging.getLogger(__name__)

ChunkKey = tuple[str, tuple[int, ...]]
"""A chunk of saved state: (fully qualified name, offsets in the global tensor)."""

_SHOWN = 5  # lost chunks named in an error message; the rest are counted


class ChunksLostError(SnapshotError):
    """Some chunks have no live holder: the in-memory copies cannot restore this state.

    ``lost`` lists them, sorted. The caller falls back to the durable snapshot."""

    def __init__(self, lost: Sequence[ChunkKey], live: Collection[int]) -> None:
        self.lost = list(lost)
        shown = ", ".join(f"{fqn}@{list(offsets)}" for fqn, offsets in self.lost[:_SHOWN])
        more = f" and {len(self.lost) - _SHOWN} more" if len(self.lost) > _SHOWN else ""
        super().__init__(
            f"{len(self.lost)} chunk(s) have no live holder among ranks {sorted(live)}: "
            f"{shown}{more}; a shard and its copy were both lost, so restore from the "
            "durable snapshot (or keep copies on more nodes)")


@dataclass(frozen=True)
class Keeper:
    """Where a rank's copy lives. ``replica`` is true under HSDP, where ``rank`` is the
    replica twin that holds the same chunks as part of training: nothing is sent."""

    rank: int
    replica: bool


def node_of(rank: int, ranks_per_node: int) -> int:
    return rank // ranks_per_node


def _check_layout(world_size: int, ranks_per_node: int, replicas: int) -> None:
    if ranks_per_node < 1 or world_size < 1 or world_size % ranks_per_node:
        raise ValueError(
            f"world size {world_size} is not a whole number of nodes of {ranks_per_node} "
            "ranks: pass ranks_per_node = torchrun's --nproc-per-node (LOCAL_WORLD_SIZE)")
    if world_size // ranks_per_node < 2:
        raise ValueError(
            f"all {world_size} ranks are on one node: a copy on another node needs at "
            "least two nodes; keep only the durable snapshot on a single node")
    if replicas < 1 or world_size % replicas:
        raise ValueError(
            f"{replicas} replica groups do not divide world size {world_size}: pass the "
            "size of the HSDP mesh's replicate dimension (1 without HSDP)")


def keeper(rank: int, world_size: int, ranks_per_node: int, replicas: int = 1) -> Keeper:
    """The rank that keeps a copy of ``rank``'s chunks, always on another node.

    ``replicas`` is the size of HSDP's replicate dimension, with the mesh laid out
    ``(replicas, world_size // replicas)`` over global ranks as
    ``init_device_mesh`` does: rank ``g * shards + s`` holds shard ``s`` in group ``g``.
    The twin chosen is that of the nearest following group on another node (with
    several groups on one node, the twin next door would die with it).
    Without HSDP the copy goes ``ranks_per_node`` ahead round the world (the buddy
    ring), so a node's copies all sit on the next node and no rank keeps two.
    """
    _check_layout(world_size, ranks_per_node, replicas)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world size {world_size}")
    if replicas == 1:
        return Keeper((rank + ranks_per_node) % world_size, replica=False)
    shards = world_size // replicas
    group, shard = divmod(rank, shards)
    for step in range(1, replicas):
        twin = ((group + step) % replicas) * shards + shard
        if node_of(twin, ranks_per_node) != node_of(rank, ranks_per_node):
            return Keeper(twin, replica=True)
    # Unreachable: rank's twins span every node (one per replica group, groups tile the
    # world), and _check_layout made sure there are at least two nodes.
    raise AssertionError(f"no replica twin of rank {rank} on another node")


def keepers(world_size: int, ranks_per_node: int, replicas: int = 1) -> list[Keeper]:
    """:func:`keeper` for every rank, indexed by rank."""
    return [keeper(r, world_size, ranks_per_node, replicas) for r in range(world_size)]


def holdings(own: Mapping[int, Iterable[ChunkKey]], kept: Sequence[Keeper]
             ) -> dict[int, set[ChunkKey]]:
    """What each rank holds once copies are kept: its own chunks plus those of every
    rank it keeps for. ``own[r]`` are the chunks rank ``r`` wrote; ``kept`` as from
    :func:`keepers`. (Under HSDP a twin's own chunks are already the same keys.)"""
    held: dict[int, set[ChunkKey]] = {r: set(chunks) for r, chunks in own.items()}
    for r, chunks in own.items():
        held.setdefault(kept[r].rank, set()).update(chunks)
    return held


def lost_chunks(required: Iterable[ChunkKey], holdings: Mapping[int, Collection[ChunkKey]],
                live: Collection[int]) -> list[ChunkKey]:
    """The required chunks that no live rank holds, sorted (empty: all covered)."""
    covered: set[ChunkKey] = set()
    for r in live:
        covered.update(holdings.get(r, ()))
    return sorted(set(required) - covered)


def fragile_nodes(holdings: Mapping[int, Collection[ChunkKey]], world_size: int,
                  ranks_per_node: int) -> list[int]:
    """The nodes whose loss alone would lose some chunk: empty when the copies are laid
    out right. A check to run once the copies are in place, before relying on them."""
    required = {k for chunks in holdings.values() for k in chunks}
    nodes = range(world_size // ranks_per_node)
    return [n for n in nodes
            if lost_chunks(required, holdings,
                           [r for r in range(world_size) if node_of(r, ranks_per_node) != n])]


def schedule(requests: Mapping[int, Iterable[ChunkKey]],
             holdings: Mapping[int, Collection[ChunkKey]],
             live: Collection[int]) -> dict[int, dict[ChunkKey, int]]:
    """For each rank's requested chunks, the rank that sends each: ``{rank: {chunk: sender}}``.

    A rank that holds a chunk serves itself (a copy in memory, no network). Otherwise
    the chunk comes from the live holder that has been given the fewest chunks to send
    so far, ties to the lowest rank; requests are taken in sorted order, so every rank
    computes the same schedule whatever order it learnt the facts in. Raises
    :class:`ChunksLostError` naming every requested chunk with no live holder, before
    assigning anything: a partial restore would mix steps.
    """
    live_set = set(live)
    dead_askers = sorted(set(requests) - live_set)
    if dead_askers:
        raise ValueError(f"ranks {dead_askers} request chunks but are not live: pass the "
                         "new world's ranks as live")
    lost = lost_chunks((k for ks in requests.values() for k in ks), holdings, live_set)
    if lost:
        raise ChunksLostError(lost, live_set)
    holders: dict[ChunkKey, list[int]] = {}
    for r in sorted(live_set):
        for k in holdings.get(r, ()):
            holders.setdefault(k, []).append(r)
    load = dict.fromkeys(live_set, 0)
    plan: dict[int, dict[ChunkKey, int]] = {}
    for r in sorted(requests):
        mine = plan[r] = {}
        for k in sorted(set(requests[r])):
            if k in holdings.get(r, ()):
                mine[k] = r
                continue
            sender = min(holders[k], key=lambda h: (load[h], h))
            load[sender] += 1
            mine[k] = sender
    sent = sum(load.values())
    logger.debug("chunk schedule: %d chunks sent between ranks, at most %d by one rank",
              sent, max(load.values(), default=0))
    return plan
