"""The trainer's data order is the own-loop object's: ``elastic_ext.worker.loop.data``."""

from elastic_ext.worker.loop.data import (
    DataPosition,
    epoch_order,
    epoch_seed,
    next_batch,
    position_after,
    shard,
    shard_bounds,
    steps_per_epoch,
)

__all__ = ["DataPosition", "epoch_order", "epoch_seed", "next_batch", "position_after", "shard",
           "shard_bounds", "steps_per_epoch"]
