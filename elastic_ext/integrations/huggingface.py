"""A Hugging Face ``Trainer`` that loses at most the step in flight when a node dies.

``ElasticCallback`` runs an :class:`~elastic_ext.worker.loop.ElasticLoop` under the Trainer:
the step-boundary agreement in ``on_step_end``, the held-step bookkeeping around the
optimizer's and scheduler's step, keep-on-fault, a durable snapshot every K steps and
on a stop. A new round's state comes from the peers (or the newest snapshot) through
the Trainer's own resume path: ``resume_from`` writes the restored step as a
checkpoint directory in node memory, and ``Trainer.train(resume_from_checkpoint=...)``
loads it (model, optimizer, scheduler, ``TrainerState``), as for any checkpoint::

    elastic = ElasticCallback(LoopSettings(snapshot_dir="snapshots", snapshot_every=50))
    args = TrainingArguments(...)                 # after the callback: it made the group
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[elastic])
    trainer.train(resume_from_checkpoint=elastic.resume_from(trainer))

The data order is the loop's exactly-once order (``use_the_loops_order``: every sample
of an epoch once across the ranks, at any world size and after any restore) for a
dataset with a length and the default ``train_sampling_strategy``; otherwise the
Trainer's, which skips ``global_step`` batches of the new sharding on resume. Gradient
accumulation keeps whole optimizer steps (a fault inside an accumulation trains its
batches again, once). Under accelerate's FSDP2 (``fsdp_config={"version": 2}``) the model
is sharded only when training begins: ``resume_from`` returns None and the restore happens
at ``on_train_begin``, into the sharded model, its optimizer and scheduler (the loop's
sharded state: shards and their copies in node memory, resharded at the new world size;
DCP snapshots on disk), then the ``TrainerState``'s progress. Not covered: DeepSpeed and
FSDP1 shard in ways the callback does not keep, and are refused at the start.
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
from elastic_ext.worker.loop.sampler import StepSampler

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


_PROGRESS_FIELDS = ("global_step", "epoch", "log_history", "total_flos",
                   "num_input_tokens_seen", "best_metric", "best_global_step",
                   "best_model_checkpoint")


def load_progress(trainer: Any, state: TrainerState, saved: dict[str, Any]) -> None:
    """Put a kept ``TrainerState``'s progress into the live ``state`` at ``on_train_begin``
    (a restore the Trainer did not do itself), and the two counters the Trainer took from
    it just before: ``_initial_global_step`` and ``_globalstep_last_logged`` (its loss
    average and throughput count from them)."""
    for name in _PROGRESS_FIELDS:
        if name in saved:
            setattr(state, name, saved[name])
    for counter in ("_initial_global_step", "_globalstep_last_logged"):
        setattr(trainer, counter, state.global_step)


def batches_of_this_step(trainer: Any) -> int:
    """How many batches the Trainer fetched for the optimizer step it begins:
    ``Trainer.current_gradient_accumulation_steps`` (transformers 5), the first of the two
    internals used here; 1 when it is not there (no accumulation)."""
    return max(1, int(getattr(trainer, "current_gradient_accumulation_steps", 1) or 1))


def use_the_loops_order(trainer: Any, loop: ElasticLoop) -> StepSampler | None:
    """Give ``trainer`` the loop's exactly-once data order: a ``DataLoader`` on this rank's
    share of each global batch (``ElasticLoop.framework.batch_sampler``: every sample of an
    epoch once across the ranks, at any world size and after any restore), not sharded
    again by accelerate, and no skip on resume (it starts where the restored step left
    the data). The global batch is ``per_device_train_batch_size`` x the world size. None,
    and the Trainer's own order, for a dataset without a length or a sampling strategy
    other than ``random`` (logged). The second internal used: the Trainer's
    ``_remove_unused_columns`` / ``_get_collator_with_removed_columns``, as its own
    ``_get_dataloader`` (transformers 5)."""
    dataset, args = trainer.train_dataset, trainer.args
    strategy = getattr(args, "train_sampling_strategy", "random")
    if dataset is None or isinstance(dataset, torch.utils.data.IterableDataset) \
            or not hasattr(dataset, "__len__") or strategy != "random":
        logger.warning("the data order stays the Trainer's (a dataset without a length, or "
                       "train_sampling_strategy=%r): samples are not exactly once across "
                       "world sizes", strategy)
        return None
    seed = args.data_seed if args.data_seed is not None else args.seed
    sampler = loop.framework.batch_sampler(
        len(dataset), args.per_device_train_batch_size * loop.world_size, seed=seed)
    remove = getattr(trainer, "_remove_unused_columns", None)
    with_removed = getattr(trainer, "_get_collator_with_removed_columns", None)
    if remove is None or with_removed is None:
        raise RuntimeError("transformers has no Trainer._remove_unused_columns or "
                           "_get_collator_with_removed_columns; elastic-ext's callback needs "
                           "transformers 5 (pip install 'elastic-ext[transformers]')")

    def train_dataloader() -> torch.utils.data.DataLoader[Any]:
        data, collate = dataset, trainer.data_collator
        if type(data).__module__.startswith("datasets."):
            data = remove(data, description="Training")
        else:
            collate = with_removed(collate, description="Training")
        return torch.utils.data.DataLoader(
            data, batch_sampler=sampler, collate_fn=collate,
            num_workers=args.dataloader_num_workers, pin_memory=args.dataloader_pin_memory)

    trainer.get_train_dataloader = train_dataloader
    trainer.get_resumed_dataloader = lambda dataloader, num_batches: dataloader
    return sampler


def fsdp_version(trainer: Any) -> int | None:
    """The FSDP version the Trainer's accelerator shards the model with; None without FSDP
    (accelerate keeps its FSDP plugin only on accelerators: on CPUs it trains with DDP)."""
    if not getattr(trainer, "is_fsdp_enabled", False):
        return None
    plugin = getattr(trainer.accelerator.state, "fsdp_plugin", None)
    return int(getattr(plugin, "fsdp_version", 1) or 1)


def refuse_sharding(args: TrainingArguments, trainer: Any = None) -> None:
    """Raise before training when the Trainer shards the model in a way the callback cannot
    keep (``deepspeed``, FSDP1's flat parameters): it would keep a shard as if it were the
    whole state. FSDP2 (``fsdp_config={"version": 2}``) is kept, when the accelerator
    really shards (``fsdp_version``)."""
    if trainer is not None and fsdp_version(trainer) == 2:
        if args.deepspeed:
            raise RuntimeError("ElasticCallback: TrainingArguments(deepspeed=...) beside FSDP2: "
                               "give one of them")
        return
    if trainer is not None and args.fsdp and not getattr(trainer, "is_fsdp_enabled", False):
        raise RuntimeError("ElasticCallback: TrainingArguments(fsdp=...), but accelerate does "
                           "not shard on this machine (it keeps its FSDP plugin only on "
                           "accelerators, and would train with DDP): drop fsdp= here, or run "
                           "on GPUs")
    for name in ("fsdp", "deepspeed"):
        if getattr(args, name, None):
            raise RuntimeError(
                f"ElasticCallback: TrainingArguments({name}=...) shards the model in a way "
                "the callback does not keep: it keeps replicated (DDP) state and FSDP2's "
                "(fsdp_config={'version': 2}), not FSDP1's flat parameters or DeepSpeed's "
                "partitions; or write the loop on elastic_ext.ElasticLoop with loop.mesh() "
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
        self._in_train = False  # restore at on_train_begin (a model accelerate shards)
        self._sampler: StepSampler | None = None

    def resume_from(self, trainer: Any) -> str | None:
        """Load the newest step any rank holds (collective, on every rank) and write it as
        a checkpoint directory for ``trainer.train(resume_from_checkpoint=...)``; None for
        a fresh start.

        Under FSDP2 the model is sharded only once training begins (accelerate's
        ``prepare``): this returns None, and the callback restores into the sharded model,
        its optimizer and scheduler at ``on_train_begin``, from the peers' shards at the
        new world size.

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
        refuse_sharding(trainer.args, trainer)
        if fsdp_version(trainer) == 2:
            self._in_train = True
            self._sampler = use_the_loops_order(trainer, self.loop)
            return None
        restored = restore_for_framework(self.loop, model, _KEPT,
                                         "elastic_ext.integrations.huggingface.ElasticCallback")
        self._restored = True
        if restored is None or "data" in restored.state:
            self._sampler = use_the_loops_order(trainer, self.loop)
        else:
            logger.warning("the restored step has no data position (taken before the callback "
                           "gave the Trainer its order): the data order stays the Trainer's")
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
        refuse_sharding(args, self._trainer_state.trainer)
        if args.world_size != self.loop.world_size:
            raise RuntimeError(
                f"the Trainer runs {args.world_size} rank(s) of the {self.loop.world_size} "
                "torchrun started, so it would train alone; on CPUs give "
                "TrainingArguments(use_cpu=True), which makes it use the process group")
        if self._in_train:
            self._restore_sharded(state, kwargs)
            return
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

    def _restore_sharded(self, state: TrainerState, objects: dict[str, Any]) -> None:
        """FSDP2: the model is sharded and the optimizer and scheduler made; restore into
        them (collective), then the Trainer's progress into ``state``."""
        optimizer = objects["optimizer"]
        inner = getattr(optimizer, "optimizer", optimizer)  # accelerate wraps it
        restored = restore_for_framework(
            self.loop, objects["model"], ("trainer_state",),
            "elastic_ext.integrations.huggingface.ElasticCallback",
            optimizer=inner, scheduler=objects["lr_scheduler"])
        self._restored = True
        if restored is not None:
            load_progress(self._trainer_state.trainer, state,
                          json.loads(restored.state["trainer_state"]["json"]))
            logger.info("resuming the Trainer at step %d from %s", restored.step,
                        restored.origin)
        self._trainer_state.state = state
        self.loop.framework.track(trainer_state=self._trainer_state)

    def on_step_begin(self, args: TrainingArguments, state: TrainerState,
                      control: TrainerControl, **kwargs: Any) -> None:
        self.loop.framework.pause_hang_check(False)  # the agent times the step from here
        if self._sampler is not None:
            # The Trainer fetched this step's batches (one per accumulated micro-batch)
            # before it calls this: the step trains them all.
            for _ in range(batches_of_this_step(self._trainer_state.trainer)):
                self._sampler.started()

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


__all__ = ["ElasticCallback", "LoopSettings", "fsdp_version", "load_progress",
           "refuse_sharding"]
