"""Ranks that hold different steps agree on the newest, and its lowest holder sends it.

Three real gloo ranks on loopback, each with a node-memory directory and a snapshot
directory of its own (nothing shared), seeded with the steps the test chooses.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from elastic_ext.local.processes import ProcessSet
from elastic_ext.net import free_port

pytestmark = pytest.mark.timeout(120)

SCRIPT = Path(__file__).parent / "support" / "handoff_ranks.py"


def run_ranks(processes: ProcessSet, tmp: Path,
              specs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    port = free_port("127.0.0.1")
    procs = []
    for rank, spec in enumerate(specs):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "RANK": str(rank), "WORLD_SIZE": str(len(specs)), "LOCAL_RANK": "0",
               "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parent.parent)}
        procs.append(processes.spawn(f"rank{rank}", [sys.executable, str(SCRIPT), json.dumps(spec),
                                                     str(tmp / f"mem{rank}"),
                                                     str(tmp / f"disk{rank}")], env=env))
    results = []
    for proc in procs:
        assert proc.wait(90) == 0, proc.output()[-4000:]
        line = next(x for x in proc.output().splitlines() if x.startswith("{"))
        results.append(json.loads(line))
    return results


def test_ranks_holding_different_steps_all_continue_from_the_newest(
        processes: ProcessSet, tmp_path: Path) -> None:
    results = run_ranks(processes, tmp_path, [
        {"memory": [5, 5.0], "disk": [4, 4.0]},
        {"memory": [7, 7.0], "disk": None},
        {"memory": None, "disk": [6, 6.0]},
    ])
    assert [r["step"] for r in results] == [7, 7, 7]
    assert [r["values"] for r in results] == [[7.0]] * 3
    assert [r["source"] for r in results] == ["peer", "local", "peer"]
    assert [r["data"] for r in results] == [{"step": 7}] * 3


def test_a_newer_snapshot_on_one_node_reaches_every_rank(processes: ProcessSet,
                                                         tmp_path: Path) -> None:
    results = run_ranks(processes, tmp_path, [
        {"memory": None, "disk": None},
        {"memory": [5, 5.0], "disk": [4, 4.0]},
        {"memory": None, "disk": [9, 9.0]},
    ])
    assert [(r["step"], r["source"], r["values"]) for r in results] == [(9, "disk", [9.0])] * 3


def test_holders_of_one_step_with_different_states_are_not_trusted(processes: ProcessSet,
                                                                   tmp_path: Path) -> None:
    results = run_ranks(processes, tmp_path, [
        {"memory": [8, 8.0], "disk": None},
        {"memory": [8, 8.5], "disk": None},
        {"memory": None, "disk": [6, 6.0]},
    ])
    assert [(r["step"], r["values"]) for r in results] == [(6, [6.0])] * 3
    assert "hold different states" in processes.procs[0].output()


def test_when_every_rank_holds_the_step_nothing_is_sent(processes: ProcessSet,
                                                        tmp_path: Path) -> None:
    results = run_ranks(processes, tmp_path, [{"memory": [3, 3.0], "disk": None}] * 3)
    assert [(r["step"], r["source"], r["values"]) for r in results] == [(3, "local", [3.0])] * 3
