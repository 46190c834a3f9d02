"""A stand-in training loop: one allreduce per step, a JSON line per step from rank 0.

On a collective error it reports a peer fault to its etcd-ext agent and waits to be
stopped, as the bundled trainer does.
"""

import json
import os
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from elastic_ext.worker.control import report_peer_failure


def main() -> None:
    metrics, steps, delay = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    crash_at = int(sys.argv[4]) if len(sys.argv) > 4 else 0  # group rank 1 crashes at this step
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    for step in range(1, steps + 1):
        try:
            t = torch.ones(1)
            dist.all_reduce(t)
        except Exception as exc:  # a peer died
            if report_peer_failure(str(exc)):
                threading.Event().wait(60)
            sys.exit(1)
        if crash_at and step == crash_at and int(os.environ["GROUP_RANK"]) == 1:
            os._exit(7)
        if rank == 0:
            with open(metrics, "a") as f:
                f.write(json.dumps({"event": "step", "step": step, "world_size": world,
                                    "restart": restart, "time": time.time(),
                                    "group_rank": int(os.environ["GROUP_RANK"])}) + "\n")
        time.sleep(delay)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
