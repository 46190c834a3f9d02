"""One rank of a hand-off test: hold what the test says, restore, print what it got.

argv: a JSON object ``{"memory": [step, value] | null, "disk": [step, value] | null}``
for this rank, then its node-memory directory and its snapshot directory (each rank has
its own: nothing is shared). Prints one JSON line: the restored step, source, bytes and
the value every parameter now holds.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from elastic_ext.snapshot import LocalCopies, Snapshotter, handoff


def model_holding(value: float) -> torch.nn.Linear:
    model = torch.nn.Linear(4, 3)
    with torch.no_grad():
        for param in model.parameters():
            param.fill_(value)
    return model


def watch_transfers(chunk: int) -> dict[str, int]:
    """Make the hand-off move ``chunk`` bytes at a time and count what each rank's
    collectives move (the largest tensor, the calls): filled in as they happen."""
    moved = {"largest": 0, "calls": 0}
    handoff.CHUNK_BYTES = chunk
    for name in ("broadcast", "send", "recv"):
        original = getattr(dist, name)

        def counting(tensor: torch.Tensor, *args: object, _original: object = original,
                     **kwargs: object) -> object:
            moved["largest"] = max(moved["largest"], tensor.numel() * tensor.element_size())
            moved["calls"] += 1
            return _original(tensor, *args, **kwargs)  # type: ignore[operator]
        setattr(dist, name, counting)
    return moved


def rng_round(snapshots: Snapshotter, step: int) -> None:
    """Per-rank RNG: step > 0 commits with a seed of its own on every rank and prints the
    draw that follows; step 0 restores (after a foreign seed) and prints the next draw."""
    rank = dist.get_rank()
    if step > 0:
        torch.manual_seed(100 + rank)
        snapshots.commit_now(step, {"model": model_holding(1.0)})
        draw = torch.rand(2).tolist()
    else:
        torch.manual_seed(999)
        snapshots.restore({"model": model_holding(0.0)})
        draw = torch.rand(2).tolist()
    print(json.dumps({"rank": rank, "draw": draw}), flush=True)
    os._exit(0)


def main() -> None:
    spec = json.loads(sys.argv[1])
    memory_dir, disk_dir = Path(sys.argv[2]), Path(sys.argv[3])
    memory_dir.mkdir(parents=True, exist_ok=True)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    if spec["disk"] is not None:  # as if this node's rank 0 had written it earlier
        step, value = spec["disk"]
        writer = Snapshotter(disk_dir, local=None, capture_rng_states=False)  # rank 0 alone
        writer.is_writer = True
        writer.directory.mkdir(parents=True, exist_ok=True)  # type: ignore[union-attr]
        writer.commit(step, {"model": model_holding(value), "data": {"step": step}}).result()
        writer.close()
    moved = watch_transfers(spec["chunk"]) if spec.get("chunk") else None
    snapshots = Snapshotter(disk_dir, local=LocalCopies(memory_dir))
    if spec.get("rng") is not None:
        rng_round(snapshots, spec["rng"])
    if spec["memory"] is not None:
        step, value = spec["memory"]
        snapshots.keep_local(step, {"model": model_holding(value), "data": {"step": step}})
    dist.barrier()
    model = model_holding(-1.0)
    restored = snapshots.restore({"model": model})
    values = sorted({float(v) for p in model.parameters() for v in p.detach().flatten()})
    print(json.dumps({"rank": dist.get_rank(),
                      "step": restored.step if restored else None,
                      "source": restored.source if restored else None,
                      "data": restored.state.get("data") if restored else None,
                      "bytes": restored.bytes if restored else 0, "values": values,
                      "moved": moved}), flush=True)
    os._exit(0)  # no interpreter teardown: freeing a gloo group at exit can abort (torch 2.13)


if __name__ == "__main__":
    main()
