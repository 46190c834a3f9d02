"""A Lightning ``Trainer`` run made elastic by elastic-ext: a tiny regression network
trained on random data, with AdamW and a per-step learning-rate schedule.

The lines marked ``# elastic-ext`` are all it adds. With them a dead, frozen or
preempted node costs the step in flight instead of the steps since the last
checkpoint, the new round starts from the state the survivors hold, rounds of any
world size work (``num_nodes`` comes from torchrun), and every sample of an epoch is
trained once::

    torchrun --nnodes=1:3 --nproc-per-node=1 --rdzv-backend=etcd-ext \\
        --rdzv-endpoint=c10d://127.0.0.1:29400 --rdzv-id=pl -m elastic_ext.warm \\
        examples/lightning_trainer.py --steps 200 --snapshot-dir /tmp/pl

It needs ``pip install 'elastic-ext[lightning]'``; it trains on the CPU with gloo, or on
``cuda:LOCAL_RANK`` with NCCL when there is a GPU. ``--shard fsdp2`` shards the layers
(FSDP2 under ``ModelParallelStrategy``); the callback then hands off the shards.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from elastic_ext import LoopSettings  # elastic-ext
from elastic_ext.integrations.lightning import ElasticCallback  # elastic-ext

WIDTH = {"tiny": 32, "small": 256}


class Regression(pl.LightningModule):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, width), nn.ReLU(), nn.Linear(width, 1))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        loss: torch.Tensor = nn.functional.mse_loss(self.net(inputs), targets)
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-3)
        schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=20, gamma=0.9)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule,
                                                         "interval": "step"}}


class ShardedRegression(Regression):
    """The same network with its layers sharded across the ranks by FSDP2, as
    ``ModelParallelStrategy`` asks: in ``configure_model``, on its data-parallel mesh."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        assert self.device_mesh is not None, "ModelParallelStrategy sets the mesh"
        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)


class StepDelay(pl.Callback):
    """Seconds added to each step, for the chaos harness to find the job mid-training."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_train_batch_end(self, *args: Any, **kwargs: Any) -> None:
        time.sleep(self.seconds)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200, help="optimizer steps in all")
    p.add_argument("--global-batch-size", type=int, default=12,
                   help="samples per batch, all ranks together (split among the ranks); "
                        "a step trains --accumulate batches")
    p.add_argument("--seed", type=int, default=0, help="the data order's seed")
    p.add_argument("--snapshot-dir", type=Path, default=None, help="durable snapshots here")
    p.add_argument("--snapshot-every", type=int, default=0, help="a snapshot every K steps")
    p.add_argument("--metrics", type=Path, default=None, help="JSON-lines events (rank 0)")
    p.add_argument("--step-delay", type=float, default=0.0, help="seconds added to each step")
    p.add_argument("--model-size", choices=sorted(WIDTH), default="tiny")
    p.add_argument("--accumulate", type=int, default=1,
                   help="batches per optimizer step (Lightning's accumulate_grad_batches)")
    p.add_argument("--shard", choices=("none", "fsdp2"), default="none",
                   help="fsdp2: shard the layers across the ranks (ModelParallelStrategy)")
    return p.parse_args()


def strategy(shard: str, world_size: int) -> Any:
    """DDP, or FSDP2 over every rank of this round (its size changes from round to round)."""
    if shard == "none":
        return "ddp"
    from lightning.pytorch.strategies import ModelParallelStrategy

    return ModelParallelStrategy(data_parallel_size=world_size, tensor_parallel_size=1)


def main() -> None:
    args = parse_args()
    elastic = ElasticCallback(LoopSettings(  # elastic-ext: the guard, the process group
        snapshot_dir=args.snapshot_dir, snapshot_every=args.snapshot_every,  # elastic-ext
        events_file=args.metrics, total_steps=args.steps))  # elastic-ext
    torch.manual_seed(0)  # the same initial weights on every rank
    model = (ShardedRegression if args.shard == "fsdp2" else Regression)(WIDTH[args.model_size])
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(1200, 16, generator=generator)
    data = TensorDataset(inputs, inputs.sum(dim=1, keepdim=True))
    trainer = pl.Trainer(
        accelerator="gpu" if elastic.loop.device.type == "cuda" else "cpu",
        strategy=strategy(args.shard, elastic.loop.world_size),
        devices=elastic.devices, num_nodes=elastic.num_nodes,  # elastic-ext
        use_distributed_sampler=False,  # elastic-ext: the batch sampler below
        max_steps=args.steps, accumulate_grad_batches=args.accumulate,
        callbacks=[elastic, StepDelay(args.step_delay)],  # elastic-ext: elastic
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=args.snapshot_dir)
    loader = DataLoader(data, batch_sampler=elastic.batch_sampler(  # elastic-ext
        len(data), args.global_batch_size, seed=args.seed))  # elastic-ext
    trainer.fit(model, loader, ckpt_path=elastic.resume_from(model))  # elastic-ext


if __name__ == "__main__":
    main()
