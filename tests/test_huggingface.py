"""``examples/huggingface_trainer.py`` (a Hugging Face ``Trainer`` with ``ElasticCallback``)
under the chaos harness: real etcd, real torchrun agents, a tiny GPT-2 built from a
config. The harness judges it by the bundled trainer's invariants; each run must finish
with 0 steps trained twice, the new rounds starting from the survivors' memory.

Two runs cover the issue's cases: a join, a dead node and a whole-job preemption
followed by a restart; and rank 0's machine dying under ``--max-restarts=0``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from elastic_ext.chaos.runner import RunOptions, RunResult, run_scenario
from elastic_ext.chaos.scenario import parse
from elastic_ext.jsonlines import read_json_lines
from tests.support.chaos import explain

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "huggingface_trainer.py"

JOIN_KILL_PREEMPT = """\
nodes = 2
etcd-members = 1
steps = 400
snapshot-every = 10
step-delay = 0.05
global-batch-size = 12
rdzv-conf = last_call_timeout=5
timeout = 300
at step 30: start node
at step 250: kill node other
at step 320: preempt all
when stopped: start all
"""
"""The newcomer asks to join once its warm-start server is ready (transformers imported,
several seconds on a busy 2-core machine): the kill comes well after that."""

RANK0_NO_BUDGET = """\
nodes = 3
etcd-members = 1
max-restarts = 0
steps = 120
snapshot-every = 10
step-delay = 0.05
global-batch-size = 12
rdzv-conf = last_call_timeout=5
timeout = 240
at step 35: kill node rank0
"""


def run(text: str, name: str, tmp_path: Path) -> RunResult:
    result = run_scenario(parse(text, name),
                          RunOptions(workdir=tmp_path, module=str(EXAMPLE), reference=False))
    verdict = result.verdict
    assert not result.skipped, result.skipped
    assert verdict is not None and verdict.ok, explain(result)
    assert verdict.final_step is not None and verdict.restarts, explain(result)
    assert verdict.lost_steps == 0, explain(result)
    events = read_json_lines(tmp_path / "metrics.jsonl")
    steps = [e["step"] for e in events if e["event"] == "step"]
    assert len(steps) == len(set(steps)), f"steps trained twice: {explain(result)}"
    # Every new round started from a step the survivors kept, not from a checkpoint.
    restores = [e for e in events if e["event"] == "restore" and e["step"] > 0]
    assert restores, explain(result)
    return result


def worlds(result: RunResult) -> list[int]:
    verdict = result.verdict
    assert verdict is not None
    seen: list[int] = []
    for segment in verdict.segments:
        if not seen or seen[-1] != segment.world_size:
            seen.append(segment.world_size)
    return seen


@pytest.mark.timeout(560)
def test_a_trainer_run_survives_a_join_a_dead_node_and_a_preemption_without_repeating_a_step(
        tmp_path: Path) -> None:
    result = run(JOIN_KILL_PREEMPT, "hf-tour", tmp_path)
    assert worlds(result) == [2, 3, 2], explain(result)


@pytest.mark.timeout(480)
def test_a_trainer_run_survives_rank0s_machine_dying_without_a_restart_budget(
        tmp_path: Path) -> None:
    result = run(RANK0_NO_BUDGET, "hf-rank0", tmp_path)
    assert worlds(result) == [3, 2], explain(result)
