"""The bundled trainer's model, data, metrics and progress on ``elastic_ext.ElasticLoop``,
which carries everything that makes it elastic (restore and hand-off, snapshots, stops)."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import sys
import time
from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from elastic_ext.worker.distributed import BackendChoice, DeviceChoice
from elastic_ext.worker.loop import ElasticLoop, LoopSettings
from trainer.model import MODEL_SIZES, SyntheticTask, build_model, params_sha256
from trainer.progress import open_progress

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class TrainSettings:
    """Everything the CLI sets; see ``trainer.cli`` for what each means."""

    steps: int = 100
    global_batch_size: int = 32
    snapshot_dir: Path | None = None
    snapshot_every: int = 0
    keep: int = 3
    seed: int = 0
    metrics: Path | None = None
    step_delay: float = 0.0
    model_size: str = "tiny"
    dataset_size: int = 1024
    lr: float = 3e-3
    warmup_steps: int = 10
    collective_timeout: float = 60.0
    stop_grace: float = 3.0
    preempt_grace: float = 30.0
    hold_timeout: float = 60.0
    record_samples: Path | None = None
    stop_at: int | None = None
    progress_every: float = 10.0
    device: DeviceChoice = "auto"
    backend: BackendChoice = "auto"
    shard: str = "none"
    shard_copy_every: int = 1
    shard_copy_background: bool = False


@dataclass(frozen=True)
class DistEnv:
    """What the trainer reads of torchrun's environment beyond what ``ElasticLoop`` does
    (or a lone process's defaults): for the sample recorder and the progress line."""

    restart: int
    run_id: str

    @classmethod
    def from_environ(cls) -> DistEnv:
        env = os.environ
        return cls(restart=int(env.get("TORCHELASTIC_RESTART_COUNT", 0)),
                   run_id=env.get("TORCHELASTIC_RUN_ID", f"pid{os.getpid()}"))


def lr_factor(step: int, total: int, warmup: int) -> float:
    """Linear warmup, then cosine decay to 10%: a function of the step only,
    not of the world size."""
    ramp = min(1.0, (step + 1) / max(1, warmup))
    progress = min(step, total) / max(1, total)
    return ramp * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


class SampleRecorder:
    """Test-only: every rank appends the ids it trained on, one JSON line per step."""

    def __init__(self, path: Path, rank: int, world_size: int, incarnation: str) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._base = {"rank": rank, "world_size": world_size, "incarnation": incarnation}

    def record(self, step: int, epoch: int, ids: torch.Tensor, batch: torch.Tensor) -> None:
        """``ids``: this rank's share; ``batch``: the whole step's, for a step whose other
        ranks could not record it (they failed after their share was reduced)."""
        line = json.dumps({**self._base, "step": step, "epoch": epoch, "ids": ids.tolist(),
                           "batch": batch.tolist()}) + "\n"
        os.write(self._fd, line.encode())  # one write per line: ranks' lines never interleave

    def close(self) -> None:
        os.close(self._fd)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer,
               scheduler: torch.optim.lr_scheduler.LRScheduler, task: SyntheticTask,
               ids: torch.Tensor, global_batch_size: int, world_size: int,
               device: torch.device,
               updating: AbstractContextManager[object] | None = None) -> torch.Tensor:
    """One optimizer step on this rank's share; returns the share's summed loss.

    The loss is scaled so that DDP's average over ranks is the mean over the global
    batch: gradients, and so the learning rate, do not depend on the world size.
    ``updating`` is entered around the update of parameters and optimizer state.
    """
    inputs = task.inputs[ids].to(device, non_blocking=True)
    targets = task.targets[ids].to(device, non_blocking=True)
    optimizer.zero_grad(set_to_none=True)
    per_sample = ((model(inputs) - targets) ** 2).mean(dim=1)
    loss_sum = per_sample.sum()
    (loss_sum * (world_size / global_batch_size)).backward()
    with updating or nullcontext():
        optimizer.step()
        scheduler.step()
    result: torch.Tensor = loss_sum.detach()
    return result


def shard_model(model: nn.Module, mesh: DeviceMesh) -> None:
    """FSDP2 over ``mesh``: each linear layer its own unit, then the root (the PyTorch FSDP2
    tutorial's layout). Gradients are averaged over the ranks as DDP's are, so the loss
    scaling and the learning rate are those of the DDP run."""
    for layer in model.modules():
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def sharded_params_sha256(model: nn.Module) -> str:
    """``params_sha256`` of a sharded model: the same digest as the unsharded module of the
    same weights (gathered on every rank; collective)."""
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    digest = hashlib.sha256()
    for name in sorted(full):
        value = full[name]
        assert isinstance(value, torch.Tensor)
        digest.update(value.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def settle_buckets(ddp: DistributedDataParallel, empty_batch: torch.Tensor) -> None:
    """One synchronised backward on an empty batch, so that DDP rebuilds its gradient buckets
    before the first real step instead of after it.

    DDP reduces its first iteration in one bucket in parameter order and every later one in
    buckets rebuilt in the order gradients became ready. Gloo's ring all-reduce sums an element
    in an order set by its offset in its bucket, so with 3 or more ranks the two layouts round
    differently: a generation resumed from a snapshot would reduce its first step in the initial
    layout where the uninterrupted run used the rebuilt one. With this, every real step of every
    generation uses the rebuilt layout. The gradients (zeros) are dropped; the optimizer and
    scheduler are not touched.
    """
    ddp(empty_batch).sum().backward()
    for param in ddp.module.parameters():
        param.grad = None


class Trainer:
    """One worker's run: the trainer's model, data, metrics and progress on ``ElasticLoop``,
    which carries the restore, the hand-off, the snapshots and the stops."""

    def __init__(self, settings: TrainSettings, main_at: float | None = None) -> None:
        self.settings = s = settings
        self.env = DistEnv.from_environ()
        try:
            self.loop = ElasticLoop(LoopSettings(
                snapshot_dir=s.snapshot_dir, snapshot_every=s.snapshot_every, keep_snapshots=s.keep,
                total_steps=s.steps, device=s.device, collective_backend=s.backend,
                collective_timeout_s=s.collective_timeout, stop_grace_s=s.stop_grace,
                preempt_grace_s=s.preempt_grace, hold_timeout_s=s.hold_timeout,
                events_file=s.metrics, shard_copy_every=s.shard_copy_every,
                shard_copy_in_background=s.shard_copy_background,
                # compatible: a job resubmitted under a new --rdzv-id goes on from its snapshots
                resume_other_runs=True),
                on_event=self._on_event, main_at=main_at)
        except ValueError as exc:
            raise SystemExit(f"trainer: {exc}") from None
        self.device = self.loop.device
        self.rank, self.world_size = self.loop.rank, self.loop.world_size
        if s.global_batch_size < self.world_size:
            raise ValueError(f"--global-batch-size {s.global_batch_size} is smaller than "
                             f"the world size {self.world_size}")
        size = MODEL_SIZES[s.model_size]
        self.task = SyntheticTask.make(size, s.seed, s.dataset_size)
        self.model = build_model(size, s.seed).to(self.device)
        if s.shard != "none":  # shard before the optimizer exists: it holds the DTensors
            try:
                shard_model(self.model, self.loop.mesh(hsdp=s.shard == "hsdp"))
            except ValueError as exc:
                raise SystemExit(f"trainer: --shard {s.shard}: {exc}") from None
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=s.lr, weight_decay=0.01)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, partial(lr_factor, total=s.steps, warmup=s.warmup_steps))
        self.recorder = (SampleRecorder(s.record_samples, self.rank, self.world_size,
                                        f"{self.env.run_id}/{self.env.restart}")
                         if s.record_samples is not None else None)
        self.progress = open_progress(
            rank=self.rank, every_s=s.progress_every, total=s.steps,
            global_batch_size=s.global_batch_size, world_size=self.world_size,
            restarts=self.env.restart, snapshots_on=s.snapshot_dir is not None,
            stream=sys.stdout)

    @property
    def step(self) -> int:
        return self.loop.step

    def _on_event(self, event: str, step: int, fields: Mapping[str, Any]) -> None:
        """The loop's events drive the progress display and close what the trainer wrote."""
        if event == "snapshot":
            self.progress.snapshot_durable()
        elif event in ("stopped", "preempted", "done"):
            self.progress.finish(event)
            self.progress.close()
            if self.recorder is not None:
                self.recorder.close()

    def run(self) -> int:
        s = self.settings
        loop = self.loop
        resumed_from = loop.restore(model=self.model, optimizer=self.optimizer,
                                    scheduler=self.scheduler) or None
        logger.info("rank %d/%d pid %d starting at step %d (%s)", self.rank, self.world_size,
                    os.getpid(), self.step, "resumed" if resumed_from is not None else "fresh")
        self.progress.start(self.step, loop.framework.resumed_from, loop.framework.restored_age_s)
        ddp: nn.Module = self.model
        if s.shard == "none":
            ddp = DistributedDataParallel(self.model, device_ids=loop.device_ids)
            try:
                settle_buckets(ddp, self.task.inputs[:0].to(self.device))
            except Exception as exc:
                self.progress.close()
                loop.framework.fail(exc)  # re-raises what is not a peer's fault
        last = s.steps if s.stop_at is None else min(s.stop_at, s.steps)
        for mine in loop.batches(s.dataset_size, s.global_batch_size, seed=s.seed, steps=last):
            try:
                loss_sum = train_step(ddp, self.optimizer, self.scheduler, self.task, mine,
                                      s.global_batch_size, self.world_size, self.device,
                                      updating=loop.update())
                if self.recorder is not None:
                    hooks = loop.framework
                    assert hooks.next_position is not None and hooks.global_ids is not None
                    self.recorder.record(self.step + 1, hooks.next_position.epoch, mine,
                                         hooks.global_ids)
                if s.step_delay > 0:
                    time.sleep(s.step_delay)
            except Exception as exc:
                self.progress.close()
                loop.framework.fail(exc)  # re-raises what is not a peer's fault
            loss = loop.step_done(loss_sum.reshape(1), total=s.global_batch_size)
            self.progress.step(self.step, loss or 0.0)
        digest = (params_sha256(self.model) if s.shard == "none"
                  else sharded_params_sha256(self.model))
        loop.finish(params_sha256=digest)
        logger.info("done at step %d, params sha256 %s", self.step, digest)
        return 0


def run(settings: TrainSettings, main_at: float | None = None) -> int:
    """Train; ``main_at`` is when the command line's ``main`` began (for the ``start`` event)."""
    return Trainer(settings, main_at).run()
