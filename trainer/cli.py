"""Command line of the bundled trainer: ``torchrun ... -m trainer --steps N ...``."""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from trainer.model import MODEL_SIZES
from trainer.train import TrainSettings


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m trainer",
        description="Elastic DDP trainer on a synthetic task, with snapshots and preemption "
                    "handling.")
    p.add_argument("--steps", type=int, default=100, help="total optimizer steps (default 100)")
    p.add_argument("--global-batch-size", type=int, default=32,
                   help="samples per step across all ranks, whatever the world size (default 32)")
    p.add_argument("--snapshot-dir", type=Path, default=None,
                   help="where global rank 0 writes snapshots; need not be shared: each "
                        "node may have its own, the newest any node has is restored")
    p.add_argument("--snapshot-every", type=int, default=0,
                   help="commit a snapshot every K steps (0: only on preemption and at the end)")
    p.add_argument("--keep", type=int, default=3, help="snapshots to keep (default 3)")
    p.add_argument("--seed", type=int, default=0, help="seed of the model, the data and its order")
    p.add_argument("--metrics", type=Path, default=None,
                   help="JSON-lines event file (rank 0 appends)")
    p.add_argument("--step-delay", type=float, default=0.0,
                   help="seconds of sleep added to every step (slow, steady jobs for tests)")
    p.add_argument("--model-size", choices=sorted(MODEL_SIZES), default="tiny",
                   help="student size: tiny (~7 KB), small (~0.6 MB), 100mb (~101 MB)")
    p.add_argument("--dataset-size", type=int, default=1024,
                   help="samples per epoch (default 1024)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate of AdamW")
    p.add_argument("--warmup-steps", type=int, default=10, help="linear warmup steps")
    p.add_argument("--collective-timeout", type=float, default=60.0,
                   help="seconds before a collective with a silent peer fails (default 60)")
    p.add_argument("--stop-grace", type=float, default=3.0,
                   help="after SIGTERM/SIGINT, seconds to reach the step boundary before exiting "
                        "without a snapshot (default 3)")
    p.add_argument("--preempt-grace", type=float, default=30.0,
                   help="the same after SIGUSR2; keep it below torchrun's --shutdown-timeout "
                        "(default 30)")
    p.add_argument("--hold-timeout", type=float, default=60.0,
                   help="seconds to wait for this worker's own signal, or for the etcd-ext agent "
                        "after a peer failure, before exiting non-zero (default 60)")
    p.add_argument("--record-samples", type=Path, default=None,
                   help="test only: every rank appends the sample ids of every step here")
    p.add_argument("--stop-at", type=int, default=None, metavar="N",
                   help="test only: end after step N as if it were the last (a durable "
                        "snapshot, the done event), keeping the schedule of --steps: one "
                        "segment of a run replayed at another world size")
    p.add_argument("--progress-every", type=float, default=10.0, metavar="SECONDS",
                   help="global rank 0 prints a progress line to stdout every SECONDS, and at "
                        "every worker generation's start and at the end; a live bar instead on "
                        "a terminal with tqdm installed; 0 turns it off (default 10)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where to train: cuda:LOCAL_RANK, the CPU, or auto (a GPU when there "
                        "is one; default)")
    p.add_argument("--backend", choices=("auto", "nccl", "gloo"), default="auto",
                   help="collectives: auto is NCCL on a GPU, gloo on the CPU; gloo on a GPU "
                        "lets several ranks share one (default auto)")
    p.add_argument("--shard", choices=("none", "fsdp", "hsdp"), default="none",
                   help="none: DDP, every rank holds the whole state (default); fsdp: FSDP2 "
                        "over every rank, each rank's shards copied to the next node; hsdp: "
                        "FSDP2 within a node, replicated across nodes")
    p.add_argument("--shard-copy-every", type=int, default=1, metavar="K",
                   help="with --shard fsdp, copy each rank's shards to the next node every K "
                        "steps (up to K-1 steps trained again after a node's loss; 0: no "
                        "copies, a node's loss falls back to the snapshot; default 1)")
    p.add_argument("--shard-copy-background", action="store_true",
                   help="with --shard fsdp, send the copy on a thread of its own: the step "
                        "waits only for the capture, but a node that dies during a copy costs "
                        "that step, trained again (default: the step waits for its copy)")
    p.add_argument("--log-level", default=os.environ.get("TRAINER_LOG_LEVEL", "INFO"))
    return p


def parse_settings(argv: Sequence[str] | None = None) -> tuple[TrainSettings, str]:
    args = build_parser().parse_args(argv)
    if args.steps < 0 or args.snapshot_every < 0 or args.keep < 1 or args.shard_copy_every < 0:
        raise SystemExit("--steps, --snapshot-every and --shard-copy-every must be >= 0, "
                         "--keep >= 1")
    if args.backend == "nccl" and args.device == "cpu":
        raise SystemExit("--backend nccl needs a GPU: use --device cuda (or auto), or "
                         "--backend gloo")
    if not args.progress_every >= 0 or math.isinf(args.progress_every):
        raise SystemExit("--progress-every must be a finite number of seconds >= 0")
    settings = TrainSettings(
        steps=args.steps, global_batch_size=args.global_batch_size, snapshot_dir=args.snapshot_dir,
        snapshot_every=args.snapshot_every, keep=args.keep, seed=args.seed, metrics=args.metrics,
        step_delay=args.step_delay, model_size=args.model_size, dataset_size=args.dataset_size,
        lr=args.lr, warmup_steps=args.warmup_steps, collective_timeout=args.collective_timeout,
        stop_grace=args.stop_grace, preempt_grace=args.preempt_grace,
        hold_timeout=args.hold_timeout, record_samples=args.record_samples,
        stop_at=args.stop_at,
        progress_every=args.progress_every, device=args.device, backend=args.backend,
        shard=args.shard, shard_copy_every=args.shard_copy_every,
        shard_copy_background=args.shard_copy_background)
    return settings, args.log_level


def main(argv: Sequence[str] | None = None) -> int:
    main_at = time.time()
    settings, level = parse_settings(argv)
    rank = os.environ.get("RANK", "0")
    logging.basicConfig(level=level.upper(), stream=sys.stderr,
                        format=f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s")
    # Imported here so that --help answers without importing torch.distributed.
    from torch.distributed.elastic.multiprocessing.errors import record

    from trainer.train import run

    return int(record(run)(settings, main_at=main_at) or 0)
