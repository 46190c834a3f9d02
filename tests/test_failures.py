"""Fast failure handling with the bundled trainer: joining, dead and lone nodes.

Local torchrun agents (``--nnodes=2:3``), one gloo worker each, on the embedded store or
etcd. Each test checks that training goes on in the new world and reaches ``done``.
Timings are measured by ``benchmarks/recovery.py``, not asserted here.

- One job on the embedded store, under ``--max-restarts=0``, goes through a join, a
  death, and a death that leaves the store's host alone below the minimum, then gets a
  replacement: a scale-up commits first (the world of 3 resumes at the step the world of
  2 stopped at), the first dead node was warm (its worker forked by its server) and
  every process of it is gone within a second (this was
  ``tests/test_warm_lifecycle.py``'s job of its own, 18 s), each death costs at most the
  step in flight, the lone host forms no round of one and trains nothing
  while it waits (seconds, longer than the last call that would close such a round),
  and the round with the replacement resumes from the last step trained before the
  death. Everyone left finishes with exit 0 and ``done`` at the last step. That job
  (4 agents) replaces three that started 9 between them: a death, a join, and a
  survivor below the minimum (on etcd, with a resume check that any step before the
  death met).
  A node alone below the minimum on etcd is ``tests/test_e2e_rendezvous.py``'s join
  timeout test: it never gets a round.
- A hung node that is dropped and rejoins when it wakes had a job of its own here (42 s
  of the suite). It repeated two others: ``tests/test_stuck_paths.py``'s frozen node is
  dropped while the others train on to the end, and ``tests/test_handoff_e2e.py``'s
  frozen node is declared dead, wakes, and trains again in the next round.
- The embedded store's host dies: the three agents (ranks 0, 1 and 2) exit with a clear
  error. That job also proves what ``tests/test_e2e_rendezvous.py``'s plain run of three
  agents on the embedded store did: they rendezvous with distinct ranks and train.

A death and a join on etcd, with a directory per node and exactly-once data, are
``tests/test_handoff_e2e.py``'s; the chaos matrix's ``kill-rank0`` and ``join``
scenarios are not in its CI subset (``elastic_ext.chaos.matrix.CI``). The in-process
branches of the handler and the keeper are in ``tests/test_handler_inprocess.py``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from elastic_ext.jsonlines import read_json_lines
from elastic_ext.local.job import JobSpec, LocalJob, Node, wait_for_step
from elastic_ext.local.processes import wait_until
from elastic_ext.rendezvous.agent.events import EventKind
from tests.support.warm_procs import GONE_WITHIN_S, assert_gone_within, assert_warm

pytestmark = pytest.mark.slow

LAST_CALL_S = 1.0  # the default last_call_timeout: how soon a round of one would close


def trainer_spec(tmp: Path, *, steps: int, store: str = "etcd", nnodes: str = "2:3",
                 delay: float = 0.05, max_restarts: int = 3, conf: str = "") -> JobSpec:
    command = ["-m", "trainer", "--steps", str(steps), "--global-batch-size", "12",
               "--snapshot-dir", str(tmp / "snapshots"), "--snapshot-every", "10",
               "--metrics", str(tmp / "metrics.jsonl"), "--step-delay", str(delay), "--seed", "3"]
    return JobSpec(command=command, store=store, nnodes=nnodes, run_id="failures",
                   max_restarts=max_restarts, rdzv_conf=conf)


def metrics(tmp: Path) -> Path:
    return tmp / "metrics.jsonl"


def events(tmp: Path, kind: str) -> list[dict[str, Any]]:
    return [e for e in read_json_lines(metrics(tmp)) if e["event"] == kind]


def done_event(tmp: Path) -> dict:
    return events(tmp, "done")[-1]


def victim(job: LocalJob, *, rank0: bool) -> Node:
    """A node to break: rank 0 or not, and never the embedded store's host."""
    host = job.store_host()
    for node in job.nodes:
        if node.alive() and node is not host and (node.group_rank() == 0) == rank0:
            return node
    raise LookupError("no suitable victim")


def wait_for_start(tmp: Path, *, after: float, world_size: int, timeout: float) -> dict[str, Any]:
    """The first ``start`` event logged after ``after`` at ``world_size``: a new round's."""
    def found() -> dict[str, Any] | None:
        return next((e for e in events(tmp, "start")
                     if e["time"] > after and e["world_size"] == world_size), None)
    return wait_until(found, timeout, what=f"a round of world size {world_size}")


def check_resumed(tmp: Path, start: dict[str, Any]) -> None:
    """A round after a death lost at most the step in flight: it resumes from the last
    step logged before it, or from the one after (trained everywhere, but not logged
    yet when rank 0 died)."""
    evs = read_json_lines(metrics(tmp))
    last = max(e["step"] for e in evs[:evs.index(start)] if e["event"] == "step")
    assert last <= start["resumed_from"] <= last + 1, (last, start)


def kill(node: Node) -> float:
    """SIGKILL ``node``; the time just before."""
    at = time.time()
    node.kill()
    return at


def finish_and_check(job: LocalJob, tmp: Path, survivors: list[Node], timeout: float = 120) -> None:
    codes = [n.proc.wait(timeout=timeout) for n in survivors]
    assert codes == [0] * len(survivors), [n.proc.output()[-3000:] for n in survivors]
    steps = [e["step"] for e in events(tmp, "step")]
    assert done_event(tmp)["step"] == max(steps)


@pytest.mark.timeout(300)
def test_a_join_two_deaths_and_a_replacement_below_the_minimum_on_the_embedded_store(tmp_path):
    # 450 steps: the newcomer must arrive while the job still trains (its torchrun and
    # warm-start server joined at step 197 on the suite's three workers)
    spec = trainer_spec(tmp_path, steps=450, store="embedded", max_restarts=0)
    with LocalJob(spec, tmp_path).start(2) as job:
        first = wait_for_step(metrics(tmp_path), after=0, world_size=2, timeout=120)
        host = job.store_host()
        assert host is not None  # never killed: the others cannot go on without the store

        # a join: the scale-up restart commits a snapshot first, no step is trained twice
        job.add_node()
        joined = wait_for_step(metrics(tmp_path), after=first["time"], world_size=3, timeout=60)
        starts = [e for e in events(tmp_path, "start") if e["world_size"] == 3]
        assert starts[0]["resumed_from"] == joined["step"] - 1

        # a death: the whole node goes at once, warm-start server and forked worker with
        # it, and the world of 2 trains on (under --max-restarts=0: not charged)
        dead = victim(job, rank0=False)
        assert_warm(dead.proc, dead.proc.pid, nproc=1)
        since = time.monotonic()
        killed_at = kill(dead)
        assert_gone_within(dead.proc, GONE_WITHIN_S, since)
        start = wait_for_start(tmp_path, after=killed_at, world_size=2, timeout=90)
        check_resumed(tmp_path, start)
        wait_for_step(metrics(tmp_path), after=start["time"], world_size=2, timeout=60)

        # the other death leaves the host alone, below the minimum: it waits in the
        # rendezvous, and only then does a replacement start
        killed_at = kill(next(n for n in job.nodes if n.alive() and n is not host))
        alone = wait_until(lambda: next((e for e in host.events(EventKind.RESTART)
                                         if e["time"] > killed_at), None),
                           60, what="the host back in the rendezvous, alone")
        replacement = job.add_node()
        check_resumed(tmp_path, wait_for_start(tmp_path, after=killed_at, world_size=2,
                                               timeout=90))
        finish_and_check(job, tmp_path, [host, replacement])

    # Alone, the host formed no round and trained nothing: its next round is the one with
    # the replacement, and it waited for it longer than a round of one would have.
    rejoined = next(e for e in host.events(EventKind.JOINED) if e["time"] > alone["time"])
    assert rejoined["world_size"] == 2
    assert rejoined["time"] - alone["time"] > LAST_CALL_S, (alone, rejoined)
    assert all(e["world_size"] >= 2 for n in job.nodes for e in n.events(EventKind.JOINED))
    assert {e["world_size"] for e in events(tmp_path, "step")} == {2, 3}


@pytest.mark.timeout(180)
def test_survivors_exit_with_a_clear_error_when_the_embedded_store_host_dies(tmp_path):
    spec = trainer_spec(tmp_path, steps=100000, store="embedded",
                        conf="connect_timeout=5")
    with LocalJob(spec, tmp_path).start(3) as job:
        wait_for_step(metrics(tmp_path), after=0, world_size=3, timeout=120)
        # three agents on the embedded store: distinct ranks, and they train
        assert {n.group_rank() for n in job.nodes} == {0, 1, 2}
        host = job.store_host()
        assert host is not None
        host.kill()
        others = [n for n in job.nodes if n is not host]
        codes = [n.proc.wait(timeout=120) for n in others]
    assert all(code != 0 for code in codes)
    assert all("embedded c10d store" in n.proc.output() for n in others), \
        others[0].proc.output()[-3000:]
