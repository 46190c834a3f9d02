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
from typing import Any

import pytest

from elastic_ext.worker.loop.data import position_after
from tests.support.chaos import check_rank0_then_preempt, rank0_then_preempt, run_program

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "lightning_trainer.py"
DATASET_SIZE = 1200  # the example's


@pytest.mark.timeout(560)
def test_a_lightning_run_loses_no_step_to_rank0s_machine_dying_or_a_preemption(
        tmp_path: Path) -> None:
    # 110 steps: the restarted job crosses the end of the first epoch (100 steps of 12
    # samples)
    result = run_program(rank0_then_preempt(steps=110), "pl-rank0-preempt", EXAMPLE, tmp_path)
    events = check_rank0_then_preempt(result, tmp_path)
    # Each step trained the global batch the uninterrupted order gives it, across the end
    # of the first epoch too.
    steps = [e for e in events if e["event"] == "step"]
    assert steps[-1]["step"] == 110 and steps[-1]["epoch"] == 1, steps[-1]
    for event in steps:
        where = position_after(event["step"], 12, DATASET_SIZE)
        assert (event["epoch"], event["offset"]) == (where.epoch, where.offset), event


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
