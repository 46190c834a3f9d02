"""A straggler found and left out: real etcd, three torchrun agents, the bundled trainer on
gloo, and one node's workers slowed by the chaos harness's ``slow`` fault.

What only these can prove: DDP's own compute time reaches the agents through the beacons
and the heartbeats, the node that watches everyone names the slow node within seconds
(``straggler_for``), ``straggler=drop`` leaves it out as on a settled preemption notice
(its agent exits 0, the others restart for free from the step kept in node memory: no
step trained twice, the data read on exactly once) and the two that are left train more
samples per second than the three did while one was slow.

The step is compute-bound on purpose (a batch of 1600 samples a rank, no step delay): the
gain ``straggler=drop`` estimates counts only the excess of the slow node's own compute
(``protocol/straggler.py``), so a step made mostly of sleep or overhead would never pay.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from elastic_ext.chaos.inject import Injector
from elastic_ext.chaos.scenario import parse
from elastic_ext.jsonlines import read_json_lines
from elastic_ext.local.job import JobSpec, LocalJob, Node, wait_for_step
from elastic_ext.local.processes import wait_until
from elastic_ext.rendezvous.agent.events import EventKind
from tests.support.stragglers import node_id, positions, slow_events, steps_per_second

pytestmark = [pytest.mark.slow, pytest.mark.etcd, pytest.mark.quiet]

STEPS = 300
SLOW_AT = 40  # steps at full speed first: the paces of a round's first steps do not count
BATCH, DATASET, SEED = 4800, 19200, 7
SLOW = "to 1/5 every 25ms"  # its own compute ~5x: a gain well above 1 even on a busy machine
STRAGGLER_FOR = 3


def spec(tmp: Path) -> JobSpec:
    command = ["-m", "trainer", "--steps", str(STEPS), "--global-batch-size", str(BATCH),
               "--dataset-size", str(DATASET), "--seed", str(SEED), "--model-size", "small",
               "--metrics", str(tmp / "metrics.jsonl"), "--progress-every", "0"]
    return JobSpec(command=command, nnodes="2:3", run_id="straggler", max_restarts=0,
                   rdzv_conf=f"last_call_timeout=5,straggler=drop,"
                             f"straggler_for={STRAGGLER_FOR}")


def events(tmp: Path, kind: str) -> list[dict[str, Any]]:
    return [e for e in read_json_lines(tmp / "metrics.jsonl") if e["event"] == kind]


def explain(job: LocalJob) -> str:
    """What the agents decided and how each ended, for an assertion's message."""
    seen = [(n.name, e["event"], e.get("message", "")[:160]) for n in job.nodes
            for e in n.events() if e["event"] not in ("started",)]
    outputs = [f"== {n.name}\n{n.proc.output()[-1500:]}" for n in job.nodes]
    return f"{seen}\n" + "\n".join(outputs)


@pytest.mark.timeout(180)
def test_a_straggler_is_named_left_out_and_the_others_train_faster(tmp_path: Path) -> None:
    began = time.monotonic()
    metrics = tmp_path / "metrics.jsonl"
    with LocalJob(spec(tmp_path), tmp_path).start(3) as job:
        wait_for_step(metrics, after=0.0, world_size=3, timeout=90)
        wait_until(lambda: events(tmp_path, "step")[-1]["step"] >= SLOW_AT, 60,
                   what=f"step {SLOW_AT}")
        slow: Node = next(n for n in job.nodes if n.group_rank() not in (0, None))
        name = node_id(slow)
        assert name is not None
        injector = Injector(job, initial_nodes=3, snapshot_dir=tmp_path)
        fault = parse(f"at step 1: slow node {job.nodes.index(slow)} {SLOW}\n").faults[0]
        record, undo = injector.inject(fault)
        assert undo is not None
        try:
            try:
                named = wait_until(lambda: slow_events(job.nodes, name), 60,
                                   what=f"a slow event naming {slow.name}")[0]
                left = wait_until(lambda: slow.events(EventKind.LEFT_ON_NOTICE), 30,
                                  what=f"{slow.name} to leave")[0]
                code = slow.proc.wait(timeout=30)
            except TimeoutError as exc:
                raise AssertionError(f"{exc}\n{explain(job)}") from None
            named_after = float(named["time"]) - record.time
            assert named["dropped"] and named["gain"] > 1.0, named
            assert named["own_s"] > 1.5 * named["others_s"], named
            assert "straggler" in left["why"], left
            assert code == 0, explain(job)
            others = [n for n in job.nodes if n is not slow]
            codes = [n.proc.wait(timeout=90) for n in others]
            assert codes == [0, 0], explain(job)
        finally:
            undo.run()
    steps = events(tmp_path, "step")
    numbers = [e["step"] for e in steps]
    assert len(numbers) == len(set(numbers)), "a finished step was trained twice"
    done = events(tmp_path, "done")
    assert done and done[-1]["step"] == STEPS and done[-1]["world_size"] == 2, done
    assert [(e["world_size"], e["source"]) for e in events(tmp_path, "restore")] == \
        [(3, "none"), (2, "local")]  # the step kept in node memory: nothing trained again
    assert {e["step"]: (e["epoch"], e["offset"]) for e in steps} == positions(
        STEPS, seed=SEED, global_batch_size=BATCH, dataset_size=DATASET)

    first_of_two = min(float(e["time"]) for e in steps if e["world_size"] == 2)
    slowed = steps_per_second(steps, record.time + 1.0, float(named["time"]))
    after = steps_per_second(steps, first_of_two + 0.3, float(done[-1]["time"]))
    assert slowed is not None and after is not None, (slowed, after)
    assert after > 1.25 * slowed, (f"{BATCH * after:.0f} samples/s on two nodes, "
                                   f"{BATCH * slowed:.0f} on three with one slow")
    print(f"straggler named {named_after:.1f}s after the slowdown "
          f"(own {named['own_s']:.3f}s, others {named['others_s']:.3f}s, "
          f"gain {named['gain']:.2f}); samples/s slowed {BATCH * slowed:.0f}, "
          f"after the drop {BATCH * after:.0f}; wall {time.monotonic() - began:.1f}s")
