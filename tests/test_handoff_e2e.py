"""State hand-off end to end: real etcd, real torchrun agents, and a snapshot directory of
each node's own (``{node}`` in the command), as on machines that share no filesystem.

What only these can prove: a worker that sees a peer fail keeps its last step in node
memory and the next round starts from it (so a death costs at most the step in flight,
a join or a preemption nothing), a node whose directory is empty gets the state from
its peers, a stop for a join is not reported as a preemption, and a whole-job restart
finds the newest snapshot whichever node holds it.

The whole-job restart after a preemption had a job of its own (three agents and an etcd,
51 s of the suite); it now follows the three-rank job of killed worker and frozen node,
which shares its shape and its reference. The deaths and the join compare their batches
with ``elastic_ext.worker.loop.data.next_batch``, what the trainer records, instead of a 2-rank
reference run of their own.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import pytest

from elastic_ext.control_channel import node_memory_directory
from elastic_ext.jsonlines import read_json_lines
from elastic_ext.local.job import JobSpec, LocalJob, Node, wait_for_step
from elastic_ext.local.processes import ProcessSet, signal_pids, wait_until
from elastic_ext.worker.loop.data import DataPosition, next_batch
from tests.support.trainer_runs import BASE_ARGS, reference

pytestmark = pytest.mark.slow

MEMORY = ("peer", "local")


def spec(tmp: Path, *, extra: tuple[str, ...] = (), nnodes: str = "2:3",
         run_id: str = "handoff", max_restarts: int = 0, steps: int = 150) -> JobSpec:
    """The job; ``last_call_timeout=5`` so that nodes started together form one round
    even on a slow machine."""
    command = ["-m", "trainer", *BASE_ARGS, "--steps", str(steps),
               "--snapshot-dir", str(tmp / "{node}" / "snapshots"), "--snapshot-every", "10",
               "--metrics", str(tmp / "metrics.jsonl"), "--record-samples",
               str(tmp / "samples.jsonl"), "--step-delay", "0.05", *extra]
    return JobSpec(command=command, nnodes=nnodes, run_id=run_id, max_restarts=max_restarts,
                   rdzv_conf="last_call_timeout=5")


def events(tmp: Path, kind: str | None = None) -> list[dict[str, Any]]:
    return [e for e in read_json_lines(tmp / "metrics.jsonl")
            if kind is None or e["event"] == kind]


def wait_world(tmp: Path, world: int, after: float = 0.0) -> dict[str, Any]:
    return wait_for_step(tmp / "metrics.jsonl", after=after, world_size=world, timeout=90)


def rank0(job: LocalJob) -> Node:
    return job.rank0_node()


def not_rank0(job: LocalJob) -> Node:
    return next(n for n in job.nodes if n.alive() and n.group_rank() not in (0, None))


def restores_after_the_first(tmp: Path) -> list[dict[str, Any]]:
    return events(tmp, "restore")[1:]


def redone(tmp: Path) -> int:
    steps = [e["step"] for e in events(tmp, "step")]
    return len(steps) - len(set(steps))


def per_step_batches(records: list[dict[str, Any]]) -> dict[int, list[int]]:
    """The global batch behind each committed step: from the last incarnation that
    recorded it (a rank whose peer failed after its share was reduced may not have)."""
    chosen: dict[int, list[int]] = {}
    for rec in records:  # in file order: later incarnations override earlier ones
        chosen[rec["step"]] = rec["batch"]
    return chosen


def uninterrupted_batches(steps: int) -> dict[int, list[int]]:
    """The global batch of each step of an uninterrupted run of ``BASE_ARGS``: what the
    trainer records as ``"batch"`` is ``ElasticLoop.global_ids``, ``next_batch``'s ids."""
    args = dict(zip(BASE_ARGS[::2], BASE_ARGS[1::2], strict=True))
    seed, size, batch = (int(args[k]) for k in ("--seed", "--dataset-size",
                                                  "--global-batch-size"))
    position, out = DataPosition(), {}
    for step in range(1, steps + 1):
        ids, position = next_batch(position, seed, batch, size)
        out[step] = ids.tolist()
    return out


STEPS = 600


@pytest.mark.timeout(300)
def test_deaths_and_a_join_with_a_directory_per_node_lose_at_most_the_step_in_flight(
        tmp_path: Path) -> None:
    # The joining node must arrive while the job still trains: its torchrun and warm-start
    # server took 22 s when two other tests ran on this 2-core machine (7 s and 15 s), and
    # it joined at step 361 on the suite's three workers; 585 steps leave room.
    with LocalJob(spec(tmp_path, steps=STEPS), tmp_path).start(3) as job:
        wait_world(tmp_path, 3)
        wait_until(lambda: events(tmp_path, "step")[-1]["step"] >= 15, 60, what="step 15")
        victim = not_rank0(job)
        victim.kill()
        after_death = wait_world(tmp_path, 2)
        job.add_node()  # its directory is empty: it can only get the state from its peers
        after_join = wait_world(tmp_path, 3, after=after_death["time"])
        wait_until(lambda: events(tmp_path, "step")[-1]["step"] >= after_join["step"] + 10, 60,
                   what="10 steps after the join")
        first_rank0 = rank0(job)
        first_rank0.kill()
        wait_world(tmp_path, 2, after=after_join["time"])
        survivors = [n for n in job.nodes if n.alive()]
        codes = [n.proc.wait(timeout=120) for n in survivors]
        assert codes == [0, 0], [n.proc.output()[-3000:] for n in survivors]
    # What the nodes kept in memory goes with their agents: the survivors' at the end, the
    # first victim's (SIGKILLed, it could not clean up) when the next agent started.
    for node in [victim, *survivors]:
        assert not list(node_memory_directory().glob(f"elastic-ext-ctl-{node.proc.pid}-*")), \
            node.name

    restores = restores_after_the_first(tmp_path)
    assert [r["world_size"] for r in restores] == [2, 3, 2]
    assert all(r["source"] in MEMORY for r in restores), restores
    assert all(r["bytes"] > 0 for r in restores)
    # the join: the old round stopped at a step boundary, for a membership change
    stopped = events(tmp_path, "stopped")
    assert len(stopped) == 1 and stopped[0]["reason"] == "membership"
    assert stopped[0]["kept"] == stopped[0]["step"] == restores[1]["step"]
    assert not events(tmp_path, "preempted")
    # lost work: a death costs at most the step in flight, the join nothing
    assert redone(tmp_path) <= 2, events(tmp_path, "step")
    starts = events(tmp_path, "start")
    assert starts[2]["resumed_from"] == stopped[0]["step"]
    # exactly once: the batches behind the model are an uninterrupted run's
    records = [e for e in read_json_lines(tmp_path / "samples.jsonl")]
    chosen = per_step_batches(records)
    expected = uninterrupted_batches(STEPS)
    assert sorted(chosen) == sorted(expected) == list(range(1, STEPS + 1))
    assert chosen == expected
    assert events(tmp_path, "done")[-1]["step"] == STEPS


@pytest.mark.timeout(420)
def test_at_three_ranks_a_killed_worker_a_frozen_node_and_a_whole_job_restart_cost_no_bit(
        tmp_path: Path, processes: ProcessSet) -> None:
    ref = reference(processes, tmp_path, 3, (*BASE_ARGS, "--steps", "150"))
    first = tmp_path / "first"
    with LocalJob(spec(tmp_path, nnodes="3:3", max_restarts=1), first).start(3) as job:
        wait_until(lambda: events(tmp_path, "step") and
                   events(tmp_path, "step")[-1]["step"] >= 20, 90, what="step 20")
        victim = not_rank0(job)
        worker = max(victim.worker_pids())  # the warm-started worker, forked after its launcher
        signal_pids([worker], signal.SIGKILL)
        wait_until(lambda: len(events(tmp_path, "start")) >= 2, 60, what="a second round")
        wait_until(lambda: events(tmp_path, "step")[-1]["step"] >= events(
            tmp_path, "start")[-1]["step"] + 10, 60, what="10 steps in the second round")
        frozen = not_rank0(job)
        frozen.freeze()
        wait_until(lambda: any("declared dead" in str(e) for n in job.nodes if n is not frozen
                               for e in n.events()), 30, what="the frozen node declared dead")
        thawed = time.time()
        frozen.thaw()
        # the round the woken node rejoined trains a few steps; then a preemption (SIGUSR2
        # to every worker, as SLURM's --signal=USR2 sends it) stops the whole job
        wait_until(lambda: events(tmp_path, "start")[-1]["time"] > thawed and
                   events(tmp_path, "step")[-1]["step"] >= events(
                       tmp_path, "start")[-1]["step"] + 5, 90,
                   what="5 steps in the round after the thaw")
        seen = events(tmp_path, "step")[-1]["step"]
        signal_pids([pid for n in job.nodes for pid in n.worker_pids()], signal.SIGUSR2)
        codes = [n.proc.wait(timeout=60) for n in job.nodes]
        assert codes == [0, 0, 0], [n.proc.output()[-3000:] for n in job.nodes]
    restores = restores_after_the_first(tmp_path)
    assert len(restores) >= 2 and all(r["source"] in MEMORY for r in restores), restores
    assert {e["world_size"] for e in events(tmp_path, "step")} == {3}
    assert redone(tmp_path) <= 2, events(tmp_path, "step")
    preempted = events(tmp_path, "preempted")
    assert len(preempted) == 1 and preempted[0]["signal"] == "SIGUSR2"
    step = preempted[0]["step"]
    assert step >= seen  # stopped at the boundary after the signal, not at an older step
    assert max(e["step"] for e in events(tmp_path, "step")) == step  # none past the boundary
    holders = [d.parent.name for d in tmp_path.glob("node*/snapshots")
               if (d / f"snapshot-{step:010d}.json").exists()]
    assert len(holders) == 1  # only the node of global rank 0 wrote it
    before = len(events(tmp_path, "step"))

    # A new job (new agents, a new etcd): the newest snapshot is on one node only.
    with LocalJob(spec(tmp_path, nnodes="3:3", run_id="handoff-2"), tmp_path / "second"
                  ).start(3) as job:
        codes = [n.proc.wait(timeout=120) for n in job.nodes]
        assert codes == [0, 0, 0], [n.proc.output()[-3000:] for n in job.nodes]
    restore = events(tmp_path, "restore")[-1]
    assert (restore["source"], restore["step"]) == ("disk", step)
    assert events(tmp_path, "start")[-1]["resumed_from"] == step
    # nothing redone: the new job trains each step after the preempted one once
    assert [e["step"] for e in events(tmp_path, "step")[before:]] == list(range(step + 1, 151))
    assert {e["world_size"] for e in events(tmp_path, "step")} == {3}
    assert events(tmp_path, "done")[-1]["params_sha256"] == ref.sha256
