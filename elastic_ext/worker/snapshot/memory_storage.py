"""torch.distributed.checkpoint (DCP) storage that lives in memory, not on disk.

Sharded state restored after a node loss comes from copies the survivors keep in host
memory, and the new world's ranks need other chunks than the old world's wrote. DCP
already knows how to cut saved chunks into a new layout (its planners compute, for
each chunk a rank needs, which saved chunk and which slice of it); these classes let it
do so with memory as the storage:

* :class:`MemoryWriter` keeps each saved chunk's bytes in :attr:`MemoryWriter.chunks`,
  keyed by :data:`~elastic_ext.worker.snapshot.redundancy.ChunkKey`.
* :class:`MemoryReader` serves DCP's reads from any mapping of chunk key to bytes: here
  a dict handed in (chunks gathered from several writers), or (``peer_reader``) the
  chunks other ranks send from their memory.

Both use only DCP's public API (``StorageWriter``, ``StorageReader``, the plan items
and ``Metadata``), so nothing here is in ``elastic_ext.torch_compat``. In one process,
``dcp.save(state, storage_writer=w, no_dist=True)`` then
``dcp.load(state, storage_reader=MemoryReader(metadata, w.chunks), no_dist=True)``
round-trips a state without a process group.
"""

from __future__ import annotations

import io
import logging
import math
import os
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from elastic_ext.worker.snapshot.errors import SnapshotError
from elastic_ext.worker.snapshot.redundancy import ChunkKey

logger = logging.getLogger(__name__)


class ChunkDamagedError(SnapshotError):
    """A chunk in memory is missing or does not have the size DCP's metadata gives it."""


def chunk_key(index: MetadataIndex) -> ChunkKey:
    """DCP's name for a saved chunk as a plain, hashable, picklable key."""
    return (index.fqn, tuple(index.offset) if index.offset is not None else ())


def _done(value: Any) -> Future[Any]:
    future: Future[Any] = Future()
    future.set_result(value)
    return future


def _to_bytes(data: torch.Tensor | io.BytesIO) -> bytes:
    if isinstance(data, io.BytesIO):
        return data.getvalue()
    # A copy: the trainer goes on changing the tensor after the save returns.
    return data.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


class MemoryWriter(StorageWriter):
    """A DCP storage writer that keeps this rank's chunks as bytes in :attr:`chunks`.

    DCP's coordinator drops replicated items (the same chunk saved by several ranks,
    as DDP or HSDP replicas do) from all ranks' plans but one. With ``keep_all`` this
    writer keeps every item its rank planned before that, so each replica holds its
    own copy: under HSDP the replica twin then serves a lost rank's chunks.
    :attr:`metadata` is the checkpoint's global metadata, on the coordinator, once
    the save finished (``dcp.save`` also returns it).
    """

    def __init__(self, keep_all: bool = False) -> None:
        super().__init__()
        self.keep_all = keep_all
        self.chunks: dict[ChunkKey, bytes] = {}
        self.metadata: Metadata | None = None
        self._planned: list[WriteItem] | None = None

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.chunks = {}
        self.metadata = None
        self._planned = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        self._planned = list(plan.items)  # before the coordinator's dedup
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        items = self._planned if self.keep_all and self._planned is not None else plan.items
        results = []
        for item in items:
            data = _to_bytes(planner.resolve_data(item))
            self.chunks[chunk_key(item.index)] = data
            results.append(WriteResult(index=item.index, size_in_bytes=len(data),
                                       storage_data=chunk_key(item.index)))
        # DCP's metadata lists what the final plan wrote; the extra replicas are ours only.
        final = {chunk_key(i.index) for i in plan.items}
        logger.debug("kept %d chunks (%d bytes) in memory", len(self.chunks),
                  sum(len(b) for b in self.chunks.values()))
        return _done([r for r in results if chunk_key(r.index) in final])

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        self.metadata = metadata

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False


class MemoryReader(StorageReader):
    """A DCP storage reader that reads chunks from ``chunks`` (chunk key to bytes).

    ``metadata`` is the global metadata of the save that produced the chunks; it gives
    each tensor chunk's dtype and size, so a chunk of the wrong length is refused
    (:class:`ChunkDamagedError`, naming it) instead of loaded as garbage. A read item
    may ask for part of a saved chunk (the new world cuts the tensor elsewhere): the
    chunk is narrowed to the slice DCP's planner asked for.
    """

    def __init__(self, metadata: Metadata, chunks: Mapping[ChunkKey, bytes | torch.Tensor]
                 ) -> None:
        super().__init__()
        self.metadata = metadata
        self.chunks = chunks
        self._sizes: dict[ChunkKey, tuple[torch.dtype, torch.Size]] = {}
        for fqn, md in metadata.state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata):
                for chunk in md.chunks:
                    self._sizes[(fqn, tuple(chunk.offsets))] = (md.properties.dtype, chunk.sizes)

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        pass

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self.metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool,
                              *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        for item in plan.items:
            key = chunk_key(item.storage_index)
            if key not in self.chunks:
                raise ChunkDamagedError(
                    f"chunk {key[0]}@{list(key[1])} is not in the memory handed to the "
                    "reader: gather every chunk the load plan reads (the schedule names "
                    "their senders) or restore from the durable snapshot")
            raw = self.chunks[key]
            if item.type == LoadItemType.BYTE_IO:
                as_bytes = raw if isinstance(raw, bytes) else raw.numpy().tobytes()
                planner.load_bytes(item, io.BytesIO(as_bytes))
                continue
            source = self._slice(item, key, raw)
            target = planner.resolve_tensor(item).detach()
            if target.shape != source.shape:
                raise ChunkDamagedError(
                    f"chunk {key[0]}@{list(key[1])}: the planner's target has shape "
                    f"{tuple(target.shape)} but the read is {tuple(source.shape)}; the "
                    "metadata is not the one the chunks were saved with")
            target.copy_(source)
            planner.commit_tensor(item, target)
        return _done(None)

    def _slice(self, item: ReadItem, key: ChunkKey, raw: bytes | torch.Tensor) -> torch.Tensor:
        """The part of the saved chunk ``raw`` that ``item`` reads, as a tensor view."""
        if key not in self._sizes:
            raise ChunkDamagedError(f"chunk {key[0]}@{list(key[1])} is not a tensor chunk in "
                                    "the metadata: pass the metadata of the same save")
        dtype, sizes = self._sizes[key]
        expected = math.prod(sizes) * dtype.itemsize
        if len(raw) != expected:
            raise ChunkDamagedError(
                f"chunk {key[0]}@{list(key[1])} has {len(raw)} bytes, its metadata says "
                f"{expected} ({dtype}, {list(sizes)}): the copy in memory is damaged; "
                "restore from the durable snapshot")
        if expected == 0:
            chunk = torch.empty(sizes, dtype=dtype)
        elif isinstance(raw, torch.Tensor):
            if raw.storage_offset() % dtype.itemsize:  # a view must start aligned
                raw = raw.clone()
            chunk = raw.view(dtype).reshape(sizes)
        else:
            with warnings.catch_warnings():
                # bytes are read-only; the view is only read from (copied into the target).
                warnings.filterwarnings("ignore", message=".*not writable.*")
                chunk = torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(sizes)
        cut = zip(item.storage_offsets, item.lengths, strict=True)
        for dim, (offset, length) in enumerate(cut):
            chunk = chunk.narrow(dim, offset, length)
        return chunk

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False
