"""What ``ElasticLoop`` does differently for a sharded model (FSDP2, HSDP).

The loop's protocol is the same for every model; only where the state goes differs.
A restore given a module whose parameters are DTensors switches the loop to
``snapshot.sharded.ShardedState``: kept shards and buddy copies in node memory, a
reshard from peers' memory at the new world size, DCP snapshots on disk. This module
builds that object from the names a loop passed to ``restore`` and the round's mesh.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from elastic_ext.worker.distributed import collective_device
from elastic_ext.worker.snapshot import Restored, Stateful
from elastic_ext.worker.snapshot.local import LocalCopies
from elastic_ext.worker.snapshot.sharded import ShardedState, ShardRestored, is_sharded


def round_mesh(device_type: str, world_size: int, *, hsdp: bool) -> DeviceMesh:
    """This round's mesh: 1-D over every rank, or (``hsdp``) ``("replicate", "shard")`` =
    (nodes, ``LOCAL_WORLD_SIZE``).

    Raises:
        ValueError: ``hsdp`` with a world size that is not a whole number of nodes.
    """
    if not hsdp:
        return init_device_mesh(device_type, (world_size,))
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if per_node < 1 or world_size % per_node:
        raise ValueError(f"world size {world_size} is not a whole number of nodes of "
                         f"LOCAL_WORLD_SIZE={per_node}: start every node with the same "
                         "--nproc-per-node, or call mesh() without hsdp")
    return init_device_mesh(device_type, (world_size // per_node, per_node),
                            mesh_dim_names=("replicate", "shard"))


def sharded_state_for(objects: Mapping[str, Stateful], *, snapshot_dir: Any,
                      copy_every: int, keep_snapshots: int,
                      copy_in_background: bool = False) -> ShardedState | None:
    """The sharded keeper for what a loop named in ``restore``, or None for a replicated
    (DDP) state.

    Raises:
        ValueError: more than one sharded module, or a sharded module beside a plain one
            (the message says how to name them).
    """
    sharded = [n for n, o in objects.items() if isinstance(o, torch.nn.Module) and is_sharded(o)]
    if not sharded:
        return None
    plain = [n for n, o in objects.items() if isinstance(o, torch.nn.Module) and n not in sharded]
    if len(sharded) > 1 or plain:
        raise ValueError(f"restore() got sharded modules {sharded} and plain modules {plain}: "
                         "name one model, the root module you called fully_shard on (its "
                         "submodules are part of it)")
    name = sharded[0]
    optimizers = {n: o for n, o in objects.items() if isinstance(o, torch.optim.Optimizer)}
    others = {n: o for n, o in objects.items() if n != name and n not in optimizers}
    local = LocalCopies.of_this_node()
    model = objects[name]
    assert isinstance(model, torch.nn.Module)
    return ShardedState(model, optimizers, others, model_name=name,
                        local_dir=local.directory if local is not None else None,
                        snapshot_dir=snapshot_dir, copy_every=copy_every,
                        keep_snapshots=keep_snapshots, copy_in_background=copy_in_background)


def as_restored(found: ShardRestored | None, started: float) -> Restored | None:
    """A sharded restore as the loop reports every restore."""
    if found is None:
        return None
    return Restored(step=found.step, path=None, state=found.rest, source=found.source,
                    origin=found.origin, bytes=found.bytes,
                    seconds=time.perf_counter() - started)


__all__ = ["as_restored", "round_mesh", "sharded_state_for"]


def every_rank_reduced() -> None:
    """Before a sharded update, on every rank: one all-reduce of one number, so that no rank
    updates its shards unless every rank got through the step's gradient collectives.

    A replica's state is whole by itself, a shard is not: when a peer dies inside the
    backward's collectives, some ranks may finish them (and update) while others fail,
    and then no step is held by every shard position (a rank at N+1 no longer holds N),
    so the next round would go back to an older copy. With this barrier a rank that got
    through waits here for the others, and fails with them: every survivor keeps N. The
    split can still happen inside this all-reduce itself, a far narrower window. On gloo
    it returns once every rank arrived; on NCCL it only queues, and ``HeldStep``'s
    markers decide whether the update that follows counts.
    """
    flag = torch.zeros(1, device=collective_device())
    torch.distributed.all_reduce(flag)
