"""One rank of the hand-off tests: for each case, hold what it says, restore, print what it got.

argv: a JSON list of this rank's cases, each ``{"case": NAME, "memory": [step, value] | null,
"disk": [step, value] | null}`` plus, optionally, ``"chunk": bytes`` (move the hand-off in
chunks of that size and count the collectives) or ``"rng": step`` (see ``rng_round``); then
the root directory, under which each case has this rank's own node-memory directory
``NAME/mem<rank>`` and snapshot directory ``NAME/disk<rank>`` (nothing shared, between ranks
or cases). The cases run in order in one process group, so that torch is imported once for
all of them (seconds of CPU, where a case takes milliseconds). Each case prints ``=== case
NAME`` first, so that its log lines can be told apart, then one JSON line: the restored step,
source, bytes and the value every parameter now holds.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from elastic_ext.worker.snapshot import LocalCopies, Snapshotter, handoff

CASE_MARK = "=== case "
"""Starts the line each case prints first (``tests/test_handoff_ranks.py`` splits logs on it)."""

_CHUNK_BYTES = handoff.CHUNK_BYTES
_WATCHED = ("broadcast", "send", "recv")


def model_holding(value: float) -> torch.nn.Linear:
    model = torch.nn.Linear(4, 3)
    with torch.no_grad():
        for param in model.parameters():
            param.fill_(value)
    return model


@contextmanager
def transfers_watched(chunk: int | None) -> Iterator[dict[str, int] | None]:
    """With ``chunk``: make the hand-off move ``chunk`` bytes at a time and count what this
    rank's collectives move (the largest tensor, the calls), filled in as they happen; put
    both back afterwards, so the next case moves and counts as usual. None without."""
    if chunk is None:
        yield None
        return
    moved = {"largest": 0, "calls": 0}
    originals = {name: getattr(dist, name) for name in _WATCHED}
    handoff.CHUNK_BYTES = chunk
    for name, original in originals.items():
        def counting(tensor: torch.Tensor, *args: object, _original: object = original,
                     **kwargs: object) -> object:
            moved["largest"] = max(moved["largest"], tensor.numel() * tensor.element_size())
            moved["calls"] += 1
            return _original(tensor, *args, **kwargs)  # type: ignore[operator]
        setattr(dist, name, counting)
    try:
        yield moved
    finally:
        handoff.CHUNK_BYTES = _CHUNK_BYTES
        for name, original in originals.items():
            setattr(dist, name, original)


def rng_round(snapshots: Snapshotter, step: int) -> dict[str, Any]:
    """Per-rank RNG. step > 0: commit at ``step`` with a seed of its own on every rank and
    note the draw that follows (``committed``). Then, and alone for step 0: a foreign seed,
    restore, and the next draw (``draw``): the committed one again if this rank got its own
    state back."""
    rank = dist.get_rank()
    result: dict[str, Any] = {"rank": rank}
    if step > 0:
        torch.manual_seed(100 + rank)
        snapshots.commit_now(step, {"model": model_holding(1.0)})
        result["committed"] = torch.rand(2).tolist()
    torch.manual_seed(999)
    snapshots.restore({"model": model_holding(0.0)})
    result["draw"] = torch.rand(2).tolist()
    return result


def run_case(spec: dict[str, Any], memory_dir: Path, disk_dir: Path) -> dict[str, Any]:
    memory_dir.mkdir(parents=True, exist_ok=True)
    if spec["disk"] is not None:  # as if this node's rank 0 had written it earlier
        step, value = spec["disk"]
        writer = Snapshotter(disk_dir, local=None, capture_rng_states=False)  # rank 0 alone
        writer.is_writer = True
        writer.directory.mkdir(parents=True, exist_ok=True)  # type: ignore[union-attr]
        writer.commit(step, {"model": model_holding(value), "data": {"step": step}}).result()
        writer.close()
    with transfers_watched(spec.get("chunk")) as moved:
        snapshots = Snapshotter(disk_dir, local=LocalCopies(memory_dir))
        try:
            if spec.get("rng") is not None:
                return rng_round(snapshots, spec["rng"])
            if spec["memory"] is not None:
                step, value = spec["memory"]
                snapshots.keep_local(step, {"model": model_holding(value), "data": {"step": step}})
            dist.barrier()
            model = model_holding(-1.0)
            restored = snapshots.restore({"model": model})
        finally:
            snapshots.close()
    values = sorted({float(v) for p in model.parameters() for v in p.detach().flatten()})
    return {"rank": dist.get_rank(),
            "step": restored.step if restored else None,
            "source": restored.source if restored else None,
            "data": restored.state.get("data") if restored else None,
            "bytes": restored.bytes if restored else 0, "values": values,
            "moved": moved}


def main() -> None:
    cases = json.loads(sys.argv[1])
    root = Path(sys.argv[2])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    rank = dist.get_rank()
    for spec in cases:
        name = spec["case"]
        print(f"{CASE_MARK}{name}", flush=True)
        result = run_case(spec, root / name / f"mem{rank}", root / name / f"disk{rank}")
        print(json.dumps({**result, "case": name}), flush=True)
    os._exit(0)  # no interpreter teardown: freeing a gloo group at exit can abort (torch 2.13)


if __name__ == "__main__":
    main()
