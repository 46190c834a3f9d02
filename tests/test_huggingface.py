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

import pytest

from tests.support.chaos import check_rank0_then_preempt, rank0_then_preempt, run_program

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "huggingface_trainer.py"


@pytest.mark.timeout(560)
def test_a_trainer_run_loses_no_step_to_rank0s_machine_dying_or_a_preemption(
        tmp_path: Path) -> None:
    result = run_program(rank0_then_preempt(steps=100), "hf-rank0-preempt", EXAMPLE, tmp_path)
    check_rank0_then_preempt(result, tmp_path)
