"""A Lightning ``Trainer`` that loses at most the step in flight when a node dies.

``ElasticCallback`` runs an :class:`~elastic_ext.worker.loop.ElasticLoop` under the Trainer:
the held-step bookkeeping from ``on_before_optimizer_step`` to ``on_train_batch_end``
(Lightning steps the optimizer and its step-interval schedulers in between), the
step-boundary agreement in ``on_train_batch_end``, keep-on-fault from ``on_exception``,
a durable snapshot every K steps and on a stop. A new round's state comes from the
peers (or the newest snapshot) through Lightning's own resume path: ``resume_from``
writes the restored step as a checkpoint in node memory for ``fit(ckpt_path=...)``.
The sizes come from torchrun, so rounds of another world size work; the data order is
the loop's exactly-once order (``batch_sampler``)::

    elastic = ElasticCallback(LoopSettings(snapshot_dir="snapshots", snapshot_every=50))
    trainer = L.Trainer(accelerator="auto", strategy="ddp", devices=elastic.devices,
                        num_nodes=elastic.num_nodes, use_distributed_sampler=False,
                        max_steps=1000, callbacks=[elastic])
    loader = DataLoader(data, batch_sampler=elastic.batch_sampler(len(data), 32))
    trainer.fit(model, loader, ckpt_path=elastic.resume_from(model))

It moves itself last among the Trainer's callbacks (``setup``): the hooks after the
boundary do not run for a step the job stops at; the module's own
``on_train_batch_end``, which Lightning calls after every callback's, must not change
what is kept. Gradient accumulation keeps whole optimizer steps (the batches of an
accumulation a fault cut short are trained again, once); manual optimization is kept
through the same bracket as ``ElasticLoop.update``, one optimizer step per batch. Not
covered: a ``training_step`` that takes ``dataloader_iter``, or a batch skipped by
returning None or -1; plateau schedulers (they step after the boundary, so a keep there
may hold them either side of their step); FSDP1, DeepSpeed and ZeroRedundancyOptimizer
(refused at the start); callbacks that swap the weights when checkpointing (weight
averaging); hyperparameters are not kept (``fit`` does not read them) and what
``on_save_checkpoint`` adds must be plain data (tensors, numbers, strings, containers).

A module that builds or shards its layers in ``configure_model`` (FSDP2 under
``ModelParallelStrategy``) exists whole only inside ``fit``: ``resume_from`` returns None
for it and the restore happens at ``on_fit_start``, into the built model and its
optimizers (the loop's sharded state: shards and their copies in node memory, resharded
at the new world size; DCP snapshots on disk), with the Trainer's counters and schedulers.

Lightning's SIGTERM handler broadcasts from inside the signal handler, a collective on
one rank at a random point of the step, and its teardown puts back the handlers it
found; the callback keeps Lightning from installing any (``setup``), so a notice stops
the job at the step boundary as for any ``ElasticLoop``.
"""

from __future__ import annotations

import copy
import logging
import os
import shutil
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from elastic_ext.integrations.resume import new_resume_dir, restore_for_framework
from elastic_ext.worker.loop import ElasticLoop, LoopSettings
from elastic_ext.worker.loop.sampler import StepSampler

logger = logging.getLogger(__name__)

CHECKPOINT_FILE = "elastic-ext-resume.ckpt"
_KEPT = ("lightning",)
# The checkpoint's keys for hyperparameters (LightningModule.CHECKPOINT_HYPER_PARAMS_*):
# arbitrary objects, and fit(ckpt_path=...) does not read them.
_NOT_KEPT = ("state_dict", "hparams_name", "hyper_parameters", "hparams_type",
             "datamodule_hparams_name", "datamodule_hyper_parameters", "datamodule_hparams_type")


def dump_checkpoint(trainer: pl.Trainer) -> dict[str, Any]:
    """Lightning's checkpoint of ``trainer`` as a dict, made on this rank alone (no
    barrier, unlike ``Trainer.save_checkpoint``): the first of the two Lightning internals
    used here, ``trainer._checkpoint_connector.dump_checkpoint`` (lightning 2.6)."""
    connector = getattr(trainer, "_checkpoint_connector", None)
    dump = getattr(connector, "dump_checkpoint", None)
    if dump is None:
        raise RuntimeError(f"lightning {pl.__version__} has no Trainer._checkpoint_connector."
                           "dump_checkpoint; elastic-ext's Lightning callback needs lightning "
                           "2.6 (pip install 'elastic-ext[lightning]')")
    checkpoint: dict[str, Any] = dump(weights_only=False)
    return checkpoint


def keep_signal_handlers(trainer: pl.Trainer) -> None:
    """Lightning installs no signal handlers for ``trainer``'s run: the second Lightning
    internal used here, ``trainer._signal_connector.register_signal_handlers``."""
    connector = getattr(trainer, "_signal_connector", None)
    if connector is None or not hasattr(connector, "register_signal_handlers"):
        raise RuntimeError(f"lightning {pl.__version__} has no Trainer._signal_connector."
                           "register_signal_handlers; elastic-ext's Lightning callback needs "
                           "lightning 2.6 (pip install 'elastic-ext[lightning]')")
    connector.register_signal_handlers = lambda: None


SHARDED_HINT = ("the callback keeps and hands off replicated (DDP) state and FSDP2 shards "
                "(strategy=ModelParallelStrategy(...), fully_shard in configure_model), not "
                "FSDP1's flat parameters or DeepSpeed's partitions: use one of those, or a loop "
                "of your own on elastic_ext.ElasticLoop with loop.mesh() "
                "(docs/snapshot-hook.md#sharded-state-fsdp2-hsdp)")


def builds_in_fit(model: pl.LightningModule) -> bool:
    """Whether ``model`` builds or shards its layers in ``configure_model`` (as
    ``ModelParallelStrategy`` asks): what a restore loads into exists only once ``fit``
    called it, so the callback restores at ``on_fit_start`` instead of through ``ckpt_path``."""
    return type(model).configure_model is not pl.LightningModule.configure_model


def refuse_sharding(trainer: pl.Trainer, *, built_in_fit: bool = True) -> None:
    """Raise before training when ``trainer`` shards the model or the optimizer in a way
    the callback cannot keep (FSDP1, DeepSpeed, ``ZeroRedundancyOptimizer``; model
    parallelism whose module has no ``configure_model``): it would keep a shard as if it
    were the whole state."""
    from lightning.pytorch.strategies import (
        DeepSpeedStrategy,
        FSDPStrategy,
        ModelParallelStrategy,
    )
    from torch.distributed.optim import ZeroRedundancyOptimizer

    strategy = trainer.strategy
    if isinstance(strategy, (FSDPStrategy, DeepSpeedStrategy)):
        raise RuntimeError(f"ElasticCallback: strategy {type(strategy).__name__} shards the "
                           f"model; {SHARDED_HINT}")
    if isinstance(strategy, ModelParallelStrategy) and not built_in_fit:
        raise RuntimeError("ElasticCallback: ModelParallelStrategy shards the model in the "
                           "LightningModule's configure_model, and this module has none: "
                           "call fully_shard on its layers there (self.device_mesh)")
    zero = [type(o).__name__ for o in getattr(strategy, "optimizers", ())
            if isinstance(o, ZeroRedundancyOptimizer)]
    if zero:
        raise RuntimeError(f"ElasticCallback: {zero[0]} shards the optimizer's state; "
                           f"{SHARDED_HINT}")


def loops_state(trainer: pl.Trainer) -> dict[str, Any]:
    """The loops' progress counters, as in the checkpoint's ``loops`` (a copy)."""
    return copy.deepcopy({"fit_loop": trainer.fit_loop.state_dict(),
                          "validate_loop": trainer.validate_loop.state_dict(),
                          "test_loop": trainer.test_loop.state_dict()})


def progress_of(trainer: pl.Trainer) -> dict[str, Any]:
    """The Trainer's progress without its model and optimizers, taken on this rank alone
    (no collective: a sharded optimizer's state would need one): the loops' counters and
    the schedulers'."""
    return {"epoch": trainer.current_epoch, "global_step": trainer.global_step,
            "loops": loops_state(trainer),
            "lr_schedulers": [c.scheduler.state_dict() for c in trainer.lr_scheduler_configs]}


def load_progress(trainer: pl.Trainer, progress: Mapping[str, Any]) -> None:
    """Put back ``progress_of``'s counters before the fit loop starts (``on_fit_start``:
    the loop's reset, which comes later, reads them as a restart)."""
    trainer.fit_loop.load_state_dict(progress["loops"]["fit_loop"])
    schedulers = progress.get("lr_schedulers", [])
    if len(schedulers) != len(trainer.lr_scheduler_configs):
        raise RuntimeError(f"the restored step has {len(schedulers)} learning-rate "
                           f"scheduler(s), configure_optimizers made "
                           f"{len(trainer.lr_scheduler_configs)}: the same configure_optimizers "
                           "must run in every round")
    for config, state in zip(trainer.lr_scheduler_configs, schedulers, strict=True):
        config.scheduler.load_state_dict(state)


class _LightningState:
    """The Trainer's checkpoint less the weights (kept as ``model``) as a snapshot entry.

    Taken when it is kept, except the loops' counters: a fault mid-step finds them
    already counting the step in flight, so they come from the boundary of the step
    kept, where Lightning's own ``on_train_batch_end`` checkpoints take them.
    """

    def __init__(self, loop: ElasticLoop) -> None:
        self.loop = loop
        self.trainer: pl.Trainer | None = None
        self.progress_only = False
        """The model and optimizers are kept as the loop's own objects (a model built in
        ``fit``, sharded or not): keep the Trainer's progress alone (``progress_of``)."""
        self._boundaries: dict[int, dict[str, Any]] = {}

    def at_boundary(self, step: int, trainer: pl.Trainer) -> None:
        """Step ``step`` is done (its update applied): remember the loops' counters."""
        self._boundaries = {s: v for s, v in self._boundaries.items() if s == step - 1}
        self._boundaries[step] = loops_state(trainer)

    def state_dict(self) -> dict[str, Any]:
        assert self.trainer is not None, "tracked from on_train_start on"
        checkpoint = progress_of(self.trainer) if self.progress_only \
            else dump_checkpoint(self.trainer)
        for key in _NOT_KEPT:
            checkpoint.pop(key, None)
        step = self.loop.framework.held_step
        if step is None:  # no keep during an update; a glance for the commit paths
            step = self.loop.step
        boundary = self._boundaries.get(step)
        if boundary is not None:
            checkpoint["loops"] = boundary
        checkpoint["global_step"] = step
        return checkpoint

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Loaded by Lightning from the checkpoint ``resume_from`` writes instead."""


class ElasticCallback(pl.Callback):
    """The elastic-ext protocol for a Lightning ``Trainer`` run under torchrun.

    Create it before the ``Trainer``: it installs the preemption guard and creates the
    process group (gloo on CPU, NCCL with its error handling on GPUs), which Lightning's
    DDP strategy then uses. Give the Trainer ``devices=callback.devices``,
    ``num_nodes=callback.num_nodes`` and ``use_distributed_sampler=False``, the
    ``DataLoader`` ``batch_sampler=callback.batch_sampler(...)``, and resume with
    ``fit(..., ckpt_path=callback.resume_from(model))``.
    """

    def __init__(self, settings: LoopSettings | None = None, *,
                 loop: ElasticLoop | None = None) -> None:
        self.loop = loop if loop is not None else ElasticLoop(settings)
        self._state = _LightningState(self.loop)
        self._sampler: StepSampler | None = None
        self._resume_dir: Path | None = None
        self._restored = False
        self._in_fit = False  # restore at on_fit_start (a model built in configure_model)

    # -- what the Trainer is given
    @property
    def devices(self) -> int:
        """Workers on this node: torchrun's ``--nproc-per-node`` (``LOCAL_WORLD_SIZE``)."""
        return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))

    @property
    def num_nodes(self) -> int:
        """Nodes in this round, from its world size: a fixed ``num_nodes`` fails every
        round after the world size changed.

        Raises:
            ValueError: the world size is not a multiple of this node's workers.
        """
        world, local = self.loop.world_size, self.devices
        if world % local:
            raise ValueError(f"a world of {world} is not whole nodes of {local} worker(s): "
                             "give every node the same --nproc-per-node")
        return world // local

    def batch_sampler(self, dataset_size: int, global_batch_size: int, *,
                      seed: int = 0) -> StepSampler:
        """The ``DataLoader``'s ``batch_sampler``: every sample of an epoch exactly once
        across the ranks, whatever the world size and however many rounds
        (``ElasticLoop.batches``); the Trainer needs ``use_distributed_sampler=False``."""
        self._sampler = self.loop.framework.batch_sampler(dataset_size, global_batch_size,
                                                          seed=seed)
        # The DataLoader is not Stateful to Lightning, the sampler is: a mid-epoch resume
        # continues the epoch, which Lightning's warning says it may not.
        warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended "
                                "before the epoch ended")
        return self._sampler

    def resume_from(self, model: pl.LightningModule) -> str | None:
        """Load the newest step any rank holds (collective, on every rank) and write it as
        a checkpoint for ``trainer.fit(..., ckpt_path=...)``; None for a fresh start.

        A module with a ``configure_model`` (FSDP2 under ``ModelParallelStrategy``) is
        built in ``fit``: this returns None, and the callback restores into the built
        model and its optimizers at ``on_fit_start``, a sharded one from the peers' shards
        at the new world size.

        Raises:
            SnapshotMismatchError: the newest state is of another model, or was not
                taken by this callback.
        """
        if builds_in_fit(model):
            self._in_fit = self._state.progress_only = True
            return None
        restored = restore_for_framework(self.loop, model, _KEPT,
                                         "elastic_ext.integrations.lightning.ElasticCallback")
        self._restored = True
        if restored is None:
            return None
        checkpoint = {**restored.state["lightning"], "state_dict": model.state_dict()}
        directory = new_resume_dir()
        torch.save(checkpoint, directory / CHECKPOINT_FILE)
        self._resume_dir = directory
        logger.info("resuming the Trainer at step %d from %s", restored.step, restored.origin)
        return str(directory / CHECKPOINT_FILE)

    # -- the Trainer's events, on every rank
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Before Lightning installs its signal handlers: it installs none. Its SIGTERM
        handler broadcasts from inside the handler (a collective on one rank at a random
        point of the step) and its teardown would put back the guard's after ``finish``;
        the guard stops the job at the step boundary instead. A sharded strategy is
        refused here, before any step."""
        refuse_sharding(trainer, built_in_fit=self._in_fit)
        keep_signal_handlers(trainer)
        # Last in the list: later callbacks' on_train_batch_end would not run for a step the
        # job stops at. A new list, so the loop now calling ``setup`` goes on unchanged (an
        # attribute Lightning's callback connector sets on the instance).
        attributes = vars(trainer)
        attributes["callbacks"] = [c for c in attributes["callbacks"] if c is not self] + [self]

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """For a model built in ``fit``: the model is built (sharded, its parameters
        DTensors) and its optimizers made, empty; restore into them here (collective),
        then the Trainer's progress, which its fit loop reads as a restart."""
        if not self._in_fit:
            return
        refuse_sharding(trainer, built_in_fit=True)  # the optimizers exist from here on
        optimizers = {f"optimizer_{i}": o for i, o in enumerate(trainer.optimizers)}
        restored = restore_for_framework(self.loop, pl_module, _KEPT,
                                         "elastic_ext.integrations.lightning.ElasticCallback",
                                         **optimizers)
        self._restored = True
        if restored is not None:
            load_progress(trainer, restored.state["lightning"])
            logger.info("resuming the Trainer at step %d from %s", restored.step,
                        restored.origin)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.world_size != self.loop.world_size:
            raise RuntimeError(
                f"the Trainer runs {trainer.world_size} rank(s) of the {self.loop.world_size} "
                "torchrun started: give it strategy='ddp', devices=callback.devices and "
                "num_nodes=callback.num_nodes")
        if not self._restored:
            raise RuntimeError("ElasticCallback: call trainer.fit(..., ckpt_path=callback."
                               "resume_from(model)) so that a new round starts from the step "
                               "the others hold")
        if self._sampler is None:
            logger.warning("the DataLoader has no ElasticCallback.batch_sampler: each new "
                           "round starts its epoch's data over")
        self._remove_resume_dir()  # Lightning loaded it before this event
        if trainer.global_step != self.loop.step:
            raise RuntimeError(
                f"the Trainer starts at step {trainer.global_step} but elastic-ext restored "
                f"step {self.loop.step}: resume only from ElasticCallback.resume_from(model)")
        refuse_sharding(trainer, built_in_fit=self._in_fit)  # the optimizers exist now
        self._state.trainer = trainer
        self._state.at_boundary(self.loop.step, trainer)
        self.loop.framework.track(lightning=self._state)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                             batch: Any, batch_idx: int) -> None:
        self.loop.framework.pause_hang_check(False)  # the agent times the step from here
        if self._sampler is not None:
            self._sampler.started()

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        """Lightning calls it before each optimizer step, of automatic optimization (the
        last batch of an accumulation) and of manual (``optimizer.step()`` in
        ``training_step``) alike: the update begins."""
        self.loop.framework.begin_update()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        """After the optimizer's and the step-interval schedulers' step: the update is
        complete, then the step boundary (which may keep or commit and exit). A batch
        that stepped no optimizer (one of an accumulation but its last) is no boundary:
        a fault before the accumulation's end keeps the last whole optimizer step, and
        the data position of that step, so its batches are trained again, once."""
        if not self.loop.framework.updating:
            self.loop.framework.pause_hang_check(True)
            return
        self._state.at_boundary(self.loop.step + 1, trainer)
        self.loop.framework.end_update()
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        self.loop.step_done(loss if isinstance(loss, torch.Tensor) else None)
        if trainer.global_step != self.loop.step:
            raise RuntimeError(
                f"the Trainer counts {trainer.global_step} optimizer steps where elastic-ext "
                f"counts {self.loop.step} batches that stepped: ElasticCallback keeps one "
                "optimizer step per batch (manual optimization with several optimizers: "
                "write the loop with elastic_ext.ElasticLoop)")
        # Validation, logging and checkpoints run between batches: not a hang.
        self.loop.framework.pause_hang_check(True)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.loop.finish()

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Also when Lightning found nothing left to train (a round restored the last
        step, say after a peer died in ``finish``): then the job is done all the same."""
        self._remove_resume_dir()
        if not self.loop.framework.closed:
            self.loop.finish()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                     exception: BaseException) -> None:
        """Before Lightning's teardown, which would wait on the broken group: a peer's
        fault keeps the held step and waits for the agent here; anything else goes on
        to Lightning (an update it cut short is not held)."""
        self.loop.framework.exit_on_peer_fault(exception)
        self.loop.framework.abandon_update(f"the step raised {type(exception).__name__}")

    def _remove_resume_dir(self) -> None:
        if self._resume_dir is not None:
            shutil.rmtree(self._resume_dir, ignore_errors=True)
            self._resume_dir = None


__all__ = ["ElasticCallback", "LoopSettings", "builds_in_fit", "dump_checkpoint",
           "keep_signal_handlers", "load_progress", "loops_state", "progress_of",
           "refuse_sharding"]
