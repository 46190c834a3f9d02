"""``StepSampler``: the loop's exactly-once order as a ``DataLoader``'s batch sampler, for
a framework that fetches ahead of the step it trains (a fake loop; pure)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from elastic_ext.worker.loop.data import DataPosition, next_batch, position_after, shard
from elastic_ext.worker.loop.sampler import StepSampler


@dataclass
class FakeLoop:
    """What the sampler asks of ``ElasticLoop`` (its ``framework`` hooks, and its rank and
    world size): where the data stands, and the step's batch."""

    rank: int = 0
    world_size: int = 1
    position: DataPosition = field(default_factory=DataPosition)
    started: list[tuple[list[int], DataPosition]] = field(default_factory=list)

    def start_data(self, dataset_size: int, global_batch_size: int, *,
                   seed: int = 0) -> DataPosition:
        return self.position

    def batch_started(self, global_ids: torch.Tensor, after: DataPosition) -> None:
        self.started.append((global_ids.tolist(), after))

    def step_done(self) -> None:
        self.position = self.started[-1][1]


def sampler_of(loop: FakeLoop, dataset_size: int, global_batch_size: int, *,
               seed: int = 0) -> StepSampler:
    """``StepSampler`` as ``ElasticLoop.framework.batch_sampler`` makes it."""
    return StepSampler(loop, dataset_size, global_batch_size, seed=seed, rank=loop.rank,
                       world_size=loop.world_size)


def test_a_pass_yields_the_rest_of_the_epoch_and_its_length_is_a_whole_epoch() -> None:
    loop = FakeLoop(position=position_after(3, 4, 22))  # 5 steps an epoch, 3 done
    sampler = sampler_of(loop, 22, 4, seed=7)
    assert len(sampler) == 5
    batches = list(sampler)
    position, expected = position_after(3, 4, 22), []
    for _ in range(2):
        ids, position = next_batch(position, 7, 4, 22)
        expected.append(ids.tolist())
    assert batches == expected


def test_each_rank_gets_its_share_of_the_same_global_batch() -> None:
    shares = [list(sampler_of(FakeLoop(rank=r, world_size=3), 30, 6))
              for r in range(3)]
    ids, _ = next_batch(DataPosition(), 0, 6, 30)
    assert [s[0] for s in shares] == [shard(ids, r, 3).tolist() for r in range(3)]


def test_a_step_learns_its_own_batch_while_the_loader_fetches_ahead() -> None:
    loop = FakeLoop()
    sampler = sampler_of(loop, 40, 4)
    iterator = iter(sampler)
    fetched = [next(iterator), next(iterator)]  # the framework's prefetch
    sampler.started()
    assert loop.started[-1][0] == fetched[0] and loop.started[-1][1] == DataPosition(0, 4)
    loop.step_done()
    fetched.append(next(iterator))
    sampler.started()
    assert loop.started[-1][0] == fetched[1] and loop.started[-1][1] == DataPosition(0, 8)


def test_the_next_pass_starts_where_the_trained_steps_left_the_data() -> None:
    loop = FakeLoop()
    sampler = sampler_of(loop, 8, 4)
    for _ in sampler:
        sampler.started()
        loop.step_done()
    assert loop.position == DataPosition(0, 8)
    second = list(sampler)  # the next epoch
    assert second == [next_batch(DataPosition(1, 0), 0, 4, 8)[0].tolist(),
                      next_batch(DataPosition(1, 4), 0, 4, 8)[0].tolist()]


def test_a_dataloader_collates_the_rank_share_of_each_step() -> None:
    data = TensorDataset(torch.arange(100) * 10)
    sampler = sampler_of(FakeLoop(rank=1, world_size=2), 100, 10)
    (first,) = next(iter(DataLoader(data, batch_sampler=sampler)))
    ids, _ = next_batch(DataPosition(), 0, 10, 100)
    assert first.tolist() == (shard(ids, 1, 2) * 10).tolist()


def test_a_step_without_a_batch_from_the_sampler_names_the_fix() -> None:
    sampler = sampler_of(FakeLoop(), 10, 2)
    with pytest.raises(RuntimeError, match="batch_sampler="):
        sampler.started()


def test_a_batch_larger_than_the_dataset_is_refused() -> None:
    with pytest.raises(ValueError, match="1..10"):
        sampler_of(FakeLoop(), 10, 11)
