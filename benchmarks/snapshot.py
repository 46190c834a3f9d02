"""How much a snapshot costs the training loop, for a ~100 MB model on the CPU.

1. Blocking: the median time ``Snapshotter.commit`` holds the loop (copy to host
   buffers), against a synchronous ``torch.save`` of the same state (model, AdamW
   state, scheduler, RNG), each on the same filesystem.
2. Overhead: the mean time of the trainer's step (DDP over a one-rank gloo group,
   AdamW) with a commit every 10 steps against none, interleaved in blocks of 10
   steps so that both see the same machine load. Measured at several batch sizes,
   because on a CPU-only machine the writer competes with the training threads for
   the same cores, and what that costs depends on how long the 10 steps take.

Prints a Markdown table with the date and the machine. Targets: blocking <= 20 % of
the synchronous save, overhead <= 2 %.

    python benchmarks/snapshot.py [--batch 256 1024] [--rounds 6]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from elastic_ext.worker.snapshot import Snapshotter
from elastic_ext.worker.snapshot.hook import DEFAULT_WRITER_NICE, WRITER_NICE_ENV
from trainer.model import MODEL_SIZES, SyntheticTask, build_model
from trainer.train import train_step

if str(Path(__file__).resolve().parent) not in sys.path:  # python -m benchmarks.NAME
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cpu_model  # noqa: E402  (benchmarks/common.py, a sibling)


def state_after_one_step(size_name: str, batch: int) -> dict[str, object]:
    size = MODEL_SIZES[size_name]
    model = build_model(size, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    task = SyntheticTask.make(size, seed=0, dataset_size=batch)
    train_step(model, opt, sched, task, torch.arange(batch), batch, 1, torch.device("cpu"))
    return {"model": model, "optimizer": opt, "scheduler": sched, "data": {"epoch": 0, "offset": 0}}


def measure_blocking(directory: Path, state: dict[str, object], repeats: int) -> dict[str, float]:
    """Median seconds: commit blocking, torch.save, torch.save + fsync, and the background write."""
    snaps = Snapshotter(directory / "hook", keep=2)
    blocking, writes = [], []
    for step in range(repeats + 1):
        future = snaps.commit(step, state)
        info = future.result()
        if step > 0 and info is not None:  # the first commit allocates the host buffers
            blocking.append(info.blocking_s)
            writes.append(info.write_s)
    snaps.close()
    plain = {k: (v.state_dict() if hasattr(v, "state_dict") else v) for k, v in state.items()}
    saves, saves_fsync = [], []
    target = directory / "sync.pt"
    for _ in range(repeats):
        start = time.perf_counter()
        torch.save(plain, target)
        saves.append(time.perf_counter() - start)
        start = time.perf_counter()
        torch.save(plain, target)
        with open(target, "rb+") as f:
            os.fsync(f.fileno())
        saves_fsync.append(time.perf_counter() - start)
    state_bytes = sum(t.numel() * t.element_size() for t in _tensors(plain))
    return {"blocking": statistics.median(blocking), "write": statistics.median(writes),
            "save": statistics.median(saves), "save_fsync": statistics.median(saves_fsync),
            "bytes": float(state_bytes)}


def _tensors(obj: object) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def measure_overhead(size_name: str, batch: int, every: int, rounds: int) -> dict[str, float]:
    """Mean step time of the trainer's step with a commit every ``every`` steps, and without.

    The two are interleaved in blocks of ``every`` steps (with, without, with, ...) so
    that a slow drift of the machine's load affects both alike. A block "with" starts
    with a commit and ends once its background write is done, so a write that outlasts
    the block (and would make the next commit wait) is counted too.
    """
    from torch.nn.parallel import DistributedDataParallel

    state = state_after_one_step(size_name, batch)
    model, opt, sched = state["model"], state["optimizer"], state["scheduler"]
    assert isinstance(model, torch.nn.Module)
    task = SyntheticTask.make(MODEL_SIZES[size_name], seed=0, dataset_size=batch)
    ids = torch.arange(batch)
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    ddp = DistributedDataParallel(model)
    directory = Path(tempfile.mkdtemp(prefix="snapshot-overhead-"))
    snaps = Snapshotter(directory, keep=2)

    def block(commit: bool) -> float:
        start = time.perf_counter()
        future = snaps.commit(0, state) if commit else None
        for _ in range(every):
            train_step(ddp, opt, sched, task, ids, batch, 1, torch.device("cpu"))  # type: ignore[arg-type]
        if future is not None:
            future.result()
        return time.perf_counter() - start

    try:
        block(False)
        block(True)  # warm-up: first-time allocations on both paths
        pairs: list[tuple[float, float]] = []
        blocked: list[float] = []
        for r in range(rounds):
            times = {}
            for commit in ((True, False) if r % 2 == 0 else (False, True)):
                times[commit] = block(commit)
                if commit:
                    info = snaps.flush()
                    if info is not None:
                        blocked.append(info.blocking_s)
            pairs.append((times[True], times[False]))
    finally:
        snaps.close()
        shutil.rmtree(directory, ignore_errors=True)
    # Each pair ran back to back; the median of their ratios shrugs off bursts of
    # other load on the machine that the means would carry.
    return {"with": statistics.median(p[0] for p in pairs) / every,
            "without": statistics.median(p[1] for p in pairs) / every,
            "ratio": statistics.median(p[0] / p[1] for p in pairs),
            "mean_ratio": sum(p[0] for p in pairs) / sum(p[1] for p in pairs),
            "blocking": statistics.median(blocked) if blocked else float("nan")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-size", default="100mb", choices=sorted(MODEL_SIZES))
    parser.add_argument("--batch", type=int, nargs="+", default=[256, 1024],
                        help="batch sizes for the overhead measurement "
                             "(the step time grows with it)")
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=10,
                        help="blocks of --every steps with and (as many) without snapshots")
    parser.add_argument("--spare-core", action="store_true",
                        help="also measure batch 256 with one training thread, leaving a core to "
                             "the writer (as on a GPU machine, whose CPU cores are mostly idle)")
    parser.add_argument("--repeats", type=int, default=7,
                        help="commits / saves for the blocking medians")
    parser.add_argument("--dir", type=Path, default=None,
                        help="where to write (default: a temp dir)")
    args = parser.parse_args()

    directory = Path(tempfile.mkdtemp(prefix="snapshot-bench-", dir=args.dir))
    try:
        state = state_after_one_step(args.model_size, batch=64)
        blocking = measure_blocking(directory, state, args.repeats)
        del state
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    overheads = {f"batch {b}": measure_overhead(args.model_size, b, args.every, args.rounds)
                 for b in args.batch}
    if args.spare_core:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        overheads["batch 256, 1 training thread"] = measure_overhead(args.model_size, 256,
                                                                     args.every, args.rounds)
        torch.set_num_threads(threads)

    mb = blocking["bytes"] / 1e6
    ratio = blocking["blocking"] / blocking["save"]
    model_mb = MODEL_SIZES[args.model_size].parameter_count() * 4 / 1e6
    nice = os.environ.get(WRITER_NICE_ENV, str(DEFAULT_WRITER_NICE))
    print(f"Snapshot benchmark, {datetime.date.today().isoformat()}: {os.cpu_count()} CPUs "
          f"({cpu_model()}), torch {torch.__version__}, Python {platform.python_version()}; "
          f"model {args.model_size} ({model_mb:.0f} MB), state with AdamW {mb:.0f} MB; "
          f"load average at the end {os.getloadavg()[0]:.2f}; writer nice {nice}\n")
    print("| measure | value | target |")
    print("| --- | --- | --- |")
    print(f"| loop blocked per commit (median of {args.repeats}) | "
          f"{blocking['blocking'] * 1e3:.1f} ms | |")
    print(f"| synchronous `torch.save` of the same state (median) | "
          f"{blocking['save'] * 1e3:.0f} ms | |")
    print(f"| synchronous `torch.save` + fsync (median) | "
          f"{blocking['save_fsync'] * 1e3:.0f} ms | |")
    print(f"| **blocking / synchronous save** | **{ratio:.1%}** | <= 20% |")
    print(f"| background write per commit, alone (save, sha256, fsync, rename) | "
          f"{blocking['write'] * 1e3:.0f} ms | |")
    for case, o in overheads.items():
        print(f"| {case}: step time without / with a commit every {args.every} steps (medians) | "
              f"{o['without'] * 1e3:.0f} / {o['with'] * 1e3:.0f} ms | |")
        print(f"| {case}: loop blocked per commit, while training (median) | "
              f"{o['blocking'] * 1e3:.1f} ms | |")
        print(f"| **{case}: step-time overhead** (median of {args.rounds} pairs; of the sums) | "
              f"**{o['ratio'] - 1:+.1%}** ({o['mean_ratio'] - 1:+.1%}) | <= 2% |")


if __name__ == "__main__":
    main()
