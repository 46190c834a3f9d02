"""``examples/lightning_trainer.py`` (a Lightning ``Trainer`` with ``ElasticCallback``)
under the chaos harness: real etcd, real torchrun agents, a tiny network. Each run must
finish with 0 steps trained twice, the new rounds starting from the survivors' memory,
at every world size the rounds have (``num_nodes`` from torchrun), with every step
trained on the samples the exactly-once order gives it (across an epoch's end too).

One run covers the issue's cases: rank 0's machine dies under ``--max-restarts=0``,
then the whole job is preempted (saving at the step boundary) and started again
(``tests.support.chaos.rank0_then_preempt``). A join and another node's death take the
same path in ``ElasticLoop`` and run in ``tests/test_own_loop.py``.

The callback's parts that need no process group run here too (a fake loop, a real
``lightning.Trainer``), not in the fast lane: importing Lightning takes about 10 s of CPU
(torchmetrics imports transformers and scipy), and the fast lane collects every module.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.support.chaos import (
    check_every_step_on_its_data,
    check_rank0_then_preempt,
    rank0_then_preempt,
    run_program,
)
from tests.support.readme_snippets import RUN_ID, readme_snippet, run_snippet

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "lightning_trainer.py"
DATASET_SIZE = 1200  # the example's
ACCUMULATE = 2


@pytest.mark.timeout(560)
def test_a_lightning_run_loses_no_step_to_rank0s_machine_dying_or_a_preemption(
        tmp_path: Path) -> None:
    """With gradient accumulation (2 batches a step): a fault inside an accumulation keeps
    the last whole optimizer step, and its batches are trained again once."""
    # 60 steps of 2 batches: the restarted job crosses the end of the first epoch (100
    # batches of 12 samples)
    result = run_program(rank0_then_preempt(steps=60), "pl-rank0-preempt", EXAMPLE, tmp_path,
                         extra=("--accumulate", str(ACCUMULATE)))
    events = check_rank0_then_preempt(result, tmp_path)
    # Each step trained the batches the uninterrupted order gives it, across the end of
    # the first epoch too.
    check_every_step_on_its_data(events, last=60, dataset_size=DATASET_SIZE,
                                 batches_per_step=ACCUMULATE)
    last = [e for e in events if e["event"] == "step"][-1]
    assert last["epoch"] == 1, last  # the restarted job crossed the first epoch's end


@pytest.mark.timeout(560)
def test_a_sharded_lightning_run_hands_off_its_shards_at_every_world_size(
        tmp_path: Path) -> None:
    """FSDP2 under ``ModelParallelStrategy`` (the example's ``--shard fsdp2``): the model is
    built in ``fit``, so the callback restores at ``on_fit_start``. Rank 0's machine dies:
    the survivor trains on alone from its own shards and the copy it held of rank 0's
    (node memory, world 2 -> 1); the preempted job restarts on two machines from the DCP
    snapshot, resharded (1 -> 2). 0 steps twice, every step on its exactly-once data."""
    result = run_program(rank0_then_preempt(steps=60), "pl-sharded", EXAMPLE, tmp_path,
                         extra=("--shard", "fsdp2"))
    events = check_rank0_then_preempt(result, tmp_path)
    check_every_step_on_its_data(events, last=60, dataset_size=DATASET_SIZE)
    assert any((tmp_path / "snapshots").glob("dcp-*")), "the durable snapshots are DCP's"


@dataclass
class FakeLoop:
    world_size: int


def callback(world_size: int) -> Any:
    from elastic_ext.integrations.lightning import ElasticCallback

    return ElasticCallback(loop=FakeLoop(world_size))  # type: ignore[arg-type]


def test_the_sizes_come_from_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    elastic = callback(12)
    assert (elastic.devices, elastic.num_nodes) == (4, 3)
    assert callback(8).num_nodes == 2  # the next round, two nodes left


def test_a_world_that_is_not_whole_nodes_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(ValueError, match="same --nproc-per-node"):
        _ = callback(6).num_nodes


def test_lightning_installs_no_signal_handler_for_the_run() -> None:
    import lightning.pytorch as pl

    from elastic_ext.integrations.lightning import keep_signal_handlers

    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False)
    ours = signal.getsignal(signal.SIGTERM)
    keep_signal_handlers(trainer)
    trainer._signal_connector.register_signal_handlers()  # what Trainer._run calls
    assert signal.getsignal(signal.SIGTERM) is ours


class NotLightning26:
    """A Trainer of a Lightning without the internals the callback uses."""

    _checkpoint_connector: Any = object()
    _signal_connector: Any = object()


def test_a_lightning_without_the_internals_used_is_named_with_the_version_needed() -> None:
    from elastic_ext.integrations.lightning import dump_checkpoint, keep_signal_handlers

    with pytest.raises(RuntimeError, match=r"needs lightning 2\.6"):
        dump_checkpoint(NotLightning26())  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match=r"needs lightning 2\.6"):
        keep_signal_handlers(NotLightning26())  # type: ignore[arg-type]


@pytest.mark.parametrize("strategy", ["FSDPStrategy", "DeepSpeedStrategy"])
def test_a_sharding_the_callback_cannot_keep_is_refused_before_any_step_naming_what_to_use(
        strategy: str) -> None:
    import lightning.pytorch.strategies as strategies

    from elastic_ext.integrations.lightning import refuse_sharding

    cls = getattr(strategies, strategy)
    trainer = SimpleNamespace(strategy=cls.__new__(cls))
    with pytest.raises(RuntimeError, match=rf"{strategy} shards the model.*FSDP2 shards "
                                           r"\(strategy=ModelParallelStrategy.*loop\.mesh\(\)"):
        refuse_sharding(trainer)  # type: ignore[arg-type]


def test_model_parallelism_is_kept_when_the_module_shards_in_configure_model() -> None:
    import lightning.pytorch as pl
    import lightning.pytorch.strategies as strategies

    from elastic_ext.integrations.lightning import builds_in_fit, refuse_sharding

    class Plain(pl.LightningModule):
        pass

    class Sharded(pl.LightningModule):
        def configure_model(self) -> None:
            pass

    assert builds_in_fit(Sharded()) and not builds_in_fit(Plain())
    cls = strategies.ModelParallelStrategy
    trainer = SimpleNamespace(strategy=cls.__new__(cls))
    refuse_sharding(trainer, built_in_fit=True)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="this module has none: call fully_shard"):
        refuse_sharding(trainer, built_in_fit=False)  # type: ignore[arg-type]


def test_a_sharded_optimizer_is_refused_and_ddp_passes() -> None:
    import lightning.pytorch.strategies as strategies
    import torch
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from elastic_ext.integrations.lightning import refuse_sharding

    ddp = strategies.DDPStrategy.__new__(strategies.DDPStrategy)
    refuse_sharding(SimpleNamespace(strategy=ddp))  # type: ignore[arg-type]
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        zero = ZeroRedundancyOptimizer(torch.nn.Linear(2, 2).parameters(),
                                       optimizer_class=torch.optim.SGD, lr=0.1)
        sharded = SimpleNamespace(strategy=SimpleNamespace(optimizers=[zero]))
        with pytest.raises(RuntimeError, match="ZeroRedundancyOptimizer shards the optimizer"):
            refuse_sharding(sharded)  # type: ignore[arg-type]
    finally:
        dist.destroy_process_group()


class AccumulatingLoop:
    """What the callback calls of ``ElasticLoop`` at a batch's end, recorded."""

    def __init__(self) -> None:
        self.step, self.calls = 0, []  # type: ignore[var-annotated]
        self.framework = SimpleNamespace(
            updating=False, pause_hang_check=lambda paused: self.calls.append("pause"),
            end_update=lambda: self.calls.append("end_update"))

    def step_done(self, loss: Any = None) -> None:
        self.step += 1
        self.calls.append("step_done")


def test_only_a_batch_that_stepped_the_optimizer_is_a_step_boundary() -> None:
    """With accumulation, the batches before the accumulation's last step no optimizer:
    no boundary there, so a fault keeps the last whole optimizer step."""
    from elastic_ext.integrations.lightning import ElasticCallback

    loop = AccumulatingLoop()
    elastic = ElasticCallback(loop=loop)  # type: ignore[arg-type]
    elastic._state.at_boundary = lambda step, trainer: None  # type: ignore[method-assign]
    trainer = SimpleNamespace(global_step=0)
    elastic.on_train_batch_end(trainer, None, {"loss": None}, None, 0)  # type: ignore[arg-type]
    assert loop.calls == ["pause"] and loop.step == 0
    loop.framework.updating, trainer.global_step = True, 1  # on_before_optimizer_step ran
    elastic.on_train_batch_end(trainer, None, {"loss": None}, None, 1)  # type: ignore[arg-type]
    assert loop.calls == ["pause", "end_update", "step_done", "pause"] and loop.step == 1
    loop.framework.updating, trainer.global_step = True, 3  # two optimizers stepped
    with pytest.raises(RuntimeError, match="one optimizer step per batch"):
        elastic.on_train_batch_end(trainer, None, {}, None, 2)  # type: ignore[arg-type]


PL_PREAMBLE = '''
import torch
from torch import nn
from torch.utils.data import TensorDataset

class Regression(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(4, 1)
    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        return nn.functional.mse_loss(self.net(inputs), targets)
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

model = Regression()
data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
'''


@pytest.mark.timeout(300)
def test_the_readmes_snippet_runs_as_pasted_into_a_script(tmp_path: Path) -> None:
    """Its imports are all it needs (the preamble, the user's model and data, comes after
    them), its snapshots go under the run's id, and the callback moves itself last."""
    snippet = readme_snippet("lightning.pytorch")
    assert "max_steps=1000" in snippet
    imports, _, rest = snippet.partition("\n\n")
    done = run_snippet(tmp_path, imports + PL_PREAMBLE,
                       rest.replace("max_steps=1000", "max_steps=3")
                       + "print('last', type(trainer.callbacks[-1]).__name__)\n")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "last ElasticCallback" in done.stdout
    assert sorted(p.name for p in (tmp_path / "snapshots" / RUN_ID).glob("*.json")) == \
        ["snapshot-0000000003.json"], done.stderr[-3000:]  # the final commit
