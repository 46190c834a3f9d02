"""``examples/lightning_trainer.py`` (a Lightning ``Trainer`` with ``ElasticCallback``)
under the chaos harness: real etcd, real torchrun agents, a tiny network. Each run must
finish with 0 steps trained twice, the new rounds starting from the survivors' memory,
at every world size the rounds have (``num_nodes`` from torchrun), with every step
trained on the samples the exactly-once order gives it (across an epoch's end too).

One run covers the issue's cases: rank 0's machine dies under ``--max-restarts=0``,
then the whole job is preempted (saving at the step boundary) and started again
(``tests.support.chaos.rank0_then_preempt``). A join and another node's death take the
same path in ``ElasticLoop`` and run in ``tests/test_own_loop.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from elastic_ext.loop.data import position_after
from tests.support.chaos import check_rank0_then_preempt, rank0_then_preempt, run_program

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "lightning_trainer.py"
DATASET_SIZE = 1200  # the example's


@pytest.mark.timeout(560)
def test_a_lightning_run_loses_no_step_to_rank0s_machine_dying_or_a_preemption(
        tmp_path: Path) -> None:
    result = run_program(rank0_then_preempt(steps=130, preempt_at=80), "pl-rank0-preempt",
                         EXAMPLE, tmp_path)
    events = check_rank0_then_preempt(result, tmp_path)
    # Each step trained the global batch the uninterrupted order gives it, across the end
    # of the first epoch (100 steps of 12 samples) too.
    for event in (e for e in events if e["event"] == "step"):
        where = position_after(event["step"], 12, DATASET_SIZE)
        assert (event["epoch"], event["offset"]) == (where.epoch, where.offset), event
