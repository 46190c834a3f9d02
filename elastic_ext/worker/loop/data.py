"""Elastic data order: which samples each step trains on, whatever the world size.

The global order of an epoch is a permutation that depends on (seed, epoch) only.
A step takes the next ``global_batch_size`` samples of it and splits them across
the ranks, so the samples of a step do not depend on how many ranks there are. The
position (epoch, offset into the epoch's order) goes into every snapshot, so a run
resumed at another world size continues exactly where the committed model left off.
A trailing partial batch is dropped, as in an uninterrupted run.

Everything here is pure: no processes, no files.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch


@dataclass(frozen=True)
class DataPosition:
    """Where the next batch starts: ``offset`` samples of ``epoch``'s order are consumed."""

    epoch: int = 0
    offset: int = 0

    def to_state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "offset": self.offset}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> DataPosition:
        return cls(epoch=int(state["epoch"]), offset=int(state["offset"]))


def epoch_seed(seed: int, epoch: int) -> int:
    """A 63-bit generator seed for (seed, epoch), stable across Python and torch versions."""
    digest = hashlib.sha256(f"elastic-ext/epoch/{seed}/{epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


@lru_cache(maxsize=4)
def epoch_order(seed: int, epoch: int, dataset_size: int) -> torch.Tensor:
    """The global order of sample ids in ``epoch``: a permutation of ``range(dataset_size)``."""
    generator = torch.Generator().manual_seed(epoch_seed(seed, epoch))
    order = torch.randperm(dataset_size, generator=generator)
    order.requires_grad_(False)
    return order


def next_batch(position: DataPosition, seed: int, global_batch_size: int,
               dataset_size: int) -> tuple[torch.Tensor, DataPosition]:
    """The ids of the next global batch and the position after it."""
    if global_batch_size < 1 or global_batch_size > dataset_size:
        raise ValueError(f"global batch size {global_batch_size} must be in 1..{dataset_size}")
    if position.offset + global_batch_size > dataset_size:
        position = DataPosition(epoch=position.epoch + 1, offset=0)
    order = epoch_order(seed, position.epoch, dataset_size)
    ids = order[position.offset:position.offset + global_batch_size]
    return ids, DataPosition(epoch=position.epoch, offset=position.offset + global_batch_size)


def shard_bounds(batch_size: int, rank: int, world_size: int) -> tuple[int, int]:
    """``[start, stop)`` of ``rank``'s contiguous share of a batch; sizes differ by at most one."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world size {world_size}")
    if batch_size < world_size:
        raise ValueError(f"global batch size {batch_size} is smaller than the world size "
                         f"{world_size}")
    base, extra = divmod(batch_size, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def shard(ids: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    start, stop = shard_bounds(len(ids), rank, world_size)
    return ids[start:stop]


def steps_per_epoch(global_batch_size: int, dataset_size: int) -> int:
    return dataset_size // global_batch_size


def position_after(steps: int, global_batch_size: int, dataset_size: int) -> DataPosition:
    """Where an uninterrupted run with a fixed batch size stands after ``steps`` steps."""
    per_epoch = steps_per_epoch(global_batch_size, dataset_size)
    if steps == 0:
        return DataPosition()
    epoch, index = divmod(steps - 1, per_epoch)
    return DataPosition(epoch=epoch, offset=(index + 1) * global_batch_size)


__all__ = ["DataPosition", "epoch_order", "epoch_seed", "next_batch", "position_after", "shard",
           "shard_bounds", "steps_per_epoch"]
