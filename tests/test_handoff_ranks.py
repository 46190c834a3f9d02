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


def run_ranks(processes: ProcessSet, tmp: Path, specs: list[dict[str, Any]],
              label: str = "") -> list[dict[str, Any]]:
    """One process per spec; ``label`` names a second run's logs apart from the first's."""
    port = free_port("127.0.0.1")
    procs = []
    for rank, spec in enumerate(specs):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "RANK": str(rank), "WORLD_SIZE": str(len(specs)), "LOCAL_RANK": "0",
               "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parent.parent)}
        command = [sys.executable, str(SCRIPT), json.dumps(spec), str(tmp / f"mem{rank}"),
                   str(tmp / f"disk{rank}")]
        procs.append(processes.spawn(f"{label}rank{rank}", command, env=env))
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


def test_only_the_rank_that_lacks_the_copy_receives_it_a_chunk_at_a_time(
        processes: ProcessSet, tmp_path: Path) -> None:
    chunk = 256
    results = run_ranks(processes, tmp_path, [
        {"memory": [7, 7.0], "disk": None, "chunk": chunk},
        {"memory": None, "disk": [6, 6.0], "chunk": chunk},
        {"memory": [7, 7.0], "disk": None, "chunk": chunk},
    ])
    assert [(r["step"], r["source"], r["values"]) for r in results] == [
        (7, "local", [7.0]), (7, "peer", [7.0]), (7, "local", [7.0])]
    size = results[1]["bytes"]
    chunks = -(-size // chunk)
    assert size > 4 * chunk and results[1]["moved"]["largest"] <= chunk
    # rank 0 sends to rank 1 alone; rank 2 (holding it) moves nothing
    assert [r["moved"]["calls"] for r in results] == [chunks, chunks, 0]


def test_each_rank_gets_its_own_rng_back_and_another_world_size_distinct_streams(
        processes: ProcessSet, tmp_path: Path) -> None:
    empty = {"memory": None, "disk": None}
    committed = run_ranks(processes, tmp_path, [{**empty, "rng": 3}] * 3, "commit-")
    restored = run_ranks(processes, tmp_path, [{**empty, "rng": 0}] * 3, "restore-")
    assert [r["draw"] for r in restored] == [r["draw"] for r in committed]
    assert len({tuple(r["draw"]) for r in restored}) == 3  # not rank 0's stream everywhere
    smaller = run_ranks(processes, tmp_path, [{**empty, "rng": 0}] * 2, "smaller-")
    again = run_ranks(processes, tmp_path, [{**empty, "rng": 0}] * 2, "again-")
    assert [r["draw"] for r in smaller] == [r["draw"] for r in again]  # reproducible
    draws = {tuple(r["draw"]) for r in smaller}
    assert len(draws) == 2 and not draws & {tuple(r["draw"]) for r in committed}
