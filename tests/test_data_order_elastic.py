"""Exactly-once data through restarts and world-size changes: 2 -> 3 -> 2 ranks.

The first run is SIGKILLed a few steps after a snapshot (so those steps are trained
twice: once in vain, once again after the restart), the second, at 3 ranks, is
preempted with SIGUSR2, the third, at 2 ranks, finishes. Every rank records the ids
of the samples it trained on; the samples behind the committed model must be exactly
those of an uninterrupted 2-rank run, step by step, each once per epoch.
"""

from __future__ import annotations

import json
import signal
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from elastic_ext.jsonlines import read_json_lines
from elastic_ext.local.processes import ProcessSet, signal_pids
from tests.support.trainer_runs import (
    BASE_ARGS,
    env,
    finish,
    of,
    reference,
    run_to_end,
    torchrun_cmd,
    wait_event,
    worker_pids,
)

pytestmark = pytest.mark.slow  # starts torchrun agents


def _per_step(records: list[dict[str, Any]]) -> dict[int, list[int]]:
    """Global ids of each step, taking for each step the last incarnation that completed it.

    An incarnation (one start of the workers) completed a step when every one of its
    ranks recorded it. A step redone after a crash is taken from the redo.
    """
    by_incarnation: dict[str, dict[int, dict[int, list[int]]]] = defaultdict(
        lambda: defaultdict(dict))
    world: dict[str, int] = {}
    order: list[str] = []
    for rec in records:
        inc = rec["incarnation"]
        if inc not in world:
            order.append(inc)
            world[inc] = rec["world_size"]
        by_incarnation[inc][rec["step"]][rec["rank"]] = rec["ids"]
    chosen: dict[int, list[int]] = {}
    for inc in order:  # later incarnations override earlier ones
        for step, ranks in by_incarnation[inc].items():
            if len(ranks) == world[inc]:
                chosen[step] = [i for r in sorted(ranks) for i in ranks[r]]
    return chosen


def _epochs(records: list[dict[str, Any]], chosen: dict[int, list[int]]) -> dict[int, list[int]]:
    epoch_of = {rec["step"]: rec["epoch"] for rec in records}
    out: dict[int, list[int]] = defaultdict(list)
    for step, ids in sorted(chosen.items()):
        out[epoch_of[step]].extend(ids)
    return out


@pytest.mark.timeout(200)
def test_two_three_two_ranks_train_on_exactly_the_uninterrupted_samples(
        processes: ProcessSet, tmp_path: Path) -> None:
    ref = reference(processes, tmp_path, 2)
    snaps, metrics, samples = tmp_path / "snaps", tmp_path / "m.jsonl", tmp_path / "samples.jsonl"
    args = [*BASE_ARGS, "--snapshot-dir", str(snaps), "--metrics", str(metrics),
            "--record-samples", str(samples)]

    # 2 ranks, SIGKILLed three or more steps past the snapshot of step 10.
    a = processes.spawn("two",
                        torchrun_cmd(2, *args, "--snapshot-every", "10", "--step-delay", "0.1"),
                        env=env())
    wait_event(metrics, lambda e: e["event"] == "snapshot" and e["step"] == 10, 60, a,
               "snapshot 10")
    wait_event(metrics, lambda e: e["event"] == "step" and e["step"] >= 13, 30, a, "step 13")
    a.kill()
    finish(a, 10)
    killed_at = max(e["step"] for e in of(read_json_lines(metrics), "step"))
    assert 13 <= killed_at < 20

    # 3 ranks, from step 10, preempted a few steps later.
    b = processes.spawn("three",
                        torchrun_cmd(3, *args, "--snapshot-every", "4", "--step-delay", "0.1"),
                        env=env())
    start_b = wait_event(metrics, lambda e: e["event"] == "start" and e["world_size"] == 3, 60, b,
                         "3 ranks")
    assert start_b["resumed_from"] == 10
    wait_event(metrics, lambda e: e["event"] == "step" and e["world_size"] == 3 and e["step"] >= 16,
               30, b, "step 16 at 3 ranks")
    signal_pids(worker_pids(b, 3).values(), signal.SIGUSR2)
    assert finish(b, 30) == 0
    preempted = of(read_json_lines(metrics), "preempted")[-1]["step"]
    assert preempted >= 16

    # 2 ranks again, to the end.
    run_to_end(processes, "two-again", torchrun_cmd(2, *args, "--snapshot-every", "10"), timeout=90)
    evs = read_json_lines(metrics)
    assert [(e["world_size"], e["resumed_from"]) for e in of(evs, "start")] == [
        (2, None), (3, 10), (2, preempted)]

    records = [json.loads(line) for line in samples.read_text().splitlines()]
    chosen = _per_step(records)
    expected = _per_step(ref.samples)
    assert sorted(expected) == list(range(1, 41))
    assert sorted(chosen) == list(range(1, 41))
    redone = {rec["step"] for rec in records
              if rec["world_size"] == 2 and 10 < rec["step"] <= killed_at}
    assert redone, "the kill should have cost some steps that were then trained again"
    for step in expected:
        assert chosen[step] == expected[step], f"step {step} trained on other samples"
    for epoch, ids in _epochs(records, chosen).items():
        assert len(ids) == len(set(ids)) == 140, f"epoch {epoch}: a sample twice or missing"
    assert _epochs(records, chosen) == _epochs(ref.samples, expected)
    assert len(of(evs, "done")) == 1
