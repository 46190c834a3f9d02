"""A Hugging Face ``Trainer`` run made elastic by elastic-ext: a tiny GPT-2 built from a
config (nothing is downloaded) trained on random tokens.

The lines marked ``# elastic-ext`` are all it adds. With them a dead, frozen or
preempted node costs the step in flight instead of the steps since the last
``save_steps`` checkpoint, and the new round starts from the state the survivors hold::

    torchrun --nnodes=1:3 --nproc-per-node=1 --rdzv-backend=etcd-ext \\
        --rdzv-endpoint=c10d://127.0.0.1:29400 --rdzv-id=hf -m elastic_ext.warm \\
        examples/huggingface_trainer.py --steps 200 --snapshot-dir /tmp/hf

It needs ``pip install 'elastic-ext[transformers]'``; it trains on the CPU with gloo, or on
``cuda:LOCAL_RANK`` with NCCL when there is a GPU. ``--shard fsdp2`` shards the model with
accelerate's FSDP2; the callback then hands off the shards.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from elastic_ext import LoopSettings  # elastic-ext
from elastic_ext.integrations.huggingface import ElasticCallback  # elastic-ext


class RandomTokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Random token sequences, the same on every rank; labels are the inputs."""

    def __init__(self, size: int, length: int, vocab: int) -> None:
        self.ids = torch.randint(vocab, (size, length), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


class FSDPOnCPU(Trainer):
    """``--shard fsdp2`` on a machine without GPUs, where the tests run: accelerate keeps
    its FSDP plugin only on accelerators and would train with DDP; this turns FSDP2 on
    over gloo (two accelerate internals: ``AcceleratorState.distributed_type`` and
    ``fsdp_plugin``). Not used on GPUs."""

    def create_accelerator_and_postprocess(self) -> None:
        from accelerate.state import PartialState
        from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

        super().create_accelerator_and_postprocess()
        state = self.accelerator.state
        plugin_args = getattr(self.args, "fsdp_plugin_args", None)
        if state.distributed_type == DistributedType.MULTI_CPU and plugin_args is not None:
            state.fsdp_plugin = FullyShardedDataParallelPlugin(**plugin_args)
            state.distributed_type = DistributedType.FSDP
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP
            self.is_fsdp_enabled = True


class StepDelay(TrainerCallback):
    """Seconds added to each step, for the chaos harness to find the job mid-training."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_step_end(self, *args: Any, **kwargs: Any) -> None:
        time.sleep(self.seconds)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200, help="optimizer steps in all")
    p.add_argument("--global-batch-size", type=int, default=12,
                   help="samples per batch, all ranks together (split among the ranks); "
                        "a step trains --accumulate batches")
    p.add_argument("--seed", type=int, default=0, help="the Trainer's seed")
    p.add_argument("--snapshot-dir", type=Path, default=None, help="durable snapshots here")
    p.add_argument("--snapshot-every", type=int, default=0, help="a snapshot every K steps")
    p.add_argument("--output-dir", type=Path, default=None,
                   help="the Trainer's own checkpoints, every --save-steps (default: "
                        "SNAPSHOT_DIR/hf-output, else ./hf-output)")
    p.add_argument("--save-steps", type=int, default=50)
    p.add_argument("--metrics", type=Path, default=None, help="JSON-lines events (rank 0)")
    p.add_argument("--step-delay", type=float, default=0.0, help="seconds added to each step")
    p.add_argument("--accumulate", type=int, default=1,
                   help="batches per optimizer step (gradient_accumulation_steps)")
    p.add_argument("--shard", choices=("none", "fsdp2"), default="none",
                   help="fsdp2: shard the GPT-2 blocks across the ranks (accelerate's FSDP2)")
    p.add_argument("--model-size", default="tiny",
                   help="accepted for the chaos harness's trainer contract; one model here")
    return p.parse_args()


def sharding(shard: str) -> dict[str, Any]:
    """The ``TrainingArguments`` that shard the model: none, or FSDP2 per GPT-2 block."""
    if shard == "none":
        return {}
    return {"fsdp": "full_shard", "fsdp_config": {
        "version": 2, "transformer_layer_cls_to_wrap": ["GPT2Block"],
        "reshard_after_forward": True}}


def main() -> None:
    args = parse_args()
    elastic = ElasticCallback(LoopSettings(  # elastic-ext: the guard, the process group
        snapshot_dir=args.snapshot_dir, snapshot_every=args.snapshot_every,  # elastic-ext
        events_file=args.metrics, total_steps=args.steps))  # elastic-ext
    config = GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    torch.manual_seed(args.seed)  # the same initial weights on every rank (FSDP2 shards them)
    model = GPT2LMHeadModel(config)
    output_dir = args.output_dir or (args.snapshot_dir or Path(".")) / "hf-output"
    training = TrainingArguments(
        output_dir=str(output_dir), max_steps=args.steps, save_steps=args.save_steps,
        per_device_train_batch_size=max(1, args.global_batch_size // elastic.loop.world_size),
        gradient_accumulation_steps=args.accumulate,
        learning_rate=1e-3, logging_steps=10, report_to=[], dataloader_num_workers=0,
        disable_tqdm=True, seed=args.seed, use_cpu=elastic.loop.device.type == "cpu",
        **sharding(args.shard))
    on_cpu = elastic.loop.device.type == "cpu" and args.shard == "fsdp2"
    trainer = (FSDPOnCPU if on_cpu else Trainer)(
        model=model, args=training, train_dataset=RandomTokens(4096, 32, 128),
        callbacks=[elastic, StepDelay(args.step_delay)])  # elastic-ext: elastic
    trainer.train(resume_from_checkpoint=elastic.resume_from(trainer))  # elastic-ext


if __name__ == "__main__":
    main()
