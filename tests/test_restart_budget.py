"""--max-restarts is one budget for the whole job, kept in the store.

Worker crashes spend it; membership changes (a node dies, a node joins) do not.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from elastic_ext.jsonlines import read_json_lines
from elastic_ext.local.job import JobSpec, LocalJob, wait_for_step
from elastic_ext.rendezvous.events import EventKind

pytestmark = pytest.mark.slow

LOOP_JOB = str(Path(__file__).parent / "support" / "loop_job.py")


def loop_spec(metrics, *, steps, max_restarts, crash_at=0, nnodes="2:3", store="etcd"):
    return JobSpec(command=[LOOP_JOB, str(metrics), str(steps), "0.05", str(crash_at)],
                   store=store, nnodes=nnodes, run_id="budget", max_restarts=max_restarts)


@pytest.mark.timeout(180)
def test_spent_budget_stops_every_agent_with_a_message(tmp_path):
    metrics = tmp_path / "m.jsonl"
    spec = loop_spec(metrics, steps=100000, max_restarts=1, crash_at=3, nnodes="3:3")
    with LocalJob(spec, tmp_path).start(3) as job:
        codes = job.wait(timeout=150)
        spent = [n.events(EventKind.BUDGET_SPENT) for n in job.nodes]
        outputs = [n.proc.output() for n in job.nodes]
    assert all(code != 0 for code in codes), codes
    # the crashing node's torch agent gave up locally; the others learned it from the store
    assert sum(bool(events) for events in spent) >= 2, outputs[0][-3000:]
    assert any("--max-restarts=1" in e["note"] for events in spent for e in events), spent


@pytest.mark.timeout(180)
def test_a_lost_node_costs_no_restart_even_with_max_restarts_zero(tmp_path):
    metrics = tmp_path / "m.jsonl"
    spec = loop_spec(metrics, steps=60, max_restarts=0)
    with LocalJob(spec, tmp_path).start(3) as job:
        wait_for_step(metrics, after=0, world_size=3, timeout=90)
        job.other_node(job.rank0_node()).kill()
        wait_for_step(metrics, after=0, world_size=2, timeout=60)
        survivors = [n for n in job.nodes if n.alive()]
        codes = [n.proc.wait(timeout=90) for n in survivors]
    assert codes == [0, 0], [n.proc.output()[-3000:] for n in survivors]
    final = [e for e in read_json_lines(metrics) if e["world_size"] == 2]
    assert final[-1]["step"] == 60


@pytest.mark.timeout(180)
def test_a_joining_node_costs_no_restart_even_with_max_restarts_zero(tmp_path):
    metrics = tmp_path / "m.jsonl"
    spec = loop_spec(metrics, steps=80, max_restarts=0)
    with LocalJob(spec, tmp_path).start(2) as job:
        wait_for_step(metrics, after=0, world_size=2, timeout=90)
        job.add_node()
        wait_for_step(metrics, after=0, world_size=3, timeout=60)
        codes = job.wait(timeout=120)
    assert codes == [0, 0, 0], [n.proc.output()[-2000:] for n in job.nodes]
