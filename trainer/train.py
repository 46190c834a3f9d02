"""The elastic DDP training loop, built on the snapshot hook and the preemption guard."""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import sys
import time
from concurrent.futures import Future
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from elastic_ext import control
from elastic_ext.distributed import (
    BackendChoice,
    DeviceChoice,
    choose_device,
    init_process_group,
)
from elastic_ext.preemption import GuardSettings, PreemptionGuard, exit_now
from elastic_ext.snapshot import (
    HeldStep,
    Restored,
    SnapshotError,
    SnapshotInfo,
    Snapshotter,
    Source,
)
from elastic_ext.warm.worker import launched_at
from trainer.data import DataPosition, next_batch, shard
from trainer.metrics import MetricsLog
from trainer.model import MODEL_SIZES, SyntheticTask, build_model, params_sha256
from trainer.progress import Progress, open_progress

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
    progress_every: float = 10.0
    device: DeviceChoice = "auto"
    backend: BackendChoice = "auto"


@dataclass(frozen=True)
class DistEnv:
    """What torchrun tells a worker through its environment (or a lone process's defaults)."""

    rank: int
    world_size: int
    local_rank: int
    restart: int
    run_id: str
    under_launcher: bool

    @classmethod
    def from_environ(cls) -> DistEnv:
        env = os.environ
        return cls(rank=int(env.get("RANK", 0)), world_size=int(env.get("WORLD_SIZE", 1)),
                   local_rank=int(env.get("LOCAL_RANK", 0)),
                   restart=int(env.get("TORCHELASTIC_RESTART_COUNT", 0)),
                   run_id=env.get("TORCHELASTIC_RUN_ID", f"pid{os.getpid()}"),
                   under_launcher="MASTER_ADDR" in env and "RANK" in env)


def lr_factor(step: int, total: int, warmup: int) -> float:
    """Linear warmup, then cosine decay to 10%: a function of the step only,
    not of the world size."""
    ramp = min(1.0, (step + 1) / max(1, warmup))
    progress = min(step, total) / max(1, total)
    return ramp * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def init_distributed(env: DistEnv, settings: TrainSettings) -> torch.device:
    """NCCL with one GPU per LOCAL_RANK when CUDA is available (``--device``,
    ``--backend`` choose otherwise), gloo on the CPU; collectives time out after
    ``--collective-timeout`` (``elastic_ext.distributed.init_process_group``)."""
    try:
        device = choose_device(settings.device, env.local_rank)
    except ValueError as exc:
        raise SystemExit(f"trainer: {exc}") from None
    if env.under_launcher:
        init_process_group(timeout_s=settings.collective_timeout, device=device,
                           backend=settings.backend)
    else:  # a lone process: same code path, a one-rank group
        init_process_group(timeout_s=settings.collective_timeout, device=device,
                           backend=settings.backend, store=dist.HashStore())
    return device


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


def _report_snapshot(metrics: MetricsLog, progress: Progress, step: int,
                     future: Future[SnapshotInfo | None]) -> None:
    """Runs in the writer thread when a background snapshot is durable (or failed)."""
    try:
        info = future.result()
    except Exception as exc:
        logger.error("snapshot of step %d failed, training goes on: %s", step, exc)
        return
    if info is not None:
        progress.snapshot_durable()
        metrics.emit("snapshot", step, blocking_s=info.blocking_s, write_s=info.write_s,
                     bytes=info.size)


class Trainer:
    """One worker's run: restore, train, snapshot, and stop on a signal."""

    def __init__(self, settings: TrainSettings, guard: PreemptionGuard,
                 main_at: float | None = None) -> None:
        self.settings = settings
        self.guard = guard
        self.env = DistEnv.from_environ()
        self._times = {"launched_at": launched_at(), "main_at": main_at or time.time()}
        self.device = init_distributed(self.env, settings)
        self._times["pg_ready_at"] = time.time()
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        if settings.global_batch_size < self.world_size:
            raise ValueError(f"--global-batch-size {settings.global_batch_size} is smaller than "
                             f"the world size {self.world_size}")
        self.metrics = MetricsLog(settings.metrics, enabled=self.rank == 0,
                                  world_size=self.world_size, restart=self.env.restart)
        size = MODEL_SIZES[settings.model_size]
        self.task = SyntheticTask.make(size, settings.seed, settings.dataset_size)
        self.model = build_model(size, settings.seed).to(self.device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=settings.lr,
                                           weight_decay=0.01)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, partial(lr_factor, total=settings.steps, warmup=settings.warmup_steps))
        self.snapshots = Snapshotter(settings.snapshot_dir, keep=settings.keep)
        self.recorder = (SampleRecorder(settings.record_samples, self.rank, self.world_size,
                                        f"{self.env.run_id}/{self.env.restart}")
                         if settings.record_samples is not None else None)
        self.progress = open_progress(
            rank=self.rank, every_s=settings.progress_every, total=settings.steps,
            global_batch_size=settings.global_batch_size, world_size=self.world_size,
            restarts=self.env.restart, snapshots_on=settings.snapshot_dir is not None,
            stream=sys.stdout)
        self.step = 0
        self.position = DataPosition()
        self.last = HeldStep(self.step, self.position, device=self.device)
        self._restored_age_s: float | None = None
        self._restore_event: dict[str, Any] = {}
        guard.keep_state = self._keep_last_step  # last: it reads what is set above

    def _state(self, position: DataPosition | None = None) -> dict[str, Any]:
        s = self.settings
        at = self.position if position is None else position
        return {"model": self.model, "optimizer": self.optimizer, "scheduler": self.scheduler,
                "data": {**at.to_state(), "seed": s.seed, "dataset_size": s.dataset_size,
                         "global_batch_size": s.global_batch_size}}

    def restore(self) -> int | None:
        started = time.perf_counter()
        restored = self.snapshots.restore(
            {"model": self.model, "optimizer": self.optimizer, "scheduler": self.scheduler})
        self._report_restore(restored, time.perf_counter() - started)
        if restored is None:
            return None
        data = restored.state["data"]
        s = self.settings
        if (data["seed"], data["dataset_size"]) != (s.seed, s.dataset_size):
            raise SnapshotError(f"{restored.origin} was taken with --seed {data['seed']} and "
                                f"--dataset-size {data['dataset_size']}; this run has {s.seed} and "
                                f"{s.dataset_size}, so its data order would not continue")
        if data["global_batch_size"] != s.global_batch_size:
            logger.warning("global batch size changed from %d to %d; "
                           "the epoch continues at sample %d",
                           data["global_batch_size"], s.global_batch_size, data["offset"])
        self.step = restored.step
        self.position = DataPosition.from_state(data)
        self.last = HeldStep(self.step, self.position, device=self.device)
        if restored.created is not None and restored.source == Source.DISK:
            self._restored_age_s = max(0.0, time.time() - restored.created)
        return restored.step

    def _report_restore(self, restored: Restored | None, seconds: float) -> None:
        """What the ``restore`` event (logged after ``start``) says: where the state came
        from, its step, size and the time it took."""
        if restored is None:
            self._restore_event = {"step": 0, "source": Source.NONE, "bytes": 0,
                                   "seconds": seconds}
        else:
            self._restore_event = {"step": restored.step, "source": restored.source,
                                   "bytes": restored.bytes, "seconds": seconds}

    def _keep_last_step(self, why: str) -> None:
        """Keep the completed step the state holds in node memory (the guard calls this
        before the worker leaves mid-step, from any thread); on a GPU only a step the
        device finished (``HeldStep``)."""
        result = self.last.keep(
            lambda step, position: self.snapshots.stage_kept(self._state(position)),
            self.snapshots.write_kept)
        step = result[0] if result is not None else (self.last.step or self.step)
        kept = result is not None and result[1] is not None
        if kept:
            logger.info("kept the state of step %d in node memory (%s)", step, why)
        self.metrics.emit("fault", step, why=why, kept=step if kept else None)

    def run(self) -> int:
        s = self.settings
        resumed_from = self.restore()
        self._times["restored_at"] = time.time()
        self.metrics.emit("start", self.step, resumed_from=resumed_from, **self._times)
        restore = self._restore_event
        self.metrics.emit("restore", restore.pop("step"), **restore)
        logger.info("rank %d/%d pid %d starting at step %d (%s)", self.rank, self.world_size,
                    os.getpid(), self.step, "resumed" if resumed_from is not None else "fresh")
        self.progress.start(self.step, resumed_from, self._restored_age_s)
        ddp = DistributedDataParallel(
            self.model, device_ids=[self.device.index] if self.device.type == "cuda" else None)
        try:
            settle_buckets(ddp, self.task.inputs[:0].to(self.device))
        except Exception as exc:
            self.progress.close()
            exit_now(self.guard.failure_exit_code(exc))  # re-raises what is not a peer's fault
        while self.step < s.steps:
            ids, after = next_batch(self.position, s.seed, s.global_batch_size, s.dataset_size)
            mine = shard(ids, self.rank, self.world_size)
            try:
                loss_sum = train_step(ddp, self.optimizer, self.scheduler, self.task, mine,
                                      s.global_batch_size, self.world_size, self.device,
                                      updating=self.last.updating(self.step + 1, after))
                if self.recorder is not None:
                    self.recorder.record(self.step + 1, after.epoch, mine, ids)
                if s.step_delay > 0:
                    time.sleep(s.step_delay)
                agreed = self.guard.agree(loss_sum.reshape(1))
                self.last.confirm()  # the host read the agreement: the update is done
            except Exception as exc:
                self.progress.close()
                exit_now(self.guard.failure_exit_code(exc))  # re-raises what is not a peer's fault
            self.step += 1
            self.position = after
            assert agreed.values is not None
            loss = agreed.values[0].item() / s.global_batch_size
            self.metrics.emit("step", self.step, loss=loss)
            self.progress.step(self.step, loss)
            if agreed.stop:
                self._stopped_for_restart() if agreed.restart else self._preempted()
            if (s.snapshot_dir is not None and s.snapshot_every > 0
                    and self.step % s.snapshot_every == 0 and self.step < s.steps):
                future = self.snapshots.commit(self.step, self._state())
                future.add_done_callback(
                    partial(_report_snapshot, self.metrics, self.progress, self.step))
        self.guard.begin_commit()
        if resumed_from != self.step:  # a restart of a finished run has nothing new to commit
            self._commit_now()
        self.guard.done()
        digest = params_sha256(self.model)
        self.metrics.emit("done", self.step, params_sha256=digest)
        self.progress.finish("done")
        logger.info("done at step %d, params sha256 %s", self.step, digest)
        self.close()
        return 0

    def _commit_now(self) -> None:
        if self.settings.snapshot_dir is None:
            return
        try:
            info = self.snapshots.commit_now(self.step, self._state())
        except SnapshotError as exc:
            logger.error("%s", exc)
            exit_now(1)
        except Exception as exc:
            exit_now(self.guard.failure_exit_code(exc))
        if info is not None:
            self.progress.snapshot_durable()
            self.metrics.emit("snapshot", self.step, blocking_s=info.blocking_s,
                              write_s=info.write_s, bytes=info.size)

    def _stopped_for_restart(self) -> None:
        """Every signalled rank's agent is restarting the round (a membership change): keep
        this step in node memory, where the next round's hand-off takes it from."""
        reason = control.leaving_reason() or "membership"
        logger.info("stopping at step %d: the etcd-ext agent restarts the round (%s)", self.step,
                    reason)
        kept = self.snapshots.keep_local(self.step, self._state())
        self.metrics.emit("stopped", self.step, reason=reason,
                          kept=self.step if kept is not None else None)
        self.progress.finish("stopped")
        code = self.guard.preempted_exit_code()
        self.close()
        exit_now(code)

    def _preempted(self) -> None:
        received = self.guard.signalled
        logger.warning("stopping at step %d: %s", self.step,
                       f"got {signal.Signals(received).name}" if received
                       else "a peer was signalled")
        self.snapshots.keep_local(self.step, self._state())
        self._commit_now()
        self.progress.finish("preempted")
        code = self.guard.preempted_exit_code()
        # After the wait for this worker's own signal: under etcd-ext its agent may tell it
        # of the job's stop a moment after a peer's agent did.
        received = self.guard.signalled
        self.metrics.emit("preempted", self.step,
                          signal=signal.Signals(received).name if received else None)
        self.close()
        exit_now(code)

    def close(self) -> None:
        """Flush and close what this worker wrote. The process group is left alone: the
        process exits at once (``exit_now``), and with torch 2.13 freeing a gloo group can
        deadlock on the GIL (pytorch issues 75097 and 56297; PR 179291)."""
        self.progress.close()
        self.snapshots.close()
        if self.recorder is not None:
            self.recorder.close()
        self.metrics.close()


def run(settings: TrainSettings, main_at: float | None = None) -> int:
    """Train; ``main_at`` is when the command line's ``main`` began (for the ``start`` event)."""
    guard = PreemptionGuard(GuardSettings(stop_grace_s=settings.stop_grace,
                                          preempt_grace_s=settings.preempt_grace,
                                          hold_timeout_s=settings.hold_timeout)).install()
    trainer = Trainer(settings, guard, main_at)
    code = trainer.run()
    guard.uninstall()
    return code
