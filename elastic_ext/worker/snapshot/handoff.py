"""The collectives of a restore: every rank says what it holds, the chosen copy is sent.

Reports are fixed-size int64 rows (one all-gather); the copy travels as the bytes of
its payload file, so what a receiver loads is exactly what the sender verified, and the
receiver checks the sha256 the sender reported. Only the ranks that lack the copy
receive it (``Plan.receivers``): one broadcast when every other rank does, else one
send per receiver. The bytes move in chunks of ``CHUNK_BYTES``, so a GPU holds at most
one chunk of the payload beside the model (NCCL moves device memory only; gloo moves
host memory and never touches a GPU here).
"""

from __future__ import annotations

import hashlib
import os
import socket
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from elastic_ext.worker.distributed import collective_device, rank, world_size
from elastic_ext.worker.snapshot.agreement import Copy, Holding
from elastic_ext.worker.snapshot.errors import SnapshotError

_NONE = -1
_COPY_FIELDS = 8  # step, size, created (ms), round, sha256 as four int64
CHUNK_BYTES = 64 << 20
"""The most payload bytes on a GPU at once during a hand-off."""


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
    return [int(holding.failed), holding.node, *_encode_copy(holding.memory),
            *_encode_copy(holding.disk)]


def decode(row: list[int]) -> Holding:
    return Holding(failed=bool(row[0]), node=row[1], memory=_decode_copy(row[2:2 + _COPY_FIELDS]),
                   disk=_decode_copy(row[2 + _COPY_FIELDS:]))


def node_id(directory: Path | None) -> int:
    """This rank's ``Holding.node``: its host and snapshot directory, as a signed int64."""
    where = f"{socket.gethostname()}:{os.path.realpath(directory) if directory else ''}"
    return int.from_bytes(hashlib.sha256(where.encode()).digest()[:8], "big", signed=True)


def gather(mine: Holding) -> list[Holding]:
    """Every rank's report, by rank; collective."""
    if world_size() == 1:
        return [mine]
    row = torch.tensor(encode(mine), dtype=torch.int64, device=collective_device())
    rows = [torch.empty_like(row) for _ in range(world_size())]
    dist.all_gather(rows, row)
    return [decode([int(v) for v in r.cpu().tolist()]) for r in rows]


def sha256_of(buffer: torch.Tensor) -> str:
    return hashlib.sha256(buffer.numpy().data).hexdigest()


def send(buffer: torch.Tensor | None, copy: Copy, source: int,
         receivers: Sequence[int]) -> torch.Tensor | None:
    """``source``'s ``buffer`` to each of ``receivers``, in chunks; collective when every
    rank but the source receives, else only the source and the receivers take part.
    Returns the bytes on a receiver (its sha256 checked), ``buffer`` on the others."""
    me = rank()
    if me != source and me not in receivers:
        return buffer
    if me == source:
        assert buffer is not None
        if receivers:
            _move(buffer, copy.size, source, receivers)
        return buffer
    received = torch.empty(copy.size, dtype=torch.uint8)
    _move(received, copy.size, source, receivers)
    digest = sha256_of(received)
    if digest != copy.sha256:
        raise SnapshotError(f"the state of step {copy.step} received from rank {source} has "
                            f"sha256 {digest[:16]}..., rank {source} reported "
                            f"{copy.sha256[:16]}...")
    return received


def _move(host: torch.Tensor, size: int, source: int, receivers: Sequence[int]) -> None:
    """Chunk by chunk from ``source``'s ``host`` into the receivers' ``host``, through the
    device the backend moves (one chunk of it at a time)."""
    device = collective_device()
    everyone = len(receivers) == world_size() - 1
    me = rank()
    for start in range(0, size, CHUNK_BYTES):
        part = host[start:start + CHUNK_BYTES]
        chunk = part.to(device) if me == source else torch.empty_like(part, device=device)
        if everyone:
            dist.broadcast(chunk, src=source)
        elif me == source:
            for receiver in receivers:
                dist.send(chunk, dst=receiver)
        else:
            dist.recv(chunk, src=source)
        if me != source:
            part.copy_(chunk)


def local_rank() -> int:
    """This worker's rank on its node (torchrun's LOCAL_RANK; 0 for a lone process)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


__all__ = ["CHUNK_BYTES", "decode", "encode", "gather", "local_rank", "node_id", "send",
           "sha256_of"]
