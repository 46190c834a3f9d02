"""Fast failure handling with the bundled trainer: dead, hung and joining nodes.

Three local torchrun agents (``--nnodes=2:3``), one gloo worker each. Each test
injects one fault and checks that training goes on in the new world and reaches
``done``. Timings are measured by ``benchmarks/recovery.py``, not asserted here.

A death and a join on etcd are the chaos matrix's ``kill-rank0`` and ``join`` scenarios
(``tests/test_chaos_matrix.py``, in CI), which check the same and more, so here they run
on the embedded store only; the in-process branches of the handler and the keeper are in
``tests/test_handler_inprocess.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from elastic_ext.jsonlines import read_json_lines
from elastic_ext.local.job import JobSpec, LocalJob, Node, wait_for_step

pytestmark = pytest.mark.slow


def trainer_spec(tmp: Path, *, steps: int, store: str = "etcd", nnodes: str = "2:3",
                 delay: float = 0.05, max_restarts: int = 3, conf: str = "") -> JobSpec:
    command = ["-m", "trainer", "--steps", str(steps), "--global-batch-size", "12",
               "--snapshot-dir", str(tmp / "snapshots"), "--snapshot-every", "10",
               "--metrics", str(tmp / "metrics.jsonl"), "--step-delay", str(delay), "--seed", "3"]
    return JobSpec(command=command, store=store, nnodes=nnodes, run_id="failures",
                   max_restarts=max_restarts, rdzv_conf=conf)


def metrics(tmp: Path) -> Path:
    return tmp / "metrics.jsonl"


def done_event(tmp: Path) -> dict:
    return [e for e in read_json_lines(metrics(tmp)) if e["event"] == "done"][-1]


def victim(job: LocalJob, *, rank0: bool) -> Node:
    """A node to break: rank 0 or not, and never the embedded store's host."""
    host = job.store_host()
    for node in job.nodes:
        if node.alive() and node is not host and (node.group_rank() == 0) == rank0:
            return node
    raise LookupError("no suitable victim")


def finish_and_check(job: LocalJob, tmp: Path, survivors: list[Node], timeout: float = 120) -> None:
    codes = [n.proc.wait(timeout=timeout) for n in survivors]
    assert codes == [0] * len(survivors), [n.proc.output()[-3000:] for n in survivors]
    steps = [e["step"] for e in read_json_lines(metrics(tmp)) if e["event"] == "step"]
    assert done_event(tmp)["step"] == max(steps)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("store", ["embedded"])  # on etcd: the chaos matrix's "kill-rank0"
def test_a_dead_node_is_dropped_and_training_goes_on(tmp_path, store):
    with LocalJob(trainer_spec(tmp_path, steps=120, store=store), tmp_path).start(3) as job:
        wait_for_step(metrics(tmp_path), after=0, world_size=3, timeout=120)
        dead = victim(job, rank0=False)
        dead.kill()
        wait_for_step(metrics(tmp_path), after=0, world_size=2, timeout=60)
        finish_and_check(job, tmp_path, [n for n in job.nodes if n is not dead])


@pytest.mark.timeout(240)
def test_a_hung_node_is_dropped_and_rejoins_when_it_wakes(tmp_path):
    with LocalJob(trainer_spec(tmp_path, steps=200), tmp_path).start(3) as job:
        wait_for_step(metrics(tmp_path), after=0, world_size=3, timeout=120)
        hung = victim(job, rank0=False)
        hung.freeze()
        dropped = wait_for_step(metrics(tmp_path), after=0, world_size=2, timeout=60)
        hung.thaw()
        back = wait_for_step(metrics(tmp_path), after=dropped["time"], world_size=3, timeout=60)
        assert back["step"] > dropped["step"]
        finish_and_check(job, tmp_path, job.nodes)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("store", ["embedded"])  # on etcd: the chaos matrix's "join"
def test_a_node_started_mid_run_joins_the_training(tmp_path, store):
    # 300 steps: the newcomer (its torchrun and warm-start server take up to 10 s on a slow
    # machine) must arrive while the job still trains
    with LocalJob(trainer_spec(tmp_path, steps=300, store=store), tmp_path).start(2) as job:
        first = wait_for_step(metrics(tmp_path), after=0, world_size=2, timeout=120)
        job.add_node()
        joined = wait_for_step(metrics(tmp_path), after=first["time"], world_size=3, timeout=60)
        starts = [e for e in read_json_lines(metrics(tmp_path))
                  if e["event"] == "start" and e["world_size"] == 3]
        # the scale-up restart commits a snapshot first: no step is trained twice
        assert starts[0]["resumed_from"] == joined["step"] - 1
        finish_and_check(job, tmp_path, job.nodes)


@pytest.mark.timeout(240)
def test_below_the_minimum_the_survivor_waits_and_a_replacement_resumes_from_the_snapshot(tmp_path):
    spec = trainer_spec(tmp_path, steps=150, nnodes="2:3")
    with LocalJob(spec, tmp_path).start(2) as job:
        wait_for_step(metrics(tmp_path), after=0, world_size=2, timeout=120)
        dead = victim(job, rank0=False)
        snapshots_before = [e["step"] for e in read_json_lines(metrics(tmp_path))
                            if e["event"] == "snapshot"]
        dead.kill()
        survivor = next(n for n in job.nodes if n is not dead)
        replacement = job.add_node()
        resumed = wait_for_step(metrics(tmp_path), after=0, world_size=2, timeout=90)
        starts = [e for e in read_json_lines(metrics(tmp_path)) if e["event"] == "start"]
        assert starts[-1]["resumed_from"] is None or starts[-1]["resumed_from"] >= max(
            snapshots_before, default=0)
        assert resumed
        finish_and_check(job, tmp_path, [survivor, replacement])


@pytest.mark.timeout(180)
def test_survivors_exit_with_a_clear_error_when_the_embedded_store_host_dies(tmp_path):
    spec = trainer_spec(tmp_path, steps=100000, store="embedded",
                        conf="connect_timeout=5")
    with LocalJob(spec, tmp_path).start(3) as job:
        wait_for_step(metrics(tmp_path), after=0, world_size=3, timeout=120)
        host = job.store_host()
        assert host is not None
        host.kill()
        others = [n for n in job.nodes if n is not host]
        codes = [n.proc.wait(timeout=120) for n in others]
    assert all(code != 0 for code in codes)
    assert all("embedded c10d store" in n.proc.output() for n in others), \
        others[0].proc.output()[-3000:]
