"""A plain DDP training loop, of the shape of pytorch/examples'
``distributed/ddp-tutorial-series/multinode.py``, made elastic by elastic-ext.

The lines marked ``# elastic-ext`` are all it adds (the loop header changed from a
``DataLoader`` with a ``DistributedSampler`` to ``loop.batches``). With them a dead,
frozen or preempted node costs the step in flight, a node may join at any step, and the
state moves from the survivors' memory to the new ranks. Run it as the bundled trainer::

    torchrun --nnodes=1:3 --nproc-per-node=1 --rdzv-backend=etcd-ext \\
        --rdzv-endpoint=c10d://127.0.0.1:29400 --rdzv-id=demo -m elastic_ext.warm \\
        examples/own_loop.py --steps 500 --snapshot-dir /tmp/demo --metrics /tmp/demo.jsonl

(``-m elastic_ext.warm`` starts the workers warm: forked from a process that has the
imports done; the script runs without it too, only slower to restart).

It trains on the CPU with gloo, or on ``cuda:LOCAL_RANK`` with NCCL when there is a GPU.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from elastic_ext import ElasticLoop, LoopSettings  # elastic-ext


class MyTrainDataset(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Random regression pairs, the same on every rank (the tutorial's dataset)."""

    def __init__(self, size: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.inputs = torch.rand(size, 20, generator=generator)
        self.targets = torch.rand(size, 1, generator=generator)

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inputs[index], self.targets[index]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=500, help="optimizer steps in all")
    p.add_argument("--global-batch-size", type=int, default=32,
                   help="samples per step, all ranks together")
    p.add_argument("--seed", type=int, default=0, help="seed of the data order")
    p.add_argument("--snapshot-dir", type=Path, default=None, help="durable snapshots here")
    p.add_argument("--snapshot-every", type=int, default=0, help="a snapshot every K steps")
    p.add_argument("--metrics", type=Path, default=None, help="JSON-lines events (rank 0)")
    p.add_argument("--step-delay", type=float, default=0.0, help="seconds added to each step")
    p.add_argument("--model-size", default="tiny",
                   help="accepted for the chaos harness's trainer contract; one model here")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    loop = ElasticLoop(LoopSettings(  # elastic-ext: the guard, the process group, snapshots
        snapshot_dir=args.snapshot_dir, snapshot_every=args.snapshot_every,  # elastic-ext
        events_file=args.metrics))  # elastic-ext
    dataset = MyTrainDataset(2048)
    model = torch.nn.Linear(20, 1).to(loop.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    loop.restore(model=model, optimizer=optimizer)  # elastic-ext: memory, peers or disk
    ddp = DDP(model, device_ids=loop.device_ids)
    for ids in loop.batches(len(dataset), args.global_batch_size, seed=args.seed,  # elastic-ext
                            steps=args.steps):
        source, targets = (t.to(loop.device) for t in dataset[ids])
        optimizer.zero_grad()
        loss = F.mse_loss(ddp(source), targets)
        loss.backward()
        with loop.update():  # elastic-ext: no keep sees half an update
            optimizer.step()
        time.sleep(args.step_delay)
        loop.step_done(loss)  # elastic-ext: the step boundary
    loop.finish()  # elastic-ext: a durable snapshot, and the job is done


if __name__ == "__main__":
    main()
