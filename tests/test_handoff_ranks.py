"""Ranks that hold different steps agree on the newest, and its lowest holder sends it.

Three real gloo ranks on loopback, each with a node-memory directory and a snapshot
directory of its own (nothing shared), seeded with the steps the test chooses. The 3-rank
cases run once, in sequence, in one set of rank processes (``three_ranks``): starting a
rank (importing torch) costs seconds, a case milliseconds. Each case has directories of its
own and each test asserts on its case alone.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from elastic_ext.local.processes import ProcessSet
from elastic_ext.net import free_port
from tests.support.handoff_ranks import CASE_MARK

pytestmark = pytest.mark.timeout(120)

SCRIPT = Path(__file__).parent / "support" / "handoff_ranks.py"
EMPTY: dict[str, Any] = {"memory": None, "disk": None}
CHUNK = 256

THREE_RANK_CASES: dict[str, list[dict[str, Any]]] = {
    "different-steps": [
        {"memory": [5, 5.0], "disk": [4, 4.0]},
        {"memory": [7, 7.0], "disk": None},
        {"memory": None, "disk": [6, 6.0]},
    ],
    "newer-on-one-node": [
        {"memory": None, "disk": None},
        {"memory": [5, 5.0], "disk": [4, 4.0]},
        {"memory": None, "disk": [9, 9.0]},
    ],
    "one-step-different-states": [
        {"memory": [8, 8.0], "disk": None},
        {"memory": [8, 8.5], "disk": None},
        {"memory": None, "disk": [6, 6.0]},
    ],
    "every-rank-holds-it": [{"memory": [3, 3.0], "disk": None}] * 3,
    "chunked": [
        {"memory": [7, 7.0], "disk": None, "chunk": CHUNK},
        {"memory": None, "disk": [6, 6.0], "chunk": CHUNK},
        {"memory": [7, 7.0], "disk": None, "chunk": CHUNK},
    ],
    "rng": [{**EMPTY, "rng": 3}] * 3,  # commits at step 3, then restores
}


@dataclass(frozen=True)
class Case:
    """What one case's ranks printed: their JSON results and their log lines, by rank."""

    results: list[dict[str, Any]]
    logs: list[str]


def split_cases(output: str) -> dict[str, tuple[dict[str, Any], str]]:
    """One rank's output by case: its result and its log lines (``CASE_MARK`` starts each)."""
    lines: dict[str, list[str]] = {}
    current: list[str] = []
    for line in output.splitlines():
        if line.startswith(CASE_MARK):
            current = lines.setdefault(line[len(CASE_MARK):], [])
        else:
            current.append(line)
    return {name: (json.loads(next(x for x in case if x.startswith("{"))), "\n".join(case))
            for name, case in lines.items()}


def run_ranks(processes: ProcessSet, root: Path, cases: dict[str, list[dict[str, Any]]],
              label: str = "") -> dict[str, Case]:
    """One process per rank, running ``cases`` (each a spec per rank) in order; ``label``
    names a second run's logs apart from the first's."""
    world = {len(specs) for specs in cases.values()}
    assert len(world) == 1, "the cases of one run have one world size"
    size = world.pop()
    port = free_port("127.0.0.1")
    procs = []
    for rank in range(size):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "RANK": str(rank), "WORLD_SIZE": str(size), "LOCAL_RANK": "0",
               "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parent.parent)}
        mine = [{**specs[rank], "case": name} for name, specs in cases.items()]
        command = [sys.executable, str(SCRIPT), json.dumps(mine), str(root)]
        procs.append(processes.spawn(f"{label}rank{rank}", command, env=env))
    by_rank = []
    for proc in procs:
        assert proc.wait(90) == 0, proc.output()[-4000:]
        by_rank.append(split_cases(proc.output()))
    return {name: Case([mine[name][0] for mine in by_rank], [mine[name][1] for mine in by_rank])
            for name in cases}


@dataclass(frozen=True)
class ThreeRanks:
    root: Path
    """Each case's directories (``NAME/mem<rank>``, ``NAME/disk<rank>``) as the run left them."""
    cases: dict[str, Case]


def _run_once(root: Path) -> dict[str, Any]:
    """``THREE_RANK_CASES`` run in ``root``, or why they could not be (as JSON)."""
    processes = ProcessSet(root / "logs")
    try:
        cases = run_ranks(processes, root, THREE_RANK_CASES)
        return {name: {"results": c.results, "logs": c.logs} for name, c in cases.items()}
    except Exception as exc:  # every test of the module fails with it, none runs it again
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        processes.cleanup()


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory: pytest.TempPathFactory) -> ThreeRanks:
    """Every 3-rank case, run once. Under pytest-xdist the workers share one run in the
    session's common directory: the first to take its lock runs it, the others wait for it
    and read what it wrote (xdist spreads a module's tests over the workers)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = tmp_path_factory.getbasetemp().parent / "handoff-ranks"
        root.mkdir(exist_ok=True)
    else:
        root = tmp_path_factory.mktemp("handoff-ranks")
    written = root / "cases.json"
    with open(root / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released on close; the test's timeout bounds it
        if not written.exists():
            written.write_text(json.dumps(_run_once(root)))
    data = json.loads(written.read_text())
    if "error" in data:
        pytest.fail(f"the 3-rank cases failed (logs in {root / 'logs'}): {data['error']}")
    return ThreeRanks(root, {name: Case(c["results"], c["logs"]) for name, c in data.items()})


def test_ranks_holding_different_steps_all_continue_from_the_newest(
        three_ranks: ThreeRanks) -> None:
    results = three_ranks.cases["different-steps"].results
    assert [r["step"] for r in results] == [7, 7, 7]
    assert [r["values"] for r in results] == [[7.0]] * 3
    assert [r["source"] for r in results] == ["peer", "local", "peer"]
    assert [r["data"] for r in results] == [{"step": 7}] * 3


def test_a_newer_snapshot_on_one_node_reaches_every_rank(three_ranks: ThreeRanks) -> None:
    results = three_ranks.cases["newer-on-one-node"].results
    assert [(r["step"], r["source"], r["values"]) for r in results] == [(9, "disk", [9.0])] * 3


def test_holders_of_one_step_with_different_states_are_not_trusted(
        three_ranks: ThreeRanks) -> None:
    case = three_ranks.cases["one-step-different-states"]
    assert [(r["step"], r["values"]) for r in case.results] == [(6, [6.0])] * 3
    assert "hold different states" in case.logs[0]


def test_when_every_rank_holds_the_step_nothing_is_sent(three_ranks: ThreeRanks) -> None:
    results = three_ranks.cases["every-rank-holds-it"].results
    assert [(r["step"], r["source"], r["values"]) for r in results] == [(3, "local", [3.0])] * 3


def test_only_the_rank_that_lacks_the_copy_receives_it_a_chunk_at_a_time(
        three_ranks: ThreeRanks) -> None:
    results = three_ranks.cases["chunked"].results
    assert [(r["step"], r["source"], r["values"]) for r in results] == [
        (7, "local", [7.0]), (7, "peer", [7.0]), (7, "local", [7.0])]
    size = results[1]["bytes"]
    chunks = -(-size // CHUNK)
    assert size > 4 * CHUNK and results[1]["moved"]["largest"] <= CHUNK
    # rank 0 sends to rank 1 alone; rank 2 (holding it) moves nothing
    assert [r["moved"]["calls"] for r in results] == [chunks, chunks, 0]


def test_each_rank_gets_its_own_rng_back_and_another_world_size_distinct_streams(
        three_ranks: ThreeRanks, processes: ProcessSet, tmp_path: Path) -> None:
    """Three ranks commit, each with a seed of its own, and restore after a foreign seed
    (``three_ranks``); then two ranks restore that snapshot twice, each time in fresh
    processes (from a copy of its directories, so the shared ones stay as they were)."""
    rng = three_ranks.cases["rng"].results
    assert [r["draw"] for r in rng] == [r["committed"] for r in rng]
    assert len({tuple(r["draw"]) for r in rng}) == 3  # not rank 0's stream everywhere
    shutil.copytree(three_ranks.root / "rng", tmp_path / "rng")
    restore_two = {"rng": [{**EMPTY, "rng": 0}] * 2}
    smaller = run_ranks(processes, tmp_path, restore_two, "smaller-")["rng"].results
    again = run_ranks(processes, tmp_path, restore_two, "again-")["rng"].results
    assert [r["draw"] for r in smaller] == [r["draw"] for r in again]  # reproducible
    draws = {tuple(r["draw"]) for r in smaller}
    assert len(draws) == 2 and not draws & {tuple(r["committed"]) for r in rng}
