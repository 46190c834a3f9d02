"""An ``ElasticLoop`` job one of whose workers hangs once, as a user's bug would make it.

``hang_loop.py METRICS STEPS HOW MARKER [GROUP_RANK]``: at step 20 the worker of local rank
0 on the node of ``GROUP_RANK`` (default 1) hangs by ``HOW``: ``spin`` (a Python loop
that never ends) or ``sleep`` (a blocking call that never returns), or ``pause`` (an
evaluation of 5 s inside ``loop.no_hang_check()`` on every rank: no hang at all). It
hangs once per job (``MARKER`` counts the hangs), again at step 40 with ``spin-twice``.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from elastic_ext import ElasticLoop, LoopSettings

HANG_STEP = 20


def hang(how: str, loop: ElasticLoop, marker: Path, group_rank: int) -> None:
    if how == "pause":
        if loop.step == HANG_STEP and not marker.exists():
            with loop.no_hang_check():
                time.sleep(5.0)  # an evaluation, on every rank
            if loop.rank == 0:
                marker.touch()
        return
    hangs = len(marker.read_text()) if marker.exists() else 0
    at = (HANG_STEP, 2 * HANG_STEP) if how.endswith("-twice") else (HANG_STEP,)
    if hangs >= len(at) or loop.step != at[hangs] or os.environ["LOCAL_RANK"] != "0" \
            or int(os.environ["GROUP_RANK"]) != group_rank:
        return
    with marker.open("a") as f:
        f.write("x")
    if how.startswith("spin"):
        n = 0
        while True:
            n += 1
    time.sleep(3600)


def main() -> None:
    metrics, steps, how, marker = sys.argv[1], int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
    group_rank = int(sys.argv[5]) if len(sys.argv) > 5 else 1
    loop = ElasticLoop(LoopSettings(events_file=metrics))
    generator = torch.Generator().manual_seed(0)
    inputs = torch.rand(1024, 8, generator=generator)
    targets = torch.rand(1024, 1, generator=generator)
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    loop.restore(model=model, optimizer=optimizer)
    ddp = DDP(model)
    for ids in loop.batches(len(inputs), 16, steps=steps):
        hang(how, loop, marker, group_rank)
        optimizer.zero_grad()
        loss = F.mse_loss(ddp(inputs[ids]), targets[ids])
        loss.backward()
        with loop.update():
            optimizer.step()
        time.sleep(0.05)
        loop.step_done(loss)
    loop.finish()


if __name__ == "__main__":
    main()
