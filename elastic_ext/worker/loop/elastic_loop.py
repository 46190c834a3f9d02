"""``ElasticLoop``: the one object a training loop talks to, with the protocol inside.

What the bundled trainer does to lose no step when a node dies, is preempted or joins
(``docs/snapshot-hook.md``), in the order it must happen: the preemption guard before
the process group (signals during start-up count), the process group with NCCL's
error handling and a collective timeout, the collective restore with hand-off, the
held-step bookkeeping (on a GPU: only steps the device finished), keeping that step in
node memory on a peer fault or a membership stop, the step-boundary agreement, a
durable snapshot every K steps and on a stop, progress reports to the agent, and the
exit statuses. A loop names what to save and iterates::

    loop = ElasticLoop(LoopSettings(snapshot_dir=..., snapshot_every=50))
    model = Net().to(loop.device)
    optimizer = torch.optim.AdamW(model.parameters())
    loop.restore(model=model, optimizer=optimizer)
    ddp = DistributedDataParallel(model, device_ids=loop.device_ids)
    for ids in loop.batches(len(dataset), global_batch_size=32, steps=1000):
        loss = ...(ddp, dataset[ids]); loss.backward()
        with loop.update():
            optimizer.step()
        loop.step_done(loss)
    loop.finish()

A peer's fault raised anywhere in the loop (directly, or through the ``sys.excepthook``
the object installs) keeps the step, and the worker waits for its agent. Anything else is
raised as usual. ``ElasticLoop``'s docstring gives the order of the calls and what each
guarantees; ``loop.framework`` holds what only framework integrations and the bundled
trainer call.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import TracebackType
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from elastic_ext.warm.worker import launched_at
from elastic_ext.worker import control
from elastic_ext.worker.distributed import (
    BackendChoice,
    DeviceChoice,
    choose_device,
    init_process_group,
)
from elastic_ext.worker.loop.data import DataPosition, next_batch, shard
from elastic_ext.worker.loop.metrics_file import MetricsLog
from elastic_ext.worker.loop.sampler import StepSampler
from elastic_ext.worker.loop.sharding import (
    as_restored,
    every_rank_reduced,
    round_mesh,
    sharded_state_for,
)
from elastic_ext.worker.preemption import GuardSettings, PreemptionGuard, exit_now
from elastic_ext.worker.snapshot import (
    HeldStep,
    Restored,
    SnapshotError,
    SnapshotMismatchError,
    Snapshotter,
    Source,
    Stateful,
)
from elastic_ext.worker.snapshot.hook import SnapshotInfo
from elastic_ext.worker.snapshot.rng import continue_worker_rng, keep_worker_rng
from elastic_ext.worker.snapshot.sharded import ShardedState

logger = logging.getLogger(__name__)

EventHook = Callable[[str, int, Mapping[str, Any]], None]
"""Called with every event the loop logs (``event``, ``step``, its fields), on every rank."""


_RENAMED = {"metrics": "events_file", "backend": "collective_backend", "keep": "keep_snapshots"}
"""LoopSettings' old keyword names and their new ones."""

RUN_KEY = "__run__"
"""The entry of a snapshot that names the run id (``TORCHELASTIC_RUN_ID``) it was trained in."""

_TIMEOUTS = ("collective_timeout_s", "stop_grace_s", "preempt_grace_s", "hold_timeout_s")


@dataclass(frozen=True)
class LoopSettings:
    """What a loop chooses; the bundled trainer's flags of the similar names set them.

    The timeouts are checked against each other here, not when a signal comes.

    Raises:
        ValueError: a timeout that is not a positive number of seconds, or timeouts that
            cannot work together (the message names the fields and the fix).
        TypeError: a field given under both its old and its new name.
    """

    snapshot_dir: Path | None = None
    """Where global rank 0 writes durable snapshots (node-local is fine); None: none."""
    snapshot_every: int = 0
    """A background snapshot every K steps (0: only on a stop and at the end)."""
    keep_snapshots: int = 3
    """How many durable snapshots stay in ``snapshot_dir``; older ones are removed."""
    total_steps: int | None = None
    """The last step, if known: its snapshot is the final durable one, not a background one."""
    device: DeviceChoice = "auto"
    """Where to train: ``cuda:LOCAL_RANK``, the CPU, or ``auto`` (a GPU when there is one)."""
    collective_backend: BackendChoice = "auto"
    """The process group's backend: ``nccl``, ``gloo`` or ``auto`` (NCCL on a GPU, gloo on
    the CPU); not torchrun's ``--rdzv-backend``, which is etcd-ext's rendezvous."""
    collective_timeout_s: float = 60.0
    """Seconds before a collective with a silent peer fails (in the training thread)."""
    stop_grace_s: float = 3.0
    """After SIGTERM/SIGINT, seconds to reach the step boundary before the watchdog ends the
    worker without a snapshot (keeping the last step in node memory)."""
    preempt_grace_s: float = 30.0
    """The same after a preemption notice (SIGUSR2): the step may be slow; keep it below
    torchrun's ``--shutdown-timeout``. At least ``stop_grace_s``."""
    hold_timeout_s: float = 60.0
    """Seconds a worker waits for its own signal after a stop it learned from the others, or
    for its etcd-ext agent after reporting a peer's fault, before it exits non-zero."""
    events_file: Path | None = None
    """The JSON-lines events file (``elastic_ext.worker.loop.metrics_file``), appended by
    global rank 0; None: none."""
    shard_copy_every: int = 1
    """A sharded model (FSDP2 without replicas across nodes): every K steps each rank's
    shards are copied to host memory on the next node, before the step counts as done. 1:
    a node's loss costs no step; K: up to K-1 steps are trained again; 0: no copies (a
    node's loss falls back to the durable snapshot). HSDP needs none: its replica on
    another node holds the same shards."""
    shard_copy_in_background: bool = False
    """Send that copy on a thread of its own: the training thread only captures the
    shards into host memory (and waits for the previous copy), but a node that dies while
    its last copy is in flight costs that step, trained again. False: the step counts
    only once its copy arrived (0 steps trained again)."""
    resume_other_runs: bool = False
    """Continue from a snapshot written under another run id (torchrun's ``--rdzv-id``).
    False: ``restore`` refuses it, so a second run pointed at the same ``snapshot_dir``
    does not silently train on from the first one's weights; True for a job resubmitted
    under a new id that should go on from its predecessor (the bundled trainer does)."""

    def __post_init__(self) -> None:
        """Take a path given as text; check the timeouts against each other, and the counts."""
        for name in ("snapshot_dir", "events_file"):
            value = getattr(self, name)
            if isinstance(value, (str, os.PathLike)) and not isinstance(value, Path):
                object.__setattr__(self, name, Path(value))
            elif value is not None and not isinstance(value, Path):
                raise TypeError(f"LoopSettings.{name}={value!r} must be a path (str or "
                                "pathlib.Path) or None")
        self._check_timeouts()
        self._check_counts()

    def _check_counts(self) -> None:
        for name in ("snapshot_every", "keep_snapshots", "shard_copy_every"):
            value = getattr(self, name)
            least = 1 if name == "keep_snapshots" else 0
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"LoopSettings.{name}={value!r} must be a whole number, at "
                                 f"least {least}")

    def _check_timeouts(self) -> None:
        """Reject timeouts the guard could not honour, naming the fields and the fix."""
        for name in _TIMEOUTS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                    not value > 0:
                raise ValueError(f"LoopSettings.{name}={value!r} must be a positive number "
                                 "of seconds")
        if self.stop_grace_s > self.preempt_grace_s:
            raise ValueError(
                f"LoopSettings.stop_grace_s={self.stop_grace_s:g} is longer than "
                f"preempt_grace_s={self.preempt_grace_s:g}: a preemption notice (SIGUSR2) warns "
                "of the stop ahead of it, and when both come the earlier deadline ends the "
                "worker, so the notice's grace must be at least the stop's; raise "
                f"preempt_grace_s to at least {self.stop_grace_s:g} or lower stop_grace_s")


def _taking_old_names(init: Callable[..., None]) -> Callable[..., None]:
    """LoopSettings' constructor, taking the old keyword names too, each with a warning that
    names the new one (a field given under both names is refused)."""
    @functools.wraps(init)
    def construct(self: LoopSettings, *args: Any, **kwargs: Any) -> None:
        for old, new in _RENAMED.items():
            if old not in kwargs:
                continue
            if new in kwargs:
                raise TypeError(f"LoopSettings got both {old}= and {new}=: give {new} only "
                                f"({old} is its old name)")
            warnings.warn(f"LoopSettings({old}=...) is deprecated: use {new}=",
                          DeprecationWarning, stacklevel=2)
            kwargs[new] = kwargs.pop(old)
        init(self, *args, **kwargs)
    return construct


def _old_name(old: str, new: str) -> property:
    """Reading a field by its old name: the field's value, with a warning."""
    def read(self: LoopSettings) -> Any:
        warnings.warn(f"LoopSettings.{old} is deprecated: read {new}", DeprecationWarning,
                      stacklevel=2)
        return getattr(self, new)
    return property(read, doc=f"Deprecated: ``{new}``.")


setattr(LoopSettings, "__init__", _taking_old_names(LoopSettings.__init__))  # noqa: B010
for _old, _new in _RENAMED.items():
    setattr(LoopSettings, _old, _old_name(_old, _new))


def _local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def _run_id() -> str:
    """torchrun's run id (``--rdzv-id``); empty outside a launcher."""
    return os.environ.get("TORCHELASTIC_RUN_ID", "")


_MADE_UP_ID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}")


def named_run(run_id: str) -> bool:
    """Whether ``run_id`` names a job: not empty, and not the random id ``torchrun
    --standalone`` makes up for every launch (a uuid4), under which stopping and starting
    again in the same directory is the usual way to resume."""
    return bool(run_id) and _MADE_UP_ID.fullmatch(run_id) is None


def refuse_other_run(restored: Restored | None, *, allowed: bool) -> None:
    """Raise unless ``restored`` was trained in this run, was written before snapshots
    named their run, either run has no id of its own (``named_run``), or ``allowed``.

    Raises:
        SnapshotMismatchError: the snapshot names another run id (the message names the
            two ids and both fixes).
    """
    if restored is None or allowed:
        return
    theirs, ours = restored.state.get(RUN_KEY), _run_id()
    if not isinstance(theirs, str) or not named_run(theirs) or not named_run(ours) \
            or theirs == ours:
        return
    raise SnapshotMismatchError(
        f"{restored.origin} (step {restored.step}) was written by run {theirs!r}, and this "
        f"is run {ours!r}: give this run a snapshot directory of its own (for example "
        f"snapshots/{ours}), or LoopSettings(resume_other_runs=True) to go on from run "
        f"{theirs!r}'s step")


def _under_launcher() -> bool:
    return "MASTER_ADDR" in os.environ and "RANK" in os.environ


class ElasticLoop:
    """The guard, the process group, the snapshots and the step protocol of one worker.

    A loop calls, in this order, on every rank::

        loop = ElasticLoop(LoopSettings(...))          # 1. construct
        model = Net().to(loop.device)                  # 2. the plain module on loop.device
        loop.restore(model=model, optimizer=optimizer) # 3. restore (collective)
        ddp = DistributedDataParallel(model, device_ids=loop.device_ids)   # 4. wrap DDP
        for ids in loop.batches(len(dataset), global_batch_size=32, steps=1000):  # 5.
            loss = forward_backward(ddp, dataset[ids])
            with loop.update():                        # 6. around the update only
                optimizer.step()
            loop.step_done(loss)                       # 7. the step boundary
        loop.finish()                                  # 8. the end of training

    What each guarantees:

    1. Construction installs the preemption guard (signals during start-up count), then
       creates the default process group (NCCL with its error handling on a GPU, gloo on
       the CPU, ``collective_timeout_s``; a one-rank group without a launcher) and an
       ``excepthook`` for peer faults. Once per process, in the main thread, before any
       collective; ``device``, ``device_ids``, ``rank`` and ``world_size`` are set from
       here on.
    2. The model must be on ``loop.device`` before ``restore``, which loads into it.
    3. ``restore`` names what a snapshot holds and loads, on every rank, the newest step
       any rank holds (node memory, a peer, or disk); ``step`` is that step (0: fresh).
    4. DDP wraps the restored module, so every rank starts from the same weights.
    5. ``batches`` yields this rank's sample ids of each step from the restored position:
       every sample of an epoch exactly once across the ranks, at any world size.
    6. ``update`` brackets the optimizer's (and scheduler's) step: a keep never sees half
       an update; on a GPU a step counts only once the device finished it.
    7. ``step_done`` is the step boundary, one all-reduce on every rank: ``step`` grows by
       one, the loss is reduced, progress goes to the agent, and every
       ``snapshot_every`` steps a snapshot is written in the background.
    8. ``finish`` writes the last step durably (collective) and tells the agent the job is
       done; only this marks it finished.

    What happens otherwise:

    - A peer's fault (a collective raises because a peer died or hung), raised anywhere in
      the loop: the worker keeps the last completed step in node memory (never a half
      applied update), reports the fault to its etcd-ext agent and waits for the agent to
      stop it; the next round restores that step from the survivors. Under stock torchrun
      (no agent listening), and for any other error, the exception is raised as usual.
    - A membership change (a node joins or leaves: the agent restarts the round with
      SIGTERM): at the next ``step_done`` every rank keeps the step in node memory and
      exits; nothing need be durable.
    - A preemption or a real stop (SIGTERM, SIGINT, SIGUSR2, or the job's stop from the
      agent): at the next ``step_done`` every rank keeps the step and writes it durably,
      then exits (0 once its own signal came). A step boundary not reached within
      ``stop_grace_s`` (``preempt_grace_s`` after SIGUSR2) ends the worker without a
      durable snapshot, keeping the last completed step in node memory.

    - A hang (a rank stopped, deadlocked, or stuck outside the step's collectives while
      its agent lives): the agent judges it from ``step_done``'s pace (no step for
      max(2 s, 10 step times); ``no_hang_check()`` around known long pauses), every rank
      keeps the last completed step, the stuck worker is killed and the next round
      restores that step (docs/failure-model.md, "Hangs found from step progress").

    For framework integrations and the bundled trainer: ``framework`` (``FrameworkHooks``).
    """

    def __init__(self, settings: LoopSettings | None = None, *, on_event: EventHook | None = None,
                 main_at: float | None = None) -> None:
        """``on_event(event, step, fields)`` sees every event the loop logs, on every rank;
        ``main_at`` is when the script's ``main`` began (for the ``start`` event)."""
        s = self._settings = settings or LoopSettings()
        self._times = {"launched_at": launched_at(), "main_at": main_at or time.time()}
        self._guard = PreemptionGuard(GuardSettings(stop_grace_s=s.stop_grace_s,
                                                    preempt_grace_s=s.preempt_grace_s,
                                                    hold_timeout_s=s.hold_timeout_s)).install()
        self._device = choose_device(s.device)
        init_process_group(timeout_s=s.collective_timeout_s, device=self._device,
                           backend=s.collective_backend,
                           store=None if _under_launcher() else dist.HashStore())
        self._times["pg_ready_at"] = time.time()
        logger.debug("process group ready %.3fs after main began",
                     self._times["pg_ready_at"] - self._times["main_at"])
        self._rank, self._world_size = dist.get_rank(), dist.get_world_size()
        self._on_event = on_event
        self._events = MetricsLog(s.events_file, enabled=self._rank == 0,
                                  world_size=self._world_size,
                                  restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)))
        self._snapshots = Snapshotter(s.snapshot_dir, keep=s.keep_snapshots)
        self._step = 0
        self._position: DataPosition | None = None
        self._restored: Restored | None = None
        self._resumed_from: int | None = None
        self._objects: dict[str, Stateful] = {}
        self._data_settings: dict[str, int] = {}
        self._next: DataPosition | None = None
        self._global_ids: torch.Tensor | None = None
        self._held: HeldStep[DataPosition | None] = HeldStep(0, None, device=self._device)
        self._open_update: ExitStack | None = None
        self._guard.keep_state = self._keep_on_fault
        self._closed = False
        self._previous_hook = sys.excepthook
        sys.excepthook = self._excepthook
        self._framework = FrameworkHooks(self)
        self._sharded: ShardedState | None = None

    # -- what the loop reads
    @property
    def device(self) -> torch.device:
        """Where this rank trains: ``cuda:LOCAL_RANK`` or the CPU; the model goes here."""
        return self._device

    @property
    def device_ids(self) -> list[int] | None:
        """``DistributedDataParallel``'s ``device_ids``: this rank's GPU, None on the CPU."""
        return [self._device.index or 0] if self._device.type == "cuda" else None

    @property
    def rank(self) -> int:
        """This worker's global rank in this round."""
        return self._rank

    @property
    def world_size(self) -> int:
        """The number of ranks in this round (it may differ from the last round's)."""
        return self._world_size

    @property
    def step(self) -> int:
        """Steps completed: the restored step after ``restore``, one more per ``step_done``."""
        return self._step

    @property
    def framework(self) -> FrameworkHooks:
        """The hooks for framework integrations and the bundled trainer; a loop written by
        hand does not need them."""
        return self._framework

    # -- what the loop calls
    def mesh(self, *, hsdp: bool = False) -> DeviceMesh:
        """The device mesh for ``fully_shard`` in this round: 1-D over every rank, or with
        ``hsdp`` 2-D, ``("replicate", "shard")`` = (nodes, ranks per node): shards within
        a node, replicas across nodes, so a node's loss costs no copy. Built from this
        round's world size and ``LOCAL_WORLD_SIZE``; call it after construction, shard the
        model, create the optimizer, then ``restore``.

        Raises:
            ValueError: ``hsdp`` with a world size that is not a whole number of nodes.
        """
        return round_mesh(self._device.type, self._world_size, hsdp=hsdp)

    def restore(self, objects: Mapping[str, Stateful] | None = None,
                **named: Stateful) -> int:
        """Name what to save (modules, optimizers, schedulers, anything ``Stateful``) and
        load the newest step any rank holds into it, on every rank (collective); the step
        to continue from (0: a fresh start). Logs ``start`` and ``restore``.

        Raises:
            SnapshotMismatchError: the newest snapshot is of another model, or of another
                run id (``LoopSettings.resume_other_runs``).
        """
        self._objects = {**(objects or {}), **named}
        started = time.perf_counter()
        st = self._settings
        self._sharded = sharded_state_for(self._objects, snapshot_dir=st.snapshot_dir,
                                          copy_every=st.shard_copy_every,
                                          copy_in_background=st.shard_copy_in_background,
                                          keep_snapshots=st.keep_snapshots)
        if self._sharded is not None:
            restored = self._restored = as_restored(self._sharded.restore(), started)
        else:
            restored = self._restored = self._snapshots.restore(self._objects)
        refuse_other_run(restored, allowed=st.resume_other_runs)
        if restored is not None and restored.source in (Source.LOCAL, Source.PEER):
            # A disk snapshot brings every rank's RNG states; a hand-off, this slot's own
            continue_worker_rng(control.local_state_dir(), restored.step, _local_rank(), self._rank,
                                _run_id())
        seconds = time.perf_counter() - started
        self._times["restored_at"] = time.time()
        if restored is not None:
            self._step = self._resumed_from = restored.step
            data = restored.state.get("data")
            if isinstance(data, Mapping) and "epoch" in data:
                self._position = DataPosition.from_state(dict(data))
                self._data_settings = {k: int(data[k]) for k in
                                       ("seed", "dataset_size", "global_batch_size") if k in data}
        self._held = HeldStep(self._step, self._position, device=self._device)
        self._emit("start", self._step, resumed_from=self._resumed_from, rank=self._rank,
                   **self._times)
        self._emit("restore", restored.step if restored else 0,
                   source=restored.source if restored else Source.NONE,
                   bytes=restored.bytes if restored else 0, seconds=seconds)
        return self._step

    def batches(self, dataset_size: int, global_batch_size: int, *, seed: int = 0,
                steps: int | None = None) -> Iterator[torch.Tensor]:
        """This rank's sample ids for each step from the restored position on, until
        ``steps`` (or ``LoopSettings.total_steps``): every sample of an epoch exactly
        once across the ranks, at any world size and after any restore
        (``elastic_ext.worker.loop.data``), for a map-style dataset of ``dataset_size``.

        Raises:
            SnapshotError: the restored state was trained with another seed or dataset.
        """
        position = self._start_data(dataset_size, global_batch_size, seed=seed)
        last = steps if steps is not None else self._settings.total_steps
        while last is None or self._step < last:
            global_ids, after = next_batch(position, seed, global_batch_size, dataset_size)
            self._batch_started(global_ids, after)
            yield shard(global_ids, self._rank, self._world_size)
            position = self._position or DataPosition()

    @contextmanager
    def update(self) -> Iterator[None]:
        """Around the optimizer's (and scheduler's) step: no keep sees half an update, and
        on a GPU the step counts only once the device finished it (``HeldStep``); a
        sharded model's update waits for every rank (``sharding.every_rank_reduced``)."""
        if self._sharded is not None:
            every_rank_reduced()
        with self._held.updating(self._step + 1, self._next):
            yield

    def step_done(self, loss: torch.Tensor | None = None, *,
                  total: float | None = None) -> float | None:
        """The step boundary, on every rank: one all-reduce tells whether any rank was
        signalled (then keep or commit and exit here), confirms the update, reports
        progress, and starts a background snapshot every K steps. Returns the sum of
        ``loss`` over the ranks divided by ``total`` (default: the world size).
        """
        values = loss.detach().reshape(1) if loss is not None else None
        sharded, copied = self._sharded, {}
        try:
            if sharded is not None and sharded.copy_due(self._step + 1):
                # Before the agreement: once it passes, every rank's copy has arrived.
                copied["copy_s"] = sharded.copy(self._step + 1, self._rest(self._next))
            agreed = self._guard.agree(values)
            self._held.confirm()
        except Exception as exc:
            self._fail(exc)
        self._step += 1
        if self._next is not None:
            self._position = self._next
        mean = None
        if agreed.values is not None:
            mean = float(agreed.values[0].item()) / (total or self._world_size)
        where = {} if self._position is None else {"epoch": self._position.epoch,
                                                   "offset": self._position.offset}
        self._emit("step", self._step, loss=mean, **where, **copied)  # where the data stands
        if agreed.stop:
            if agreed.restart:
                self._stopped_for_restart()
            self._preempted()
        s = self._settings
        if (s.snapshot_dir is not None and s.snapshot_every > 0
                and self._step % s.snapshot_every == 0
                and (s.total_steps is None or self._step < s.total_steps)):
            if sharded is not None:
                with self.no_hang_check():  # a synchronous DCP save may take seconds
                    self._snapshot_sharded(sharded)
                return mean
            try:  # collective (every rank's RNG states go to rank 0): a peer may die in it
                with self.no_hang_check():
                    future = self._snapshots.commit(self._step, self._state())
            except Exception as exc:
                self._fail(exc)
            future.add_done_callback(partial(self._report_snapshot, self._step))
        return mean

    def no_hang_check(self) -> AbstractContextManager[None]:
        """Around a known long pause between two ``step_done`` calls (evaluation, a
        synchronous checkpoint of your own), entered on every rank: the agent's hang check
        (``--rdzv-conf hang_floor``, ``hang_factor``) does not count it. Without it, a pause
        longer than max(2 s, 10 steps) makes the agent judge the round hung."""
        return self._guard.no_hang_check()

    def finish(self, **fields: Any) -> None:
        """Training completed: a durable snapshot of the last step (collective), then tell
        the agent that the job is done (only this marks it finished). Logs ``done`` with
        ``fields``."""
        self._guard.begin_commit()
        if self._resumed_from != self._step:  # a restart of a finished run has nothing new
            self._commit_now()
        self._guard.done()
        self._emit("done", self._step, **fields)
        logger.info("done at step %d", self._step)
        self._close()

    # -- inside
    def _emit(self, event: str, step: int, **fields: Any) -> None:
        """Log ``event`` to the metrics file (rank 0) and pass it to ``on_event``."""
        self._events.emit(event, step, **fields)
        if self._on_event is not None:
            self._on_event(event, step, fields)

    def _track(self, **named: Stateful) -> None:
        self._objects.update(named)
        if self._sharded is not None:
            self._sharded.others.update(named)

    def _restored_age_s(self) -> float | None:
        restored = self._restored
        if restored is None or restored.created is None or restored.source != Source.DISK:
            return None
        return max(0.0, self._times["restored_at"] - restored.created)

    def _start_data(self, dataset_size: int, global_batch_size: int, *,
                    seed: int = 0) -> DataPosition:
        """Check a data order against the restored one and return where it continues.

        Raises:
            SnapshotError: the restored state was trained with another seed or dataset.
            ValueError: fewer samples per step than ranks.
        """
        saved = self._data_settings
        if saved and (saved.get("seed"), saved.get("dataset_size")) != (seed, dataset_size):
            raise SnapshotError(
                f"{self._restored.origin if self._restored else 'the restored state'} was "
                f"taken with seed {saved.get('seed')} and dataset size "
                f"{saved.get('dataset_size')}; this run has {seed} and {dataset_size}, so "
                "its data order would not continue")
        if saved.get("global_batch_size", global_batch_size) != global_batch_size:
            logger.warning("global batch size changed from %d to %d; the epoch continues at "
                           "sample %d", saved["global_batch_size"], global_batch_size,
                           self._position.offset if self._position else 0)
        if global_batch_size < self._world_size:
            raise ValueError(f"the global batch size {global_batch_size} is smaller than the "
                             f"world size {self._world_size}")
        self._data_settings = {"seed": seed, "dataset_size": dataset_size,
                               "global_batch_size": global_batch_size}
        if self._position is None:
            self._position = DataPosition()
            self._held = HeldStep(self._step, self._position, device=self._device)
        return self._position

    def _batch_started(self, global_ids: torch.Tensor, after: DataPosition) -> None:
        self._global_ids, self._next = global_ids, after

    def _begin_update(self) -> None:
        if self._open_update is not None:
            return
        stack = ExitStack()
        stack.enter_context(self.update())
        self._open_update = stack

    def _end_update(self) -> None:
        stack, self._open_update = self._open_update, None
        if stack is not None:
            stack.close()

    def _abandon_update(self, why: str) -> None:
        """An update ``_begin_update`` opened will not complete: it is never held, and its
        lock is let go. Only from the thread that opened it (the main one)."""
        stack = self._open_update
        if stack is not None and threading.current_thread() is threading.main_thread():
            self._open_update = None
            stack.__exit__(RuntimeError, RuntimeError(why), None)

    def _state(self, position: DataPosition | None = None) -> dict[str, Any]:
        """What a snapshot holds: the named objects, where the data stands, the run."""
        return {**self._objects, **self._rest(position)}

    def _rest(self, position: DataPosition | None = None) -> dict[str, Any]:
        """What a snapshot carries beside the named objects: where the data stands, and
        the run it was trained in."""
        at = position if position is not None else self._position
        rest: dict[str, Any] = {}
        if at is not None:
            rest["data"] = {**at.to_state(), **self._data_settings}
        if _run_id():
            rest[RUN_KEY] = _run_id()
        return rest

    def _keep_local(self) -> object | None:
        """Keep the completed step in node memory at a step boundary; None if not kept."""
        self._keep_rng(self._step)
        if self._sharded is not None:
            return self._sharded.keep(self._step, self._rest())
        return self._snapshots.keep_local(self._step, self._state())

    @staticmethod
    def _keep_rng(step: int) -> None:
        """This worker's RNG states beside the node's copy of ``step``, every worker's own
        (``snapshot.rng.keep_worker_rng``): the next worker in this slot continues them."""
        directory = control.local_state_dir()
        if directory is not None:
            keep_worker_rng(directory, step, _local_rank())

    def _fail(self, exc: BaseException) -> NoReturn:
        """A step raised ``exc``: a peer's fault under an etcd-ext agent keeps the held step
        and waits for the agent to stop this worker; anything else is raised again."""
        exit_now(self._guard.failure_exit_code(exc))

    def _exit_on_peer_fault(self, exc: BaseException) -> None:
        try:
            code = self._guard.failure_exit_code(exc)
        except BaseException:  # not a peer's fault: the framework's to handle
            return
        exit_now(code)

    def _close(self) -> None:
        """Flush what this worker wrote; the guard and the excepthook stand down. The
        process group is left alone: torch 2.13 can deadlock freeing a gloo group
        (pytorch issues 75097 and 56297), and the process exits next."""
        if self._closed:
            return
        self._closed = True
        self._snapshots.close()
        if self._sharded is not None:
            try:
                self._sharded.wait_for_save()
            except Exception as exc:  # reported by its callback already
                logger.debug("the last background snapshot failed: %s", exc)
        self._events.close()
        if sys.excepthook == self._excepthook:
            sys.excepthook = self._previous_hook
        self._guard.uninstall()

    def _excepthook(self, kind: type[BaseException], exc: BaseException,
                    tb: TracebackType | None) -> None:
        if not self._closed and isinstance(exc, Exception):
            self._exit_on_peer_fault(exc)  # else the usual traceback
        self._previous_hook(kind, exc, tb)

    def _keep_on_fault(self, why: str) -> None:
        """The guard's ``keep_state``: keep the held step before leaving mid-step."""
        # Left between begin_update and end_update: that update is not held, and its lock
        # (this thread's) must be let go before the keep takes it.
        self._abandon_update(why)
        sharded = self._sharded
        result: tuple[int, object | None] | None
        if sharded is not None:
            result = self._held.keep(
                lambda step, position: sharded.stage(step, self._rest(position)), sharded.write)
        else:
            result = self._held.keep(
                lambda step, position: self._snapshots.stage_kept(self._state(position)),
                self._snapshots.write_kept)
        step = result[0] if result is not None else (self._held.step or self._step)
        kept = result is not None and result[1] is not None
        if result is not None:
            self._keep_rng(step)
        if kept:
            logger.info("kept the state of step %d in node memory (%s)", step, why)
        self._emit("fault", step, why=why, kept=step if kept else None)

    def _commit_now(self) -> None:
        if self._settings.snapshot_dir is None:
            return
        if self._sharded is not None:
            try:
                seconds = self._sharded.save(self._step, self._rest())
            except Exception as exc:
                self._fail(exc)
            self._emit("snapshot", self._step, blocking_s=seconds, write_s=seconds, bytes=None)
            return
        try:
            info = self._snapshots.commit_now(self._step, self._state())
        except SnapshotError as exc:
            logger.error("%s", exc)
            exit_now(1)
        except Exception as exc:
            self._fail(exc)
        if info is not None:
            self._emit("snapshot", self._step, blocking_s=info.blocking_s,
                       write_s=info.write_s, bytes=info.size)

    def _snapshot_sharded(self, sharded: ShardedState) -> None:
        """A background DCP snapshot of this step (collective: a peer may die in it)."""
        started, step = time.perf_counter(), self._step
        try:
            future = sharded.save_in_background(step, self._rest())
        except Exception as exc:
            self._fail(exc)
        blocking = time.perf_counter() - started

        def report(done: Future[Any]) -> None:  # in DCP's writer thread
            if done.exception() is not None:
                logger.error("snapshot of step %d failed, training goes on: %s", step,
                             done.exception())
                return
            self._emit("snapshot", step, blocking_s=blocking,
                       write_s=time.perf_counter() - started, bytes=None)
        future.add_done_callback(report)

    def _report_snapshot(self, step: int, future: Future[SnapshotInfo | None]) -> None:
        """In the writer thread, once a background snapshot is durable (or failed)."""
        try:
            info = future.result()
        except Exception as exc:
            logger.error("snapshot of step %d failed, training goes on: %s", step, exc)
            return
        if info is not None:
            self._emit("snapshot", step, blocking_s=info.blocking_s, write_s=info.write_s,
                       bytes=info.size)

    def _stopped_for_restart(self) -> NoReturn:
        """Every signalled rank's agent restarts the round (a membership change): keep this
        step in node memory, where the next round's hand-off takes it from."""
        reason = control.leaving_reason() or "membership"
        logger.info("stopping at step %d: the etcd-ext agent restarts the round (%s)",
                    self._step, reason)
        kept = self._keep_local()
        self._emit("stopped", self._step, reason=reason,
                   kept=self._step if kept is not None else None)
        code = self._guard.preempted_exit_code()
        self._close()
        exit_now(code)

    def _preempted(self) -> NoReturn:
        """A real stop (SIGTERM, SIGINT, SIGUSR2, or the job's stop): keep the step in node
        memory, commit it durably, exit 0 once this worker's own signal came."""
        received = self._guard.signalled
        logger.warning("stopping at step %d: %s", self._step,
                       f"got {signal.Signals(received).name}" if received
                       else "a peer was signalled")
        self._keep_local()
        self._commit_now()
        code = self._guard.preempted_exit_code()
        # After the wait for this worker's own signal: its agent may tell it of the job's
        # stop a moment after a peer's agent did.
        received = self._guard.signalled
        self._emit("preempted", self._step,
                   signal=signal.Signals(received).name if received else None)
        self._close()
        exit_now(code)


class FrameworkHooks:
    """``ElasticLoop.framework``: for framework integrations (``elastic_ext.integrations``),
    the bundled trainer (``trainer/``) and ``StepSampler``, whose loops are not written by
    hand: a framework calls back before and after the update rather than around it,
    creates its optimizer after the restore, owns its data loader and its exception
    handling. A loop written by hand needs none of this.
    """

    def __init__(self, loop: ElasticLoop) -> None:
        self._loop = loop
        self._hang_check_paused = False

    # -- the update, in two calls
    def begin_update(self) -> None:
        """``ElasticLoop.update()`` for a framework that calls back before the update and
        after it (the optimizer's step, the scheduler's, its step count); ``end_update``
        closes it. A peer's fault in between keeps nothing of the half-applied update. A
        second call before ``end_update`` is part of the same update (an optimizer such as
        LBFGS calls a framework's closure, and its hook, several times in one step)."""
        self._loop._begin_update()

    def end_update(self) -> None:
        """The update ``begin_update`` opened is complete."""
        self._loop._end_update()

    def abandon_update(self, why: str) -> None:
        """An update ``begin_update`` opened will not complete (it raised): it is never
        held, and its lock is let go. Only from the thread that opened it (the main one)."""
        self._loop._abandon_update(why)

    @property
    def updating(self) -> bool:
        """An update ``begin_update`` opened is not complete yet: the step it belongs to
        reaches its boundary (a batch of an accumulation but its last has none)."""
        return self._loop._open_update is not None

    # -- what is saved, and what was restored
    def pause_hang_check(self, paused: bool) -> None:
        """Between a framework's steps (its evaluation, logging and checkpoints run there):
        paused from the step boundary to the next step's start, so that the agent's hang
        check times the steps only (``ElasticLoop.no_hang_check`` for own loops)."""
        beacon = self._loop._guard.beacon
        if beacon is None or paused == self._hang_check_paused:
            return
        self._hang_check_paused = paused
        if paused:
            beacon.pause()
        else:
            beacon.resume()

    def track(self, **named: Stateful) -> None:
        """Add to what the loop saves objects that exist only after ``restore`` (a
        framework creates its optimizer and scheduler when training starts); their
        restored state is in ``restored.state``, for the framework to load itself."""
        self._loop._track(**named)

    @property
    def restored(self) -> Restored | None:
        """What ``restore`` loaded (its step, source, and the entries the framework loads
        itself), or None for a fresh start."""
        return self._loop._restored

    @property
    def resumed_from(self) -> int | None:
        """The step ``restore`` continued from, or None for a fresh start."""
        return self._loop._resumed_from

    @property
    def restored_age_s(self) -> float | None:
        """How old the restored snapshot is, when it came from disk (else None)."""
        return self._loop._restored_age_s()

    @property
    def held_step(self) -> int | None:
        """The completed step the state holds now, which a keep would save; None while an
        update is being applied."""
        return self._loop._held.step

    # -- data for a framework that owns the data loader
    def batch_sampler(self, dataset_size: int, global_batch_size: int, *,
                      seed: int = 0) -> StepSampler:
        """``ElasticLoop.batches`` as a ``DataLoader``'s ``batch_sampler``, for a framework
        that owns the loop (one epoch per iteration); its hook at the start of each step's
        batch calls ``StepSampler.started``."""
        return StepSampler(self, dataset_size, global_batch_size, seed=seed,
                           rank=self._loop.rank, world_size=self._loop.world_size)

    def start_data(self, dataset_size: int, global_batch_size: int, *,
                   seed: int = 0) -> DataPosition:
        """Check a data order against the restored one and return where it continues (the
        sampler's start of each pass).

        Raises:
            SnapshotError: the restored state was trained with another seed or dataset.
            ValueError: fewer samples per step than ranks.
        """
        return self._loop._start_data(dataset_size, global_batch_size, seed=seed)

    def batch_started(self, global_ids: torch.Tensor, after: DataPosition) -> None:
        """The step now under way trains ``global_ids``; the data stands at ``after`` once
        it is done (the sampler tells it, as the framework fetches ahead)."""
        self._loop._batch_started(global_ids, after)

    @property
    def global_ids(self) -> torch.Tensor | None:
        """The step under way's sample ids, every rank's share (``batches`` or the
        sampler)."""
        return self._loop._global_ids

    @property
    def next_position(self) -> DataPosition | None:
        """Where the data stands once the step under way is done."""
        return self._loop._next

    # -- faults and the end
    def fail(self, exc: BaseException) -> NoReturn:
        """A step raised ``exc`` where the framework catches it: a peer's fault under an
        etcd-ext agent keeps the held step and waits for the agent to stop this worker;
        anything else is raised again."""
        self._loop._fail(exc)

    def exit_on_peer_fault(self, exc: BaseException) -> None:
        """For a framework's exception hook, before its own clean-up (which could wait on
        the broken group): a peer's fault keeps the held step and waits here for the agent
        to stop this worker; for anything else this returns."""
        self._loop._exit_on_peer_fault(exc)

    def close(self) -> None:
        """Flush what this worker wrote; the guard and the excepthook stand down (``finish``
        does it too). The process group is left alone: the process exits next."""
        self._loop._close()

    @property
    def closed(self) -> bool:
        """``finish`` or ``close`` ran: this worker's part is over."""
        return self._loop._closed


__all__ = ["ElasticLoop", "EventHook", "FrameworkHooks", "LoopSettings"]
