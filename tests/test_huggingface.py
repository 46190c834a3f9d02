"""``examples/huggingface_trainer.py`` (a Hugging Face ``Trainer`` with ``ElasticCallback``)
under the chaos harness: real etcd, real torchrun agents, a tiny GPT-2 built from a
config. The harness judges it by the bundled trainer's invariants; each run must finish
with 0 steps trained twice, the new rounds starting from the survivors' memory.

One run covers the issue's cases: rank 0's machine dies under ``--max-restarts=0``,
then the whole job is preempted (saving at the step boundary) and started again.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from elastic_ext.jsonlines import read_json_lines
from tests.support.chaos import explain, run_program, worlds

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "huggingface_trainer.py"

RANK0_THEN_PREEMPT = """\
nodes = 3
etcd-members = 1
max-restarts = 0
steps = 160
snapshot-every = 10
step-delay = 0.05
global-batch-size = 12
rdzv-conf = last_call_timeout=5
timeout = 300
at step 35: kill node rank0
at step 90: preempt all
when stopped: start all
"""
"""Rank 0's machine dies (it hosts the workers' store and the metrics writer) under
``--max-restarts=0``; later the whole job is preempted and started again. A join and
another node's death take the same path in ``ElasticLoop`` and run in
``tests/test_own_loop.py``."""


@pytest.mark.timeout(560)
def test_a_trainer_run_loses_no_step_to_rank0s_machine_dying_or_a_preemption(
        tmp_path: Path) -> None:
    result = run_program(RANK0_THEN_PREEMPT, "hf-rank0-preempt", EXAMPLE, tmp_path)
    assert worlds(result) == [3, 2, 3], explain(result)  # "start all": the three machines
    events = read_json_lines(tmp_path / "metrics.jsonl")
    preempted = [e for e in events if e["event"] == "preempted"]
    assert len(preempted) == 1 and preempted[0]["signal"] == "SIGUSR2", explain(result)
    # The restarted job resumed at the very step the preemption saved, from disk.
    restored = [e for e in events if e["event"] == "restore"]
    assert [e["source"] for e in restored] == ["none", "local", "disk"], explain(result)
    assert restored[-1]["step"] == preempted[0]["step"], explain(result)
