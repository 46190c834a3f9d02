"""DCP storage in memory (issue #40): saved chunks kept as bytes, loaded back through
DCP's own planners in one process, with no process group. Two "ranks" are played by
driving DCP's save protocol by hand (their plans gathered in a list, as DCP's
collective would), so chunks can be uneven and replicated items deduplicated."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from elastic_ext.worker.snapshot.memory_storage import (
    ChunkDamagedError,
    MemoryReader,
    MemoryWriter,
)
from elastic_ext.worker.snapshot.redundancy import ChunkKey

W = torch.arange(20, dtype=torch.float32).reshape(5, 4) / 7   # sharded by rows: 3 + 2
B = torch.arange(7, dtype=torch.bfloat16) - 3                 # sharded: 4 + 3
R = torch.tensor([1.5, float("nan"), -0.0])                    # replicated on both ranks


def refused(load: Any, pattern: str) -> None:
    """``load()`` fails with a ChunkDamagedError matching ``pattern``. DCP wraps the
    reader's error in its CheckpointException, a BaseException (not an Exception)."""
    with pytest.raises(dcp.CheckpointException) as err:
        load()
    cause = err.value.failures[0][0]
    assert isinstance(cause, ChunkDamagedError), cause
    assert re.search(pattern, str(cause)), str(cause)


def bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


class ShardPlanner(DefaultSavePlanner):
    """One rank's save plan for its pieces {fqn: (offsets, local tensor, global size)},
    as FSDP's DTensors would make it, without a device mesh."""

    def __init__(self, pieces: dict[str, tuple[tuple[int, ...], torch.Tensor, torch.Size]]):
        super().__init__(flatten_state_dict=False)
        self.pieces = pieces

    def create_local_plan(self) -> SavePlan:
        self.plan = SavePlan([WriteItem(
            index=MetadataIndex(fqn, torch.Size(offsets)), type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(torch.Size(offsets), local.size()),
                properties=TensorProperties.create_from_tensor(local), size=size))
            for fqn, (offsets, local, size) in self.pieces.items()])
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        return self.pieces[write_item.index.fqn][1]


def save_two_ranks(keep_all: bool = False) -> tuple[Metadata, list[MemoryWriter]]:
    """DCP's save protocol for two ranks, the collectives replaced by lists."""
    pieces = [{"w": ((0, 0), W[:3], W.size()), "b": ((0,), B[:4], B.size()),
               "r": ((0,), R.clone(), R.size())},
              {"w": ((3, 0), W[3:], W.size()), "b": ((4,), B[4:], B.size()),
               "r": ((0,), R.clone(), R.size())}]
    planners = [ShardPlanner(p) for p in pieces]
    writers = [MemoryWriter(keep_all=keep_all) for _ in pieces]
    local_plans = []
    for rank, (planner, writer) in enumerate(zip(planners, writers, strict=True)):
        planner.set_up_planner({}, is_coordinator=rank == 0)
        writer.set_up_storage_writer(rank == 0)
        local_plans.append(writer.prepare_local_plan(planner.create_local_plan()))
    global_plans, metadata = planners[0].create_global_plan(local_plans)
    global_plans = writers[0].prepare_global_plan(global_plans)
    results = [w.write_data(p.finish_plan(gp), p).wait()
               for w, p, gp in zip(writers, planners, global_plans, strict=True)]
    writers[0].finish(metadata, results)
    return metadata, writers


def state() -> dict[str, Any]:
    torch.manual_seed(0)
    return {"model": {"w": torch.randn(6, 3), "b": torch.randn(5, dtype=torch.bfloat16),
                      "n": torch.tensor([float("nan"), float("inf"), -0.0]),
                      "i": torch.arange(4, dtype=torch.int64), "s": torch.tensor(2.5),
                      "e": torch.empty(0, 3)},
            "extra": {"epoch": 3, "name": "run-7"}}


def empty_like(sd: dict[str, Any]) -> dict[str, Any]:
    return {"model": {k: torch.zeros_like(v) for k, v in sd["model"].items()},
            "extra": {"epoch": 0, "name": ""}}


def test_a_state_round_trips_bit_exact() -> None:
    sd = state()
    writer = MemoryWriter()
    metadata = dcp.save(sd, storage_writer=writer, no_dist=True)
    assert ("model.w", (0, 0)) in writer.chunks
    sd["model"]["w"].add_(1)  # the trainer goes on: the copy in memory must not follow
    saved = state()
    target = empty_like(saved)
    dcp.load(target, storage_reader=MemoryReader(metadata, writer.chunks), no_dist=True)
    for name, tensor in saved["model"].items():
        assert target["model"][name].dtype == tensor.dtype
        assert bits(target["model"][name]) == bits(tensor), name
    assert target["extra"] == {"epoch": 3, "name": "run-7"}


@pytest.mark.parametrize("damage", [lambda b: b[:-1], lambda b: b + b"\0"])
def test_a_chunk_of_the_wrong_length_is_refused_naming_it(damage: Any) -> None:
    writer = MemoryWriter()
    metadata = dcp.save(state(), storage_writer=writer, no_dist=True)
    chunks = dict(writer.chunks)
    chunks[("model.w", (0, 0))] = damage(chunks[("model.w", (0, 0))])
    refused(lambda: dcp.load(empty_like(state()), storage_reader=MemoryReader(metadata, chunks),
                             no_dist=True),
            r"model\.w@\[0, 0\] has (71|73) bytes, its metadata says 72")


def test_a_missing_chunk_is_refused_naming_it() -> None:
    writer = MemoryWriter()
    metadata = dcp.save(state(), storage_writer=writer, no_dist=True)
    chunks = {k: v for k, v in writer.chunks.items() if k != ("model.b", (0,))}
    refused(lambda: dcp.load(empty_like(state()), storage_reader=MemoryReader(metadata, chunks),
                             no_dist=True),
            r"model\.b@\[0\] is not in the memory")


def merged(writers: list[MemoryWriter]) -> dict[ChunkKey, bytes]:
    chunks: dict[ChunkKey, bytes] = {}
    for writer in writers:
        chunks.update(writer.chunks)
    return chunks


def test_uneven_chunks_of_two_ranks_load_as_whole_tensors() -> None:
    metadata, writers = save_two_ranks()
    assert [c.sizes for c in metadata.state_dict_metadata["w"].chunks] == [  # type: ignore[union-attr]
        torch.Size([3, 4]), torch.Size([2, 4])]
    target = {"w": torch.zeros(5, 4), "b": torch.zeros(7, dtype=torch.bfloat16),
              "r": torch.zeros(3)}
    dcp.load(target, storage_reader=MemoryReader(metadata, merged(writers)), no_dist=True)
    assert bits(target["w"]) == bits(W)
    assert bits(target["b"]) == bits(B)
    assert bits(target["r"]) == bits(R)


class SliceLoadPlanner(DefaultLoadPlanner):
    """A new-world rank that owns rows [start, start + len) of "w": DCP's own helper
    computes which saved chunks (and which part of each) it reads."""

    def __init__(self, start: int, local: torch.Tensor) -> None:
        super().__init__()
        self.start, self.local = start, local

    def create_local_plan(self) -> LoadPlan:
        md = self.metadata.state_dict_metadata["w"]  # type: ignore[union-attr]
        assert isinstance(md, TensorStorageMetadata)
        wanted = ChunkStorageMetadata(torch.Size([self.start, 0]), self.local.size())
        return LoadPlan(create_read_items_for_chunk_list("w", md, [wanted]))

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        out = self.local
        cut = zip(read_item.dest_offsets, read_item.lengths, strict=True)
        for dim, (offset, length) in enumerate(cut):
            out = out.narrow(dim, offset, length)
        return out

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass


def test_a_new_world_slice_across_both_ranks_chunks_is_cut_from_them() -> None:
    metadata, writers = save_two_ranks()
    reader = MemoryReader(metadata, merged(writers))
    for start, rows in [(1, 3), (2, 2), (4, 1), (0, 5)]:
        planner = SliceLoadPlanner(start, torch.full((rows, 4), -1.0))
        planner.set_up_planner({}, metadata, True)
        plan = planner.create_local_plan()
        if (start, rows) == (1, 3):  # the reads really start inside the saved chunks
            assert sorted(tuple(i.storage_offsets) for i in plan.items) == [(0, 0), (1, 0)]
        reader.read_data(plan, planner).wait()
        assert bits(planner.local) == bits(W[start:start + rows]), (start, rows)


def test_keep_all_keeps_the_replicated_items_dcp_deduplicated() -> None:
    metadata, writers = save_two_ranks(keep_all=False)
    assert [("r", (0,)) in w.chunks for w in writers].count(True) == 1
    metadata, writers = save_two_ranks(keep_all=True)
    assert all(bits(torch.frombuffer(bytearray(w.chunks[("r", (0,))]), dtype=torch.float32))
               == bits(R) for w in writers)
    # Each rank alone can serve the replicated item, e.g. after the other's node is lost.
    for writer in writers:
        target = {"r": torch.zeros(3)}
        planner = DefaultLoadPlanner()
        planner.set_up_planner(target, metadata, True)
        plan = planner.create_local_plan()
        MemoryReader(metadata, writer.chunks).read_data(plan, planner).wait()
        assert bits(target["r"]) == bits(R)
