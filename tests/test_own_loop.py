"""``examples/own_loop.py`` (a plain DDP loop on ``ElasticLoop``) under the chaos harness.

The harness drives it as it drives the bundled trainer (real etcd, real torchrun agents,
the trainer's flags and metrics events) and judges the run by the same invariants. One
run covers the issue's cases: a join, a dead node and a whole-job preemption followed by
a restart, under ``--max-restarts=0``. It must finish, with 0 steps trained twice across
every round change, exactly-once data, and no restart spent on a join, a lost node or a
whole-job restart (what ``tests/test_restart_budget.py`` proved with its own jobs before).

Rank 0's machine dying under ``--max-restarts=0`` (it hosts the workers' store and the
metrics writer) had a run of its own here; it takes the same path in ``ElasticLoop`` as
the Hugging Face and Lightning runs (``tests/test_huggingface.py``,
``tests/test_lightning.py``), which play it, so it went (31 s of the suite).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from elastic_ext.chaos.runner import RunResult
from elastic_ext.chaos.scenario import parse
from elastic_ext.jsonlines import read_json_lines
from elastic_ext.worker.loop.data import position_after
from tests.support.chaos import explain, run_program, worlds

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "own_loop.py"

JOIN_KILL_PREEMPT = """\
nodes = 2
etcd-members = 1
max-restarts = 0
steps = 700
snapshot-every = 10
step-delay = 0.05
timeout = 300
at step 30: start node
when world 3: kill node other
when recovered: preempt all
when stopped: start all
"""
"""The newcomer asks to join once its warm-start server is ready: about 17 s, 145 steps,
with another test running on this 2-core machine; 40 s once when the other test was a
Lightning run, and step 355 (of 500 then) on the suite's three workers. 670 steps are
left when it starts.
Each fault waits for the previous one to have taken effect. The default last call (1 s)
will do: two nodes, the minimum, start the job and the restart (a round cannot close
before both are in, and a longer last call would only be waited out), and the newcomer
makes three, the maximum, which closes its round at once."""

def run(text: str, name: str, tmp_path: Path) -> RunResult:
    result = run_program(text, name, EXAMPLE, tmp_path)
    # Exactly-once data: after every step, in every round, the data stands where an
    # uninterrupted run's stands after that step (each step took the right samples).
    size, batch = 2048, parse(text, name).settings.global_batch_size  # the example's dataset
    steps = [e for e in read_json_lines(tmp_path / "metrics.jsonl") if e["event"] == "step"]
    assert steps and all(
        (e["epoch"], e["offset"]) == tuple(vars(position_after(e["step"], batch, size)).values())
        for e in steps), explain(result)
    return result


@pytest.mark.timeout(560)
def test_a_join_a_dead_node_and_a_preemption_cost_no_step(tmp_path: Path) -> None:
    result = run(JOIN_KILL_PREEMPT, "own-loop-tour", tmp_path)
    assert worlds(result) == [2, 3, 2], explain(result)
