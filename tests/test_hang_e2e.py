"""A worker that hangs while its agent lives: real etcd, real torchrun agents, gloo on CPU.

What only these can prove: the agents judge the round hung from step progress in seconds
(the collective timeout is 60 s in the bundled trainer), blame the stuck worker, stop it
(a stopped process never acts on torch's SIGTERM), and the next round trains from the
kept step with no finished step trained twice and the data order exactly once.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from elastic_ext.jsonlines import read_json_lines
from elastic_ext.local.job import JobSpec, LocalJob, Node, wait_for_step
from elastic_ext.local.processes import wait_until
from tests.support.trainer_runs import BASE_ARGS
from tests.test_handoff_e2e import per_step_batches, uninterrupted_batches

pytestmark = [pytest.mark.slow, pytest.mark.etcd]

STEPS = 300
HANG_SCRIPT = Path(__file__).resolve().parent / "support" / "hang_loop.py"


def trainer_spec(tmp: Path) -> JobSpec:
    command = ["-m", "trainer", *BASE_ARGS, "--steps", str(STEPS),
               "--metrics", str(tmp / "metrics.jsonl"), "--record-samples",
               str(tmp / "samples.jsonl"), "--step-delay", "0.05"]
    return JobSpec(command=command, nnodes="2:3", run_id="hang", max_restarts=0,
                   rdzv_conf="last_call_timeout=5")


def events(tmp: Path, kind: str) -> list[dict[str, Any]]:
    return [e for e in read_json_lines(tmp / "metrics.jsonl") if e["event"] == kind]


def training_worker(node: Node) -> int:
    return wait_until(node.training_pid, 30, what="a worker's beacon")


def agent_events(node: Node, kind: str) -> list[dict[str, Any]]:
    return [e for e in node.events() if e.get("event") == kind]


@pytest.mark.timeout(240)
def test_a_stopped_worker_is_found_and_killed_and_the_round_trains_again_in_seconds(
        tmp_path: Path) -> None:
    with LocalJob(trainer_spec(tmp_path), tmp_path).start(3) as job:
        metrics = tmp_path / "metrics.jsonl"
        wait_for_step(metrics, after=0.0, world_size=3, timeout=90)
        wait_until(lambda: events(tmp_path, "step")[-1]["step"] >= 30, 60, what="step 30")
        node = next(n for n in job.nodes if n.group_rank() not in (0, None))
        worker = training_worker(node)
        os.kill(worker, signal.SIGSTOP)
        stopped_at = time.time()
        again = wait_for_step(metrics, after=stopped_at + 0.3, world_size=3, timeout=60)
        took = again["time"] - stopped_at
        assert took < 8.0, f"training again {took:.1f}s after the stop"  # 60 s without it
        hung = agent_events(node, "hung")
        assert hung and "is stopped" in hung[0]["why"], node.events()
        codes = [n.proc.wait(timeout=180) for n in job.nodes]
        assert codes == [0, 0, 0], [n.proc.output()[-3000:] for n in job.nodes]
    steps = [e["step"] for e in events(tmp_path, "step")]
    assert len(steps) == len(set(steps)), "a finished step was trained twice"
    assert per_step_batches(read_json_lines(tmp_path / "samples.jsonl")) == \
        uninterrupted_batches(STEPS)
    print(f"stopped worker: training again after {took:.2f}s")


def loop_spec(tmp: Path, how: str, *, nnodes: str = "2:3", nproc: int = 2) -> JobSpec:
    """Two workers per node: the one that hangs, and a neighbour that waits for it in the
    collective (the evidence that running outside one is a hang: ``hang.py``)."""
    return JobSpec(command=["-m", "elastic_ext.warm", str(HANG_SCRIPT),
                            str(tmp / "metrics.jsonl"), str(STEPS), how, str(tmp / "hung")],
                   nnodes=nnodes, nproc_per_node=nproc, run_id=f"hang-{how}", max_restarts=0,
                   rdzv_conf="last_call_timeout=5")


def first_step_after(tmp: Path, at: float, world: int, job: LocalJob | None = None
                     ) -> dict[str, Any]:
    """The first step at ``world`` after ``at``; on a timeout, what the agents and the
    loop logged."""
    try:
        return wait_for_step(tmp / "metrics.jsonl", after=at + 0.3, world_size=world,
                             timeout=60)
    except TimeoutError:
        seen = [(e["event"], e["step"], e["world_size"]) for e in
                read_json_lines(tmp / "metrics.jsonl") if e["event"] != "step"]
        agents = [(n.name, e["event"], e.get("why") or e.get("note") or "")
                  for n in (job.nodes if job else []) for e in n.events()
                  if e["event"] != "started"]
        outputs = [n.proc.output()[-2000:] for n in (job.nodes if job else [])]
        raise AssertionError(f"no step at world size {world}: {seen}\n{agents}\n{outputs}"
                             ) from None


def check_steps(tmp: Path) -> None:
    steps = [e["step"] for e in events(tmp, "step")]
    assert len(steps) == len(set(steps)), "a finished step was trained twice"
    assert events(tmp, "done")[-1]["step"] == STEPS


@pytest.mark.timeout(300)
def test_a_worker_spinning_in_python_is_blamed_killed_and_twice_takes_its_node_out(
        tmp_path: Path) -> None:
    """The worker of group rank 1 spins at step 20, and again at step 40: the first
    hang is its node's (a free round on the same nodes), the second takes the node out of
    the job and the others train on without it."""
    with LocalJob(loop_spec(tmp_path, "spin-twice"), tmp_path).start(3) as job:
        marker = tmp_path / "hung"
        wait_until(marker.exists, 120, what="the first hang")
        took = first_step_after(tmp_path, marker.stat().st_mtime, 6, job)["time"] \
            - marker.stat().st_mtime
        assert took < 8.0, f"training again {took:.1f}s after the hang"
        wait_until(lambda: marker.read_text() == "xx", 60, what="the second hang")
        culprit = next(n for n in job.nodes if agent_events(n, "hung"))
        wait_until(lambda: agent_events(culprit, "left_on_notice"), 60,
                   what=f"the culprit's node to leave: {culprit.events()[-3:]}")
        first_step_after(tmp_path, marker.stat().st_mtime, 4, job)
        hung = agent_events(culprit, "hung")
        assert len(hung) == 2 and all("not in a collective" in h["why"]
                                      and "hang_loop.py" in h["why"] for h in hung), hung
        others = [n for n in job.nodes if n is not culprit]
        codes = [n.proc.wait(timeout=180) for n in others]
        assert codes == [0, 0], [n.proc.output()[-3000:] for n in others]
        culprit.proc.wait(timeout=60)
    check_steps(tmp_path)
    print(f"spin: training again after {took:.2f}s; its node left at the second hang")


@pytest.mark.chaos_full  # the same judgment as the spin (tests/test_hang.py: the beacon)
@pytest.mark.timeout(240)
def test_a_worker_blocked_in_a_call_that_never_returns_is_blamed_and_killed(
        tmp_path: Path) -> None:
    with LocalJob(loop_spec(tmp_path, "sleep"), tmp_path).start(3) as job:
        marker = tmp_path / "hung"
        wait_until(marker.exists, 120, what="the hang")
        took = first_step_after(tmp_path, marker.stat().st_mtime, 6)["time"] \
            - marker.stat().st_mtime
        assert took < 8.0, f"training again {took:.1f}s after the hang"
        codes = [n.proc.wait(timeout=180) for n in job.nodes]
        assert codes == [0, 0, 0], [n.proc.output()[-3000:] for n in job.nodes]
        hung = [h for n in job.nodes for h in agent_events(n, "hung") if h["culprits"]]
        assert len(hung) == 1 and "hang_loop.py" in hung[0]["why"], hung
    check_steps(tmp_path)
