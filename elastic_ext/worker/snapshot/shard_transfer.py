"""The collectives that move shard sets: one flat buffer per pair of ranks, in bounded pieces.

Whatever moves (a rank's set to its buddy after a step, the chunks a new world's rank
needs at a hand-off), everything one rank sends another travels as one buffer, cut in
pieces of at most ``handoff.CHUNK_BYTES``: the cost is a few large messages per pair,
never one per tensor. Both ends know the sizes beforehand (from the sets' headers), so
nothing else is sent. Under NCCL each piece goes through the GPU (one piece per pair at a
time beside the model); under gloo host memory is sent as it is.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from elastic_ext.worker.distributed import collective_device
from elastic_ext.worker.snapshot.handoff import CHUNK_BYTES

logger = logging.getLogger("elastic_ext.worker.snapshot")  # the whole package logs under one name


def flat(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """``parts`` (uint8 host tensors) back to back in one buffer."""
    if not parts:
        return torch.empty(0, dtype=torch.uint8)
    return torch.cat([p.reshape(-1) for p in parts]) if len(parts) > 1 else parts[0].reshape(-1)


def exchange(outgoing: Mapping[int, torch.Tensor], incoming: Mapping[int, int], *,
             group: dist.ProcessGroup | None = None,
             piece_bytes: int = CHUNK_BYTES) -> dict[int, torch.Tensor]:
    """Send ``outgoing[peer]`` to each peer and receive ``incoming[peer]`` bytes from each;
    the received buffers (uint8, host) by peer.

    Only the ranks named take part: every pair's two ends must call it with matching
    sizes. ``group`` None: the default group (peers are global ranks either way).
    """
    me = dist.get_rank()
    device = collective_device(group)
    received = {peer: torch.empty(size, dtype=torch.uint8) for peer, size in incoming.items()
                if peer != me}
    longest = max([t.numel() for p, t in outgoing.items() if p != me]
                  + [n for p, n in incoming.items() if p != me] + [0])
    for start in range(0, longest, piece_bytes):
        ops: list[dist.P2POp] = []
        landing: list[tuple[torch.Tensor, torch.Tensor]] = []
        for peer in sorted(outgoing):
            part = outgoing[peer][start:start + piece_bytes]
            if peer != me and part.numel():
                ops.append(dist.P2POp(dist.isend, part.to(device), peer, group))
        for peer in sorted(received):
            part = received[peer][start:start + piece_bytes]
            if part.numel():
                dest = part if device.type == "cpu" else torch.empty_like(part, device=device)
                ops.append(dist.P2POp(dist.irecv, dest, peer, group))
                landing.append((part, dest))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        for part, dest in landing:
            if dest is not part:
                part.copy_(dest)
    if me in outgoing:
        received[me] = outgoing[me]
    return received


def all_gather_objects(obj: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's ``obj`` (small, picklable: headers and requests), by rank."""
    found: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(found, obj, group=group)
    return found


__all__ = ["all_gather_objects", "exchange", "flat"]
