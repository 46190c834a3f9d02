"""The collectives of a restore: every rank says what it holds, the chosen copy is sent.

Reports are fixed-size int64 rows (one all-gather); the copy travels as the bytes of
its payload file (one broadcast), so what a receiver loads is exactly what the sender
verified, and the receiver checks the sha256 the sender reported.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch
import torch.distributed as dist

from elastic_ext.distributed import collective_device, rank, world_size
from elastic_ext.snapshot.agreement import Copy, Holding
from elastic_ext.snapshot.errors import SnapshotError

_NONE = -1
_COPY_FIELDS = 8  # step, size, created (ms), round, sha256 as four int64


def _encode_copy(copy: Copy | None) -> list[int]:
    if copy is None:
        return [_NONE] * _COPY_FIELDS
    digest = bytes.fromhex(copy.sha256)
    return [copy.step, copy.size, round(copy.created * 1000), copy.round,
            *(int.from_bytes(digest[i:i + 8], "big", signed=True) for i in range(0, 32, 8))]


def _decode_copy(row: list[int]) -> Copy | None:
    if row[0] == _NONE:
        return None
    digest = b"".join(v.to_bytes(8, "big", signed=True) for v in row[4:8])
    return Copy(step=row[0], size=row[1], sha256=digest.hex(), created=row[2] / 1000,
                round=row[3])


def encode(holding: Holding) -> list[int]:
    """A rank's report as the int64 row the all-gather carries."""
    return [int(holding.failed), *_encode_copy(holding.memory), *_encode_copy(holding.disk)]


def decode(row: list[int]) -> Holding:
    return Holding(failed=bool(row[0]), memory=_decode_copy(row[1:1 + _COPY_FIELDS]),
                   disk=_decode_copy(row[1 + _COPY_FIELDS:]))


def gather(mine: Holding) -> list[Holding]:
    """Every rank's report, by rank; collective."""
    if world_size() == 1:
        return [mine]
    row = torch.tensor(encode(mine), dtype=torch.int64, device=collective_device())
    rows = [torch.empty_like(row) for _ in range(world_size())]
    dist.all_gather(rows, row)
    return [decode([int(v) for v in r.cpu().tolist()]) for r in rows]


def read_bytes(path: Path, size: int) -> torch.Tensor:
    """The file at ``path`` as a uint8 tensor of ``size`` bytes (SnapshotError if shorter)."""
    buffer = torch.empty(size, dtype=torch.uint8)
    view = buffer.numpy().data
    with open(path, "rb", buffering=0) as f:
        done = 0
        while done < size:
            n = f.readinto(view[done:])
            if not n:
                raise SnapshotError(f"{path} has fewer than the {size} bytes its manifest says")
            done += n
    return buffer


def sha256_of(buffer: torch.Tensor) -> str:
    return hashlib.sha256(buffer.numpy().data).hexdigest()


def send(buffer: torch.Tensor | None, copy: Copy, source: int) -> torch.Tensor:
    """``source``'s ``buffer`` on every rank; a receiver checks its sha256. Collective."""
    if world_size() == 1:
        assert buffer is not None
        return buffer
    device = collective_device()
    if rank() == source:
        assert buffer is not None
        dist.broadcast(buffer.to(device), src=source)
        return buffer
    received = torch.empty(copy.size, dtype=torch.uint8, device=device)
    dist.broadcast(received, src=source)
    result = received.cpu()
    digest = sha256_of(result)
    if digest != copy.sha256:
        raise SnapshotError(f"the state of step {copy.step} received from rank {source} has "
                            f"sha256 {digest[:16]}..., rank {source} reported "
                            f"{copy.sha256[:16]}...")
    return result


def local_rank() -> int:
    """This worker's rank on its node (torchrun's LOCAL_RANK; 0 for a lone process)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


__all__ = ["decode", "encode", "gather", "local_rank", "read_bytes", "send", "sha256_of"]
