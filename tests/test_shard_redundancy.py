"""Who keeps a copy of whose shard, and who sends which chunk (issue #40): pure rules,
no processes."""

from __future__ import annotations

import pytest

from elastic_ext.worker.snapshot.redundancy import (
    ChunkKey,
    ChunksLostError,
    Keeper,
    fragile_nodes,
    holdings,
    keeper,
    keepers,
    lost_chunks,
    node_of,
    schedule,
)


def shard_of(rank: int) -> set[ChunkKey]:
    """Rank ``rank``'s chunks in a 1-D FSDP layout: a row block of two tensors."""
    return {("layer.w", (rank * 4, 0)), ("layer.b", (rank * 4,))}


@pytest.mark.parametrize(("world", "per_node"), [(8, 4), (6, 2), (4, 1), (4, 2)])
def test_the_buddy_is_on_another_node_and_every_rank_keeps_one_copy(world: int,
                                                                     per_node: int) -> None:
    kept = keepers(world, per_node)
    for r, k in enumerate(kept):
        assert node_of(k.rank, per_node) != node_of(r, per_node), (r, k)
        assert not k.replica
    assert sorted(k.rank for k in kept) == list(range(world))  # no rank keeps two copies
    assert keeper(0, world, per_node).rank == per_node % world
    own = {r: shard_of(r) for r in range(world)}
    assert fragile_nodes(holdings(own, kept), world, per_node) == []


def test_without_copies_every_node_is_fragile() -> None:
    own = {r: shard_of(r) for r in range(4)}
    assert fragile_nodes(own, 4, 2) == [0, 1]


def test_hsdp_2x2_keeps_the_replica_twin() -> None:
    # Mesh (replicate=2, shard=2), one replica group per node: rank g*2+s holds shard s.
    assert keepers(4, 2, replicas=2) == [Keeper(2, True), Keeper(3, True),
                                         Keeper(0, True), Keeper(1, True)]
    own = {r: {("w", ((r % 2) * 8, 0))} for r in range(4)}
    # The twin's own chunks are the copy: nothing extra is held.
    assert holdings(own, keepers(4, 2, replicas=2)) == own
    assert fragile_nodes(own, 4, 2) == []


def test_hsdp_skips_a_twin_on_the_same_node() -> None:
    # Mesh (replicate=4, shard=2) on 2 nodes of 4: groups 0 and 1 share node 0.
    assert keeper(0, 8, 4, replicas=4) == Keeper(4, True)
    assert keeper(3, 8, 4, replicas=4) == Keeper(5, True)
    assert keeper(6, 8, 4, replicas=4) == Keeper(0, True)


@pytest.mark.parametrize(("world", "per_node", "replicas", "says"), [
    (6, 4, 1, "nproc-per-node"), (4, 4, 1, "one node"), (8, 2, 3, "replicate dimension")])
def test_a_bad_layout_is_refused_naming_the_fix(world: int, per_node: int, replicas: int,
                                                says: str) -> None:
    with pytest.raises(ValueError, match=says):
        keeper(0, world, per_node, replicas)


def test_the_schedule_prefers_the_rank_itself() -> None:
    # Rank 1 holds "a" as do 0 and 2 (both unloaded): it still serves itself.
    held = {0: {("a", ())}, 1: {("a", ()), ("b", ())}, 2: {("a", ())}}
    assert schedule({1: [("a", ()), ("b", ())]}, held, [0, 1, 2]) == \
        {1: {("a", ()): 1, ("b", ()): 1}}


def test_the_schedule_balances_the_senders() -> None:
    keys = [(f"p{i}", (0,)) for i in range(6)]
    held = {0: set(keys), 1: set(keys), 2: set(keys), 3: set()}
    plan = schedule({3: keys}, held, [0, 1, 2, 3])
    senders = sorted(plan[3].values())
    assert senders == [0, 0, 1, 1, 2, 2]


def test_the_schedule_is_deterministic_and_ties_go_to_the_lowest_rank() -> None:
    keys = [("w", (i, 0)) for i in range(5)]
    held = {0: set(keys), 1: set(keys), 4: set(), 5: set()}
    one = schedule({4: keys, 5: keys}, held, [0, 1, 4, 5])
    other = schedule({5: list(reversed(keys)), 4: list(reversed(keys))},
                     {5: set(), 4: set(), 1: set(keys), 0: set(keys)}, [5, 4, 1, 0])
    assert one == other
    assert one[4][("w", (0, 0))] == 0  # first request, all loads zero: the lowest rank
    assert sorted([*one[4].values(), *one[5].values()]) == [0] * 5 + [1] * 5


def test_a_chunk_and_its_copy_both_lost_is_named() -> None:
    # Three nodes of one rank; rank 0's copy is on rank 1. Ranks 0 and 1 die.
    kept = keepers(3, 1)
    held = holdings({r: shard_of(r) for r in range(3)}, kept)
    live = [2]
    assert lost_chunks(shard_of(0), held, live) == sorted(shard_of(0))
    assert lost_chunks(shard_of(1), held, live) == []  # its copy is on rank 2
    request = {2: sorted(shard_of(0) | shard_of(1))}
    with pytest.raises(ChunksLostError, match=r"layer\.w@\[0, 0\].*durable snapshot") as err:
        schedule(request, held, live)
    assert err.value.lost == sorted(shard_of(0))


def test_losing_one_node_is_survived() -> None:
    held = holdings({r: shard_of(r) for r in range(4)}, keepers(4, 2))
    everything = sorted(set().union(*(shard_of(r) for r in range(4))))
    plan = schedule({2: everything[:4], 3: everything[4:]}, held, [2, 3])
    assert set(plan[2].values()) | set(plan[3].values()) <= {2, 3}


def test_a_dead_rank_cannot_request() -> None:
    with pytest.raises(ValueError, match="not live"):
        schedule({0: [("a", ())]}, {1: {("a", ())}}, [1])
