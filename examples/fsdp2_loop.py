"""An FSDP2 training loop, of the shape of the PyTorch FSDP2 tutorial
(``pytorch/examples``' ``distributed/FSDP2/example.py``: ``fully_shard`` per block, then
the root, the optimizer over the sharded parameters), made elastic by elastic-ext.

The lines marked ``# elastic-ext`` are all it adds. The model's parameters and the
optimizer's state are sharded (DTensors); a dead, frozen or preempted node costs no
finished step: with ``--hsdp`` the replica on another node holds the same shards, else
each rank's shards are copied to host memory on the next node before every step
counts, and the next round reshards them to its own world size from the survivors'
memory (DCP's planner, reading from peers). Run it as the bundled trainer::

    torchrun --nnodes=2:3 --nproc-per-node=2 --rdzv-backend=etcd-ext \\
        --rdzv-endpoint=127.0.0.1:2379 --rdzv-id=demo -m elastic_ext.warm \\
        examples/fsdp2_loop.py --steps 500 --hsdp --metrics /tmp/demo.jsonl

A durable snapshot (``--snapshot-dir``, DCP format, loadable at any world size and by
torch's own DCP tools) needs a directory every rank can read.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard

from elastic_ext import ElasticLoop, LoopSettings  # elastic-ext


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.ff = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.ff(self.norm(x))
        return out


class Model(nn.Module):
    """A small residual MLP: blocks to shard one by one, as the tutorial's transformer."""

    def __init__(self, dim: int = 32, depth: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))
        self.head = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        out: torch.Tensor = self.head(x)
        return out


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=500, help="optimizer steps in all")
    p.add_argument("--global-batch-size", type=int, default=32,
                   help="samples per step, all ranks together")
    p.add_argument("--seed", type=int, default=0, help="seed of the model and the data order")
    p.add_argument("--hsdp", action="store_true",
                   help="shard within a node, replicate across nodes (HSDP)")
    p.add_argument("--snapshot-dir", type=Path, default=None,
                   help="durable DCP snapshots here (every rank must see it)")
    p.add_argument("--snapshot-every", type=int, default=0, help="a snapshot every K steps")
    p.add_argument("--metrics", type=Path, default=None, help="JSON-lines events (rank 0)")
    p.add_argument("--step-delay", type=float, default=0.0, help="seconds added to each step")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    loop = ElasticLoop(LoopSettings(  # elastic-ext: the guard, the process group, snapshots
        snapshot_dir=args.snapshot_dir, snapshot_every=args.snapshot_every,  # elastic-ext
        events_file=args.metrics))  # elastic-ext
    generator = torch.Generator().manual_seed(args.seed)
    inputs, targets = torch.randn(4096, 32, generator=generator), torch.randn(4096, 1,
                                                                           generator=generator)
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = Model().to(loop.device)
    mesh = loop.mesh(hsdp=args.hsdp)  # elastic-ext: this round's mesh (instead of init_device_mesh)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loop.restore(model=model, optimizer=optimizer)  # elastic-ext: peers' memory or disk
    for ids in loop.batches(len(inputs), args.global_batch_size, seed=args.seed,  # elastic-ext
                            steps=args.steps):
        x, y = inputs[ids].to(loop.device), targets[ids].to(loop.device)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        with loop.update():  # elastic-ext: no keep sees half an update
            optimizer.step()
        optimizer.zero_grad()
        time.sleep(args.step_delay)
        loop.step_done(loss)  # elastic-ext: the step boundary (and the copy to the next node)
    loop.finish()  # elastic-ext: a durable snapshot, and the job is done


if __name__ == "__main__":
    main()
