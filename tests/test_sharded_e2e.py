"""Sharded state (FSDP2, HSDP) end to end: real etcd, real torchrun agents, gloo on CPU.

What only these can prove: under the agents' rounds, a sharded job that loses a node
reshards to the new world from the survivors' memory (no snapshot directory at all),
grows back when a node joins, trains no finished step twice, and its data order stays
exactly once; the parameters equal those of an uninterrupted run of the same world-size
sequence where the reduction order is the same (see each test).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from elastic_ext.jsonlines import read_json_lines
from elastic_ext.local.job import JobSpec, LocalJob, Node, wait_for_step
from elastic_ext.local.processes import ProcessSet, wait_until
from elastic_ext.net import free_port
from tests.support.trainer_runs import _TORCHRUN, BASE_ARGS, PY, env, run_to_end, torchrun_cmd
from tests.test_handoff_e2e import per_step_batches, uninterrupted_batches

pytestmark = pytest.mark.slow

STEPS = 400


def spec(tmp: Path, shard: str, nproc: int, steps: int = STEPS) -> JobSpec:
    command = ["-m", "trainer", *BASE_ARGS, "--steps", str(steps), "--shard", shard,
               "--metrics", str(tmp / "metrics.jsonl"), "--record-samples",
               str(tmp / "samples.jsonl"), "--step-delay", "0.05"]
    return JobSpec(command=command, nnodes="2:3", nproc_per_node=nproc, run_id=f"shard-{shard}",
                   max_restarts=0, rdzv_conf="last_call_timeout=5")


def events(tmp: Path, kind: str) -> list[dict[str, Any]]:
    return [e for e in read_json_lines(tmp / "metrics.jsonl") if e["event"] == kind]


def not_rank0(job: LocalJob) -> Node:
    return next(n for n in job.nodes if n.alive() and n.group_rank() not in (0, None))


def run_losses_and_a_join(tmp: Path, shard: str, nproc: int) -> list[dict[str, Any]]:
    """3 nodes; kill one that is not rank 0's, a node joins, kill rank 0's node; the
    restores after the first."""
    with LocalJob(spec(tmp, shard, nproc), tmp).start(3) as job:
        metrics = tmp / "metrics.jsonl"
        wait_for_step(metrics, after=0.0, world_size=3 * nproc, timeout=90)
        wait_until(lambda: events(tmp, "step")[-1]["step"] >= 15, 60, what="step 15")
        not_rank0(job).kill()
        after_death = wait_for_step(metrics, after=0.0, world_size=2 * nproc, timeout=90)
        job.add_node()
        after_join = wait_for_step(metrics, after=after_death["time"], world_size=3 * nproc,
                                   timeout=90)
        wait_until(lambda: events(tmp, "step")[-1]["step"] >= after_join["step"] + 10, 60,
                   what="10 steps after the join")
        job.rank0_node().kill()
        wait_for_step(metrics, after=after_join["time"], world_size=2 * nproc, timeout=90)
        survivors = [n for n in job.nodes if n.alive()]
        codes = [n.proc.wait(timeout=180) for n in survivors]
        assert codes == [0, 0], [n.proc.output()[-3000:] for n in survivors]
    return events(tmp, "restore")[1:]


def check_no_step_twice_and_exactly_once(tmp: Path, restores: list[dict[str, Any]],
                                         nproc: int) -> None:
    assert [r["world_size"] for r in restores] == [2 * nproc, 3 * nproc, 2 * nproc]
    # From memory, never a disk (there is none): "peer" when chunks moved between ranks,
    # "local" when each rank's node held all it needed (an HSDP twin's own set, or a buddy
    # copy of the lost node's shard that is now this rank's).
    assert all(r["source"] in ("peer", "local") for r in restores), restores
    steps = [e["step"] for e in events(tmp, "step")]
    assert len(steps) == len(set(steps)), "a finished step was trained twice"
    chosen = per_step_batches(read_json_lines(tmp / "samples.jsonl"))
    assert chosen == uninterrupted_batches(STEPS)
    assert events(tmp, "done")[-1]["step"] == STEPS


def launcher() -> list[str]:
    return [str(_TORCHRUN)] if _TORCHRUN.exists() else [PY, "-m", "torch.distributed.run"]


def run_nodes_to_end(processes: ProcessSet, name: str, nnodes: int, per_node: int,
                     args: list[str], timeout: float) -> None:
    """``nnodes`` stock torchrun agents of ``per_node`` ranks each, on loopback, meeting
    over c10d (the first one hosts its store): a multi-node job on one machine. One
    deadline for them all; fails as soon as one fails, with its log (``processes``
    kills the rest)."""
    endpoint = f"127.0.0.1:{free_port('127.0.0.1')}"
    nodes = [processes.spawn(f"{name}-node{i}", [
        *launcher(), f"--nnodes={nnodes}", f"--nproc-per-node={per_node}",
        "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={name}",
        f"--rdzv-conf=is_host={i == 0},join_timeout={int(timeout)}",
        "--local-addr=127.0.0.1", "--max-restarts=0", "-m", "trainer", *args], env=env())
        for i in range(nnodes)]

    def ended() -> list[int | None] | None:
        codes = [n.popen.poll() for n in nodes]
        done = all(c is not None for c in codes) or any(c not in (None, 0) for c in codes)
        return codes if done else None
    codes = wait_until(ended, timeout, what=f"{name}'s {nnodes} agents to end")
    failed = [(n.name, c, n.output()[-4000:]) for n, c in zip(nodes, codes, strict=True)
              if c != 0]
    assert not failed, failed


def replay(processes: ProcessSet, tmp: Path, segments: list[tuple[int, int | None]],
           shard: str, per_node: int | None = None) -> str:
    """The same training without faults: each segment (world size, last step) under stock
    torchrun, the next one resharding the previous one's DCP snapshot from disk; the
    final parameters' sha256. One agent of every rank, or (``per_node``) world/per_node
    agents of ``per_node`` ranks: HSDP's mesh is (nodes, LOCAL_WORLD_SIZE), so a replay
    must have the job's nodes to reduce in its order."""
    out = tmp / "replay"
    for world, last in segments:
        args = ["--steps", str(STEPS), "--shard", shard, "--snapshot-dir", str(out / "dcp"),
                "--metrics", str(out / "metrics.jsonl"), "--progress-every", "0"]
        if last is not None:
            args += ["--stop-at", str(last)]
        name = f"replay-{world}-{last}"
        if per_node is None:
            run_to_end(processes, name, torchrun_cmd(world, *BASE_ARGS, *args), timeout=120)
        else:
            run_nodes_to_end(processes, name, world // per_node, per_node,
                             [*BASE_ARGS, *args], timeout=120)
    done = [e for e in read_json_lines(out / "metrics.jsonl") if e["event"] == "done"]
    assert done[-1]["step"] == STEPS
    return str(done[-1]["params_sha256"])


def replay_segments(restores: list[dict[str, Any]], first_world: int
                    ) -> list[tuple[int, int | None]]:
    """(world size, last step) of each generation that the run kept: a generation ends
    at the step the next one restored (what a fault trained after it was dropped)."""
    worlds = [first_world, *(r["world_size"] for r in restores)]
    ends: list[int | None] = [r["step"] for r in restores]
    return list(zip(worlds, [*ends, None], strict=True))


@pytest.mark.timeout(420)
def test_full_sharding_reshards_from_the_survivors_memory_without_a_snapshot_dir(
        tmp_path: Path, processes: ProcessSet) -> None:
    restores = run_losses_and_a_join(tmp_path, "fsdp", 1)
    check_no_step_twice_and_exactly_once(tmp_path, restores, 1)
    # Bit-exact against the same world sizes over the same steps without a fault: the
    # reshards from memory lose nothing, and gloo reduces in the same order at the same
    # world size (the kept step a fault trained again does not count: it was dropped).
    final = events(tmp_path, "done")[-1]["params_sha256"]
    assert replay(processes, tmp_path, replay_segments(restores, 3), "fsdp") == final


@pytest.mark.timeout(420)
def test_hsdp_hands_off_from_the_replicas_on_the_surviving_nodes(
        tmp_path: Path, processes: ProcessSet) -> None:
    """Bit-exact against a fault-free replay of the same world sizes with a stock torchrun
    agent of 2 ranks for each node the job had: the same (nodes, 2) mesh, global rank r
    at (r // 2, r % 2) in both (torchrun numbers a node's ranks together), so each rank
    draws the same samples, each node reduce-scatters the same gradients over the same 2
    ranks and gloo all-reduces them over the same nodes in the same order; and a restore
    from a twin's replica loses nothing (the replicas are bit-identical). One agent of 6
    or 4 ranks, a (1, n) mesh, reduces in another order and ends with other bits."""
    restores = run_losses_and_a_join(tmp_path, "hsdp", 2)
    check_no_step_twice_and_exactly_once(tmp_path, restores, 2)
    final = events(tmp_path, "done")[-1]["params_sha256"]
    assert replay(processes, tmp_path, replay_segments(restores, 6), "hsdp",
                  per_node=2) == final


EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "fsdp2_loop.py"


def run_example(processes: ProcessSet, tmp: Path, nproc: int, steps: int) -> None:
    cmd = [*launcher(), "--standalone", f"--nproc-per-node={nproc}", str(EXAMPLE),
           "--steps", str(steps), "--snapshot-dir", str(tmp / "snapshots"),
           "--snapshot-every", "5", "--metrics", str(tmp / "metrics.jsonl")]
    run_to_end(processes, f"fsdp2-example-{nproc}", cmd, timeout=120)


@pytest.mark.timeout(300)
def test_a_whole_job_restart_resumes_the_fsdp2_example_from_dcp_at_another_world_size(
        tmp_path: Path, processes: ProcessSet) -> None:
    """No agent, no node memory: stock torchrun twice, 2 ranks then 3. The second job
    reshards the first one's last DCP snapshot, which torch's own tools read too."""
    run_example(processes, tmp_path, 2, 8)
    snapshot = tmp_path / "snapshots" / "dcp-0000000008"
    assert (snapshot / ".metadata").is_file()
    assert sorted(p.name for p in (tmp_path / "snapshots").iterdir()) == [
        "dcp-0000000005", "dcp-0000000008"]
    run_example(processes, tmp_path, 3, 12)
    restore = events(tmp_path, "restore")[-1]
    assert (restore["source"], restore["step"], restore["world_size"]) == ("disk", 8, 3)
    steps = [(e["step"], e["world_size"]) for e in events(tmp_path, "step")]
    assert steps == [(s, 2) for s in range(1, 9)] + [(s, 3) for s in range(9, 13)]
    # torch's own converter reads the snapshot as one full state dict
    full = tmp_path / "full.pt"
    dcp_to_torch_save(snapshot, full)
    state = torch.load(full, weights_only=False)
    assert tuple(state["model"]["blocks.0.ff.0.weight"].shape) == (128, 32)
    assert "optimizer" in state
