"""One rank's part of a sharded state as a flat buffer: what is kept, copied and sent.

A sharded state (FSDP2, HSDP: DTensors from ``get_model_state_dict`` and
``get_optimizer_state_dict``) has no rank that holds all of it. Each rank's part is
captured as a :class:`ShardSet`: the chunks DCP's own save planner gives this rank
(named as DCP names them: the flattened key and the chunk's offsets in the global
tensor), their bytes back to back in one host buffer, and the global shape of every
tensor. One buffer, not one message per tensor: a copy to another node or a hand-off
moves it as a few large sends (torchft measured a fixed ~4.8 s of per-tensor cost).

The set also carries the DCP metadata needed to load it at any world size
(:meth:`ShardSets.metadata` merges several ranks' sets into one checkpoint), and a
sha256 per chunk, so copies of the same chunk held on different nodes can be compared
before one is used. Files in node memory: ``shards-<step>-w<world>-r<rank>.bin`` (the
header's length, its sha256, the JSON header, then the buffer), written to a temporary
name and renamed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import logging
import math
import os
import re
import socket
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import WriteItemType

from elastic_ext.worker.snapshot.errors import SnapshotError
from elastic_ext.worker.snapshot.redundancy import ChunkKey

logger = logging.getLogger("elastic_ext.worker.snapshot")  # the whole package logs under one name

FORMAT = 1
_NAME_RE = re.compile(r"^shards-(\d{10})-w(\d+)-r(\d+)\.bin$")
_HEADER_LEN = struct.Struct("<Q")
_SEAL = 64  # the header's sha256, in hex, before it


class ShardSetDamagedError(SnapshotError):
    """A kept shard set's file is truncated, unreadable or fails its checksums."""


@dataclass(frozen=True)
class Chunk:
    """One saved chunk: its key, where its bytes are in the set's buffer, and its shape.

    ``dtype`` is None for a non-tensor item (DCP saves those as ``torch.save`` bytes)."""

    key: ChunkKey
    start: int
    length: int
    sha256: str
    dtype: str | None = None
    sizes: tuple[int, ...] = ()


@dataclass(frozen=True)
class TensorInfo:
    """A tensor of the whole state: its dtype and global shape."""

    dtype: str
    size: tuple[int, ...]


@dataclass(frozen=True)
class ShardSet:
    """The chunks ``owner`` (a rank of a world of ``world_size``) held at ``step``.

    ``round`` is the rendezvous round that trained the step (newest wins when copies of one
    step disagree); ``mappings`` is DCP's record of how the nested state was flattened
    (its ``planner_data``), the same on every rank of one state."""

    step: int
    round: int
    world_size: int
    owner: int
    chunks: tuple[Chunk, ...]
    tensors: Mapping[str, TensorInfo]
    mappings: Mapping[str, tuple[str, ...]]
    buffer: torch.Tensor
    """uint8, on the host."""

    @property
    def nbytes(self) -> int:
        return int(self.buffer.numel())

    def chunk_bytes(self, chunk: Chunk) -> torch.Tensor:
        return self.buffer[chunk.start:chunk.start + chunk.length]

    def header(self) -> dict[str, Any]:
        """Everything but the buffer, as JSON-ready data (see :func:`header_of`)."""
        return {
            "format": FORMAT, "step": self.step, "round": self.round,
            "world_size": self.world_size, "owner": self.owner, "nbytes": self.nbytes,
            "chunks": [[c.key[0], list(c.key[1]), c.start, c.length, c.sha256, c.dtype,
                        list(c.sizes)] for c in self.chunks],
            "tensors": {fqn: [t.dtype, list(t.size)] for fqn, t in self.tensors.items()},
            "mappings": {k: list(v) for k, v in self.mappings.items()},
        }

    def file_name(self) -> str:
        return set_file_name(self.step, self.world_size, self.owner)


def set_file_name(step: int, world_size: int, owner: int) -> str:
    return f"shards-{step:010d}-w{world_size}-r{owner}.bin"


def parse_set_name(name: str) -> tuple[int, int, int] | None:
    """``(step, world size, owner)`` of a kept set's file name, None for anything else."""
    match = _NAME_RE.match(name)
    return (int(match[1]), int(match[2]), int(match[3])) if match else None


def _dtype(name: str) -> torch.dtype:
    value = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        raise ShardSetDamagedError(f"unknown dtype {name!r} in a kept shard set")
    return value


def header_of(data: Mapping[str, Any], buffer: torch.Tensor) -> ShardSet:
    """A :class:`ShardSet` from :meth:`ShardSet.header`'s data and its buffer.

    Raises:
        ShardSetDamagedError: the header is not one this version wrote, or does not fit
            the buffer.
    """
    try:
        if data["format"] != FORMAT:
            raise ShardSetDamagedError(f"shard set format {data['format']}, expected {FORMAT}")
        chunks = tuple(Chunk(key=(str(fqn), tuple(int(o) for o in offsets)), start=int(start),
                             length=int(length), sha256=str(sha), dtype=dtype,
                             sizes=tuple(int(s) for s in sizes))
                       for fqn, offsets, start, length, sha, dtype, sizes in data["chunks"])
        tensors = {str(fqn): TensorInfo(str(dt), tuple(int(s) for s in size))
                   for fqn, (dt, size) in data["tensors"].items()}
        found = ShardSet(step=int(data["step"]), round=int(data["round"]),
                         world_size=int(data["world_size"]), owner=int(data["owner"]),
                         chunks=chunks, tensors=tensors,
                         mappings={k: tuple(v) for k, v in data["mappings"].items()},
                         buffer=buffer)
        nbytes = int(data["nbytes"])
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise ShardSetDamagedError(f"a kept shard set's header is malformed: {exc!r}") from exc
    if nbytes != buffer.numel() or any(c.start + c.length > buffer.numel() for c in chunks):
        raise ShardSetDamagedError(f"shard set of step {found.step} (rank {found.owner}) has "
                                   f"{buffer.numel()} bytes, its header says {nbytes}")
    return found


def _sha256(data: torch.Tensor) -> str:
    return hashlib.sha256(data.numpy().data).hexdigest() if data.numel() else hashlib.sha256(
        b"").hexdigest()


def _host_bytes(data: torch.Tensor | io.BytesIO) -> torch.Tensor:
    """A saved item's bytes as a uint8 tensor (a view of the tensor's own memory where it
    can be: a layout copies from it every step)."""
    if isinstance(data, io.BytesIO):
        return torch.frombuffer(bytearray(data.getvalue()), dtype=torch.uint8)
    t = data.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8)


@dataclass(frozen=True)
class Layout:
    """Where each of a state's tensor chunks goes in a set's buffer, and the tensors they
    come from (views of the live state: a capture copies them, nothing is planned again).

    Planned once with DCP's save planner (:func:`plan_layout`); valid while the state's
    tensors are the same objects in the same memory, which the caller checks."""

    chunks: tuple[Chunk, ...]
    sources: tuple[torch.Tensor, ...]
    """The live tensors (detached views), read at every capture."""
    tensors: Mapping[str, TensorInfo]
    mappings: Mapping[str, tuple[str, ...]]
    nbytes: int


_ALIGN = 16  # every chunk starts aligned, so a dtype view of it needs no copy


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def plan_layout(state_dict: Mapping[str, Any]) -> Layout:
    """This rank's tensor chunks of ``state_dict`` (what DCP would save: DTensors from
    ``get_model_state_dict`` and ``get_optimizer_state_dict``, plain tensors), replicas
    included (DCP's save keeps one replica of each; a hand-off needs them all).

    Raises:
        ValueError: ``state_dict`` holds a non-tensor value (pass those to
            :func:`capture` as ``extras``).
    """
    planner = DefaultSavePlanner()
    planner.set_up_planner(dict(state_dict), storage_meta=None, is_coordinator=True)
    plan = planner.create_local_plan()
    items = sorted(plan.items, key=lambda i: (i.index.fqn, tuple(i.index.offset or ())))
    chunks, sources = [], []
    tensors: dict[str, TensorInfo] = {}
    start = 0
    for item in items:
        if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
            raise ValueError(f"{item.index.fqn} is not a tensor: pass it as an extra")
        data = planner.resolve_data(item)
        assert isinstance(data, torch.Tensor)
        source = data.detach()
        dtype_name = str(item.tensor_data.properties.dtype)
        tensors[item.index.fqn] = TensorInfo(dtype_name, tuple(item.tensor_data.size))
        n = int(source.numel()) * source.element_size()
        chunks.append(Chunk(key=(item.index.fqn, tuple(item.index.offset or ())), start=start,
                            length=n, sha256="", dtype=dtype_name,
                            sizes=tuple(item.tensor_data.chunk.sizes)))
        sources.append(source)
        start = _aligned(start + n)
    mappings = {k: tuple(v) for k, v in getattr(planner, "mappings", {}).items()}
    return Layout(chunks=tuple(chunks), sources=tuple(sources), tensors=tensors,
                  mappings=mappings, nbytes=start)


def capture(layout: Layout, extras: Mapping[str, bytes], *, step: int, round_: int,
            world_size: int, owner: int, buffer: torch.Tensor | None = None) -> ShardSet:
    """The chunks ``layout`` names, copied now into one host buffer, then ``extras``
    (non-tensor items, already serialized, the same on every rank) after them.

    ``buffer`` is reused when it is large enough (a set copied every step allocates
    once); on a GPU it should be pinned. Device tensors are copied with
    ``non_blocking``: the caller synchronizes before reading the buffer, and captures
    only a step the device finished.
    """
    total = layout.nbytes + sum(_aligned(len(b)) for b in extras.values())
    if buffer is None or buffer.numel() < total:
        pinned = any(s.is_cuda for s in layout.sources)
        buffer = torch.empty(total, dtype=torch.uint8, pin_memory=pinned)
    for chunk, source in zip(layout.chunks, layout.sources, strict=True):
        # Read now, not when planned: a non-contiguous tensor is made contiguous each time.
        buffer[chunk.start:chunk.start + chunk.length].copy_(_host_bytes(source),
                                                             non_blocking=True)
        buffer[chunk.start + chunk.length:_aligned(chunk.start + chunk.length)].zero_()
    chunks = list(layout.chunks)
    start = layout.nbytes
    for fqn in sorted(extras):
        data = extras[fqn]
        if data:
            buffer[start:start + len(data)].copy_(torch.frombuffer(bytearray(data),
                                                                   dtype=torch.uint8))
        chunks.append(Chunk(key=(fqn, ()), start=start, length=len(data), sha256=""))
        buffer[start + len(data):_aligned(start + len(data))].zero_()  # no stale bytes saved
        start = _aligned(start + len(data))
    return ShardSet(step=step, round=round_, world_size=world_size, owner=owner,
                    chunks=tuple(chunks), tensors=layout.tensors, mappings=layout.mappings,
                    buffer=buffer[:total])


def with_digests(shards: ShardSet) -> ShardSet:
    """``shards`` with each chunk's sha256 filled in: done when a set is written or
    compared, not on every copy."""
    chunks = tuple(dataclasses.replace(c, sha256=_sha256(shards.chunk_bytes(c)))
                   for c in shards.chunks)
    return dataclasses.replace(shards, chunks=chunks)


def verify(shards: ShardSet, origin: str) -> None:
    """Raise :class:`ShardSetDamagedError` naming ``origin`` if a chunk's bytes do not match
    its sha256 or its shape."""
    for c in shards.chunks:
        if c.dtype is not None and c.length != math.prod(c.sizes) * _dtype(c.dtype).itemsize:
            raise ShardSetDamagedError(f"{origin}: chunk {c.key[0]}@{list(c.key[1])} has "
                                       f"{c.length} bytes, not those of {c.dtype} {list(c.sizes)}")
        if c.sha256 and _sha256(shards.chunk_bytes(c)) != c.sha256:
            raise ShardSetDamagedError(f"{origin}: chunk {c.key[0]}@{list(c.key[1])} fails its "
                                       "sha256: the copy is damaged and is not used")


def write_set(directory: Path, shards: ShardSet) -> Path:
    """Write ``shards`` to ``directory`` atomically, with each chunk's sha256 and one of
    the header; its path."""
    if any(not c.sha256 for c in shards.chunks):
        shards = with_digests(shards)
    text = json.dumps(shards.header()).encode()
    header = hashlib.sha256(text).hexdigest().encode() + text  # the header's own seal
    path = directory / shards.file_name()
    tmp = directory / f".{shards.file_name()}.{socket.gethostname()}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(_HEADER_LEN.pack(len(header)))
        f.write(header)
        f.write(shards.buffer.numpy().data)
    os.replace(tmp, path)
    return path


def read_set(path: Path) -> ShardSet:
    """A set :func:`write_set` wrote, its checksums verified.

    Raises:
        ShardSetDamagedError: truncated, malformed or failing a checksum (the message
            names the file).
    """
    try:
        raw = path.read_bytes()
        (length,) = _HEADER_LEN.unpack_from(raw)
        sealed = raw[_HEADER_LEN.size:_HEADER_LEN.size + length]
        seal, text = sealed[:_SEAL], sealed[_SEAL:]
        if len(sealed) != length or hashlib.sha256(text).hexdigest().encode() != seal:
            raise ValueError("its header fails its sha256")
        data = json.loads(text)
        body = bytearray(raw[_HEADER_LEN.size + length:])
    except (OSError, struct.error, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ShardSetDamagedError(f"{path} cannot be read as a kept shard set: {exc}; it is "
                                   "not used") from exc
    empty = torch.empty(0, dtype=torch.uint8)
    buffer = torch.frombuffer(body, dtype=torch.uint8) if body else empty
    try:
        shards = header_of(data, buffer)
        verify(shards, str(path))
    except ShardSetDamagedError as exc:
        message = str(exc) if str(path) in str(exc) else f"{path}: {exc}"
        raise ShardSetDamagedError(message) from exc
    if parse_set_name(path.name) != (shards.step, shards.world_size, shards.owner):
        raise ShardSetDamagedError(f"{path} holds the set of step {shards.step}, world "
                                   f"{shards.world_size}, rank {shards.owner}: its name says "
                                   "otherwise; it is not used")
    return shards


def list_sets(directory: Path) -> list[tuple[int, int, int, Path]]:
    """``(step, world size, owner, path)`` of every kept set in ``directory``, newest first."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    found = [(*parsed, directory / name) for name in names
             if (parsed := parse_set_name(name)) is not None]
    return sorted(found, key=lambda f: (-f[0], f[1], f[2]))


def metadata(sets: Sequence[ShardSet], chosen: Iterable[ChunkKey] | None = None) -> Metadata:
    """DCP metadata of the checkpoint that ``sets`` (one step of one world) make together:
    every tensor's global shape and the chunks saved of it (``chosen`` only, if given),
    every non-tensor item. DCP's load planner reads from it which saved chunk covers which
    part of each tensor the new world's ranks hold."""
    wanted = set(chosen) if chosen is not None else None
    seen: set[ChunkKey] = set()
    tensor_chunks: dict[str, list[ChunkStorageMetadata]] = {}
    byte_items: set[str] = set()
    tensors: dict[str, TensorInfo] = {}
    mappings: dict[str, tuple[str, ...]] = {}
    for s in sets:
        tensors.update(s.tensors)
        mappings.update(s.mappings)
        for c in s.chunks:
            if c.key in seen or (wanted is not None and c.key not in wanted):
                continue
            seen.add(c.key)
            if c.dtype is None:
                byte_items.add(c.key[0])
            else:
                tensor_chunks.setdefault(c.key[0], []).append(
                    ChunkStorageMetadata(offsets=torch.Size(c.key[1]),
                                         sizes=torch.Size(c.sizes)))
    state_md: dict[str, Any] = {fqn: BytesStorageMetadata() for fqn in byte_items}
    for fqn, info in tensors.items():
        state_md[fqn] = TensorStorageMetadata(
            properties=TensorProperties(dtype=_dtype(info.dtype)), size=torch.Size(info.size),
            chunks=tensor_chunks.get(fqn, []))
    return Metadata(state_dict_metadata=state_md, planner_data=dict(mappings))


__all__ = ["Chunk", "Layout", "ShardSet", "ShardSetDamagedError", "TensorInfo", "capture",
           "header_of", "list_sets", "metadata", "parse_set_name", "plan_layout", "read_set",
           "set_file_name", "verify", "with_digests", "write_set"]
