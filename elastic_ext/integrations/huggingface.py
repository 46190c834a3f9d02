"""A Hugging Face ``Trainer`` that loses at most the step in flight when a node dies.

``ElasticCallback`` runs an :class:`~elastic_ext.worker.loop.ElasticLoop` under the Trainer:
the step-boundary agreement in ``on_step_end``, the held-step bookkeeping around the
optimizer's and scheduler's step, keep-on-fault, a durable snapshot every K steps and
on a stop. A new round's state comes from the peers (or the newest snapshot) through
the Trainer's own resume path: ``resume_from`` writes the restored step as a
checkpoint directory in node memory, and ``Trainer.train(resume_from_checkpoint=...)``
loads it (model, optimizer, scheduler, ``TrainerState``) and skips the batches it
trained, as for any checkpoint::

    elastic = ElasticCallback(LoopSettings(snapshot_dir="snapshots", snapshot_every=50))
    args = TrainingArguments(...)                 # after the callback: it made the group
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[elastic])
    trainer.train(resume_from_checkpoint=elastic.resume_from(trainer))

Not covered: the data order after a change of world size is the Trainer's (it skips
``global_step`` batches of the new sharding, so an epoch's samples are not exactly once
across sizes); gradient accumulation keeps whole optimizer steps (a fault inside an
accumulation trains its batches again); DeepSpeed and FSDP models are sharded and are
refused at the start (DDP only); RNG states travel only in durable snapshots.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_callback import ExportableState

from elastic_ext.integrations.resume import new_resume_dir, restore_for_framework
from elastic_ext.worker.loop import ElasticLoop, LoopSettings

logger = logging.getLogger(__name__)

# The names of the Trainer's checkpoint files (transformers.trainer's constants).
WEIGHTS_FILE = "pytorch_model.bin"
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
TRAINER_STATE_FILE = "trainer_state.json"
_KEPT = ("optimizer", "scheduler", "trainer_state")
_PER_RANK_FIELDS = ("is_local_process_zero", "is_world_process_zero")


class _TrainerStateEntry:
    """The Trainer's ``TrainerState`` (step count, logs, callbacks' state) as a snapshot
    entry: the JSON of ``trainer_state.json``, the same bytes on every rank."""

    def __init__(self) -> None:
        self.state: TrainerState | None = None
        self.trainer: Any = None

    def state_dict(self) -> dict[str, str]:
        if self.state is None:
            return {"json": "{}"}
        fields = dataclasses.asdict(self.state)
        for per_rank in _PER_RANK_FIELDS:  # the Trainer sets them again when it loads it
            fields.pop(per_rank, None)
        if self.trainer is not None:
            # The Trainer brings them up to date in its checkpoints only on the rank that
            # saves; as of now, on every rank, as its _save_checkpoint does.
            fields["stateful_callbacks"] = _callback_states(self.trainer)
        return {"json": json.dumps(fields, indent=2, sort_keys=True)}

    def load_state_dict(self, state_dict: dict[str, str]) -> None:
        """Loaded by the Trainer from ``trainer_state.json`` instead (``resume_from``)."""


def _callback_states(trainer: Any) -> dict[str, Any]:
    """``TrainerState.stateful_callbacks`` as the Trainer's ``_save_checkpoint`` writes it:
    each ``ExportableState`` callback's and the ``TrainerControl``'s ``state()`` by class
    name, a list for a class with several."""
    states: dict[str, Any] = {}
    for callback in [*trainer.callback_handler.callbacks, trainer.control]:
        if not isinstance(callback, ExportableState):
            continue
        name, state = type(callback).__name__, callback.state()
        if name not in states:
            states[name] = state
        else:
            before = states[name]
            states[name] = [*(before if isinstance(before, list) else [before]), state]
    return states


def refuse_sharding(args: TrainingArguments) -> None:
    """Raise before training when the Trainer shards the model (``fsdp``, ``deepspeed``):
    the callback would keep a shard as if it were the whole state."""
    for name in ("fsdp", "deepspeed"):
        if getattr(args, name, None):
            raise RuntimeError(
                f"ElasticCallback: TrainingArguments({name}=...) shards the model; the "
                "callback keeps and hands off replicated (DDP) state only, not a sharded "
                "model's yet: train without it, or write the loop on elastic_ext.ElasticLoop "
                "with loop.mesh() for FSDP2 and HSDP "
                "(docs/snapshot-hook.md#sharded-state-fsdp2-hsdp)")


class ElasticCallback(TrainerCallback):
    """The elastic-ext protocol for a Hugging Face ``Trainer`` run under torchrun.

    Create it before ``TrainingArguments``: it installs the preemption guard and
    creates the process group (gloo on CPU, NCCL with its error handling on GPUs),
    which the Trainer's ``Accelerator`` then uses. Pass it in ``callbacks`` and resume
    with ``resume_from``.
    """

    def __init__(self, settings: LoopSettings | None = None, *,
                 loop: ElasticLoop | None = None) -> None:
        self.loop = loop if loop is not None else ElasticLoop(settings)
        self._trainer_state = _TrainerStateEntry()
        self._resume_dir: Path | None = None
        self._restored = False

    def resume_from(self, trainer: Any) -> str | None:
        """Load the newest step any rank holds (collective, on every rank) and write it as
        a checkpoint directory for ``trainer.train(resume_from_checkpoint=...)``; None for
        a fresh start.

        Raises:
            SnapshotMismatchError: the newest state is of another model, or was not
                taken by this callback (it has no optimizer, scheduler or Trainer state).
        """
        model = trainer.model
        self._trainer_state.trainer = trainer
        # Last in the list: later callbacks' on_step_end would not run for a step the job
        # stops at (the boundary may exit there).
        handler = trainer.callback_handler
        handler.callbacks = [c for c in handler.callbacks if c is not self] + [self]
        restored = restore_for_framework(self.loop, model, _KEPT,
                                         "elastic_ext.integrations.huggingface.ElasticCallback")
        self._restored = True
        if restored is None:
            return None
        directory = new_resume_dir()
        torch.save(model.state_dict(), directory / WEIGHTS_FILE)
        torch.save(restored.state["optimizer"], directory / OPTIMIZER_FILE)
        torch.save(restored.state["scheduler"], directory / SCHEDULER_FILE)
        (directory / TRAINER_STATE_FILE).write_text(restored.state["trainer_state"]["json"])
        self._resume_dir = directory
        logger.info("resuming the Trainer at step %d from %s", restored.step, restored.origin)
        return str(directory)

    # -- the Trainer's events, on every rank
    def on_train_begin(self, args: TrainingArguments, state: TrainerState,
                       control: TrainerControl, **kwargs: Any) -> None:
        refuse_sharding(args)
        if args.world_size != self.loop.world_size:
            raise RuntimeError(
                f"the Trainer runs {args.world_size} rank(s) of the {self.loop.world_size} "
                "torchrun started, so it would train alone; on CPUs give "
                "TrainingArguments(use_cpu=True), which makes it use the process group")
        if not self._restored:
            raise RuntimeError("ElasticCallback: call trainer.train(resume_from_checkpoint="
                               "callback.resume_from(trainer)) so that a new round starts "
                               "from the step the others hold")
        if self._resume_dir is not None:  # the Trainer loaded it before this event
            shutil.rmtree(self._resume_dir, ignore_errors=True)
            self._resume_dir = None
        self._trainer_state.state = state
        self.loop.framework.track(optimizer=kwargs["optimizer"], scheduler=kwargs["lr_scheduler"],
                        trainer_state=self._trainer_state)
        if state.global_step != self.loop.step:
            raise RuntimeError(
                f"the Trainer starts at step {state.global_step} but elastic-ext restored "
                f"step {self.loop.step}: resume only from ElasticCallback.resume_from(trainer)")

    def on_step_begin(self, args: TrainingArguments, state: TrainerState,
                      control: TrainerControl, **kwargs: Any) -> None:
        self.loop.framework.pause_hang_check(False)  # the agent times the step from here

    def on_pre_optimizer_step(self, args: TrainingArguments, state: TrainerState,
                              control: TrainerControl, **kwargs: Any) -> None:
        self.loop.framework.begin_update()

    def on_step_end(self, args: TrainingArguments, state: TrainerState,
                    control: TrainerControl, **kwargs: Any) -> None:
        """After the optimizer's and the scheduler's step and the step count: the update is
        complete, then the step boundary (which may keep or commit and exit)."""
        self._trainer_state.state = state
        self.loop.framework.end_update()
        self.loop.step_done()
        # The Trainer's logging, evaluation and checkpoints run between steps: not a hang.
        self.loop.framework.pause_hang_check(True)

    def on_train_end(self, args: TrainingArguments, state: TrainerState,
                     control: TrainerControl, **kwargs: Any) -> None:
        self.loop.finish()


__all__ = ["ElasticCallback", "LoopSettings", "refuse_sharding"]
