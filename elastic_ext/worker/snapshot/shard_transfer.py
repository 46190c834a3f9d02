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


def exchange(outgoing: Mapping[int, Sequence[torch.Tensor]],
             incoming: Mapping[int, Sequence[int]], *,
             group: dist.ProcessGroup | None = None,
             piece_bytes: int = CHUNK_BYTES) -> dict[int, list[torch.Tensor]]:
    """Send the buffers ``outgoing[peer]`` (uint8, host) to each peer and receive buffers
    of the sizes ``incoming[peer]`` from each; the received buffers by peer.

    Only the ranks named take part: every pair's two ends must call it with matching
    sizes, in the same order. ``group`` None: the default group (peers are global ranks
    either way). A buffer for this rank itself is handed back as it is.
    """
    me = dist.get_rank()
    device = collective_device(group)
    received = {peer: [torch.empty(n, dtype=torch.uint8) for n in sizes]
                for peer, sizes in incoming.items() if peer != me}
    sends = [(peer, buf) for peer in sorted(outgoing) if peer != me for buf in outgoing[peer]]
    recvs = [(peer, buf) for peer in sorted(received) for buf in received[peer]]
    longest = max([int(b.numel()) for _, b in sends + recvs] + [0])
    for start in range(0, longest, piece_bytes):
        ops: list[dist.P2POp] = []
        landing: list[tuple[torch.Tensor, torch.Tensor]] = []
        for peer, buf in sends:
            part = buf[start:start + piece_bytes]
            if part.numel():
                ops.append(dist.P2POp(dist.isend, part.to(device), peer, group))
        for peer, buf in recvs:
            part = buf[start:start + piece_bytes]
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
        received[me] = list(outgoing[me])
    return received


def all_gather_objects(obj: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's ``obj`` (small, picklable: headers and requests), by rank."""
    found: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(found, obj, group=group)
    return found


__all__ = ["all_gather_objects", "exchange", "flat"]
