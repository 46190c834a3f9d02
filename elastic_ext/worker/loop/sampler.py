"""``StepSampler``: the loop's exactly-once data order as a ``DataLoader``'s batch sampler.

A framework that owns the training loop (Lightning) iterates a ``DataLoader`` once per
epoch and fetches a batch or more ahead of the one it trains. The sampler yields this
rank's share of each step's global batch from where the loop's data stands to the end of
that epoch, and remembers what each yielded batch was; the framework's hook at the start
of a step's batch calls ``started``, which tells the loop which batch the step trains, so
a snapshot records where the data stands after the step, not after the prefetched one.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Protocol

import torch

from elastic_ext.worker.loop.data import DataPosition, next_batch, shard, steps_per_epoch


class StepSource(Protocol):
    """What the sampler needs of ``ElasticLoop``: its ``framework`` hooks."""

    def start_data(self, dataset_size: int, global_batch_size: int, *,
                   seed: int = 0) -> DataPosition: ...

    def batch_started(self, global_ids: torch.Tensor, after: DataPosition) -> None: ...


class StepSampler:
    """Yields this rank's sample ids, one list per step (``DataLoader(batch_sampler=...)``).

    Its length is a whole epoch's steps, so the framework's epoch ends where the data
    order's does; resumed mid-epoch it yields only the rest of that epoch, and the
    framework, which restored its own step counters, counts the same steps.
    """

    def __init__(self, loop: StepSource, dataset_size: int, global_batch_size: int, *,
                 rank: int, world_size: int, seed: int = 0) -> None:
        """``loop``: ``ElasticLoop.framework``; ``rank`` and ``world_size``: the loop's."""
        if not 0 < global_batch_size <= dataset_size:
            raise ValueError(f"global batch size {global_batch_size} must be in "
                             f"1..{dataset_size} (the dataset's size)")
        self.loop = loop
        self.rank, self.world_size = rank, world_size
        self.dataset_size, self.global_batch_size, self.seed = (dataset_size, global_batch_size,
                                                                seed)
        self._yielded: deque[tuple[torch.Tensor, DataPosition]] = deque()

    def __len__(self) -> int:
        return steps_per_epoch(self.global_batch_size, self.dataset_size)

    def __iter__(self) -> Iterator[list[int]]:
        self._yielded.clear()  # a new pass starts where the trained steps left the data
        position = self.loop.start_data(self.dataset_size, self.global_batch_size,
                                        seed=self.seed)
        ids, after = next_batch(position, self.seed, self.global_batch_size, self.dataset_size)
        epoch = after.epoch
        while after.epoch == epoch:
            self._yielded.append((ids, after))
            yield shard(ids, self.rank, self.world_size).tolist()
            ids, after = next_batch(after, self.seed, self.global_batch_size,
                                    self.dataset_size)

    def started(self) -> None:
        """The step that trains the oldest batch not yet started begins.

        Raises:
            RuntimeError: no batch was yielded that has not started (the framework's
                hook and the ``DataLoader`` are out of step).
        """
        if not self._yielded:
            raise RuntimeError("a step started with no batch from this StepSampler: give the "
                               "DataLoader batch_sampler=<this sampler> and no other sampler, "
                               "and a training step that takes a batch (not dataloader_iter)")
        self.loop.batch_started(*self._yielded.popleft())


__all__ = ["StepSampler", "StepSource"]
