"""A worker for the ``accelerate launch`` test: it says whether the warm-start server forked
it, fails once as rank 1 of the first round (a worker failure: one restart of the job-wide
budget), and in the next round waits for the test's go before it ends."""

import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from elastic_ext.warm.worker import in_warm_worker


def main() -> None:
    marks = Path(sys.argv[1])
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    total = torch.ones(1)
    dist.all_reduce(total)
    print(f"ACCELERATE rank={rank} world={world} warm={in_warm_worker()} restart={restart} "
          f"sum={total.item():.0f}", flush=True)
    if rank == 1 and not (marks / "failed").exists():
        (marks / "failed").touch()
        os._exit(3)  # a worker failure, not a peer's
    deadline = time.monotonic() + 120
    while not (marks / "go").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
