"""``examples/huggingface_trainer.py`` (a Hugging Face ``Trainer`` with ``ElasticCallback``)
under the chaos harness: real etcd, real torchrun agents, a tiny GPT-2 built from a
config. The harness judges it by the bundled trainer's invariants; each run must finish
with 0 steps trained twice, the new rounds starting from the survivors' memory.

One run covers the issue's cases: rank 0's machine dies under ``--max-restarts=0``,
then the whole job is preempted (saving at the step boundary) and started again
(``tests.support.chaos.rank0_then_preempt``). A join and another node's death take the
same path in ``ElasticLoop`` and run in ``tests/test_own_loop.py``.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.support.chaos import (
    check_every_step_on_its_data,
    check_rank0_then_preempt,
    rank0_then_preempt,
    run_program,
)
from tests.support.readme_snippets import RUN_ID, readme_snippet, run_snippet

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "huggingface_trainer.py"
DATASET_SIZE = 4096  # the example's
ACCUMULATE = 2


@pytest.mark.timeout(560)
def test_a_trainer_run_loses_no_step_to_rank0s_machine_dying_or_a_preemption(
        tmp_path: Path) -> None:
    """With gradient accumulation (2 batches a step): a fault inside an accumulation keeps
    the last whole optimizer step."""
    result = run_program(rank0_then_preempt(steps=100), "hf-rank0-preempt", EXAMPLE, tmp_path,
                         extra=("--accumulate", str(ACCUMULATE)))
    events = check_rank0_then_preempt(result, tmp_path)
    # The loop's exactly-once order across the world sizes 2, 1, 2 (the global batch stays
    # 12: the example gives each rank 12 / world size)
    check_every_step_on_its_data(events, last=100, dataset_size=DATASET_SIZE,
                                 batches_per_step=ACCUMULATE)


@pytest.mark.timeout(560)
def test_an_fsdp2_trainer_run_hands_off_its_shards_at_every_world_size(tmp_path: Path) -> None:
    """accelerate's FSDP2 (the example's ``--shard fsdp2``): the model is sharded only at
    ``prepare``, so the callback restores at ``on_train_begin``. Rank 0's machine dies: the
    survivor trains on from its shards and its copy of rank 0's (node memory, 2 -> 1); the
    preempted job restarts on two machines from the DCP snapshot, resharded (1 -> 2).
    0 steps twice, every step on its exactly-once data."""
    result = run_program(rank0_then_preempt(steps=100), "hf-fsdp2", EXAMPLE, tmp_path,
                         extra=("--shard", "fsdp2"))
    events = check_rank0_then_preempt(result, tmp_path)
    check_every_step_on_its_data(events, last=100, dataset_size=DATASET_SIZE)
    assert any((tmp_path / "snapshots").glob("dcp-*")), "the durable snapshots are DCP's"


def fsdp_trainer(version: int) -> SimpleNamespace:
    """What ``fsdp_version`` reads of a Trainer whose accelerator shards with FSDP ``version``."""
    plugin = SimpleNamespace(fsdp_version=version)
    return SimpleNamespace(is_fsdp_enabled=True,
                           accelerator=SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin)))


@pytest.mark.parametrize("sharding", [{"fsdp": "full_shard"}, {"deepspeed": "ds.json"}])
def test_a_sharding_the_callback_cannot_keep_is_refused_before_any_step_naming_what_to_use(
        sharding: dict[str, str]) -> None:
    """DeepSpeed, FSDP1, and ``fsdp=`` where accelerate trains with DDP after all (on CPUs
    it drops its FSDP plugin): refused; FSDP2 that really shards is kept."""
    from elastic_ext.integrations.huggingface import refuse_sharding

    refuse_sharding(SimpleNamespace(fsdp=None, deepspeed=None))  # type: ignore[arg-type]
    args = SimpleNamespace(**{"fsdp": None, "deepspeed": None, **sharding})
    [name] = sharding
    for trainer in (None, fsdp_trainer(1)):
        with pytest.raises(RuntimeError, match=rf"{name}=\.\.\.\) shards the model in a way "
                                               r"the callback does not keep.*FSDP2.*loop\.mesh"):
            refuse_sharding(args, trainer)  # type: ignore[arg-type]
    if name == "fsdp":
        refuse_sharding(args, fsdp_trainer(2))  # type: ignore[arg-type]
        with pytest.raises(RuntimeError, match="accelerate does not shard on this machine.*"
                                               "drop fsdp= here, or run on GPUs"):
            refuse_sharding(args, SimpleNamespace(is_fsdp_enabled=False))  # type: ignore[arg-type]


HF_PREAMBLE = '''
import torch
from transformers import GPT2Config, GPT2LMHeadModel

class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 16
    def __getitem__(self, i):
        ids = torch.arange(i, i + 8) % 64
        return {"input_ids": ids, "labels": ids}

model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1,
                                   n_head=2))
data = Tokens()
'''


@pytest.mark.timeout(300)
def test_the_readmes_snippet_runs_as_pasted_into_a_script(tmp_path: Path) -> None:
    """Its imports are all it needs, its snapshots go under the run's id, and the callback
    moves itself last among the Trainer's callbacks."""
    snippet = readme_snippet("transformers import")
    done = run_snippet(tmp_path, HF_PREAMBLE, snippet + "print('callbacks', [type(c).__name__ "
                       "for c in trainer.callback_handler.callbacks][-1])\n")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "callbacks ElasticCallback" in done.stdout
    assert sorted(p.name for p in (tmp_path / "snapshots" / RUN_ID).glob("*.json")) == \
        ["snapshot-0000000006.json"], done.stderr[-3000:]  # the final commit: 3 epochs of 2 steps
