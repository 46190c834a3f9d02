"""A tiny worker for end-to-end tests: init the group, allreduce, print the result."""

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    expected = world * (world + 1) / 2
    print(f"ALLREDUCE rank={rank} world={world} sum={t.item()} expected={expected} "
          f"master={os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}", flush=True)
    dist.destroy_process_group()
    sys.exit(0 if t.item() == expected else 3)


if __name__ == "__main__":
    main()
