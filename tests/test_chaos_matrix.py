"""The chaos matrix: every built-in scenario against a real local job, judged by the harness.

Each test runs one scenario of ``elastic_ext.chaos.matrix`` with
:func:`~elastic_ext.chaos.runner.run_scenario` (real etcd, real torchrun agents, the
bundled trainer), asserts the harness found no broken invariant, and then checks what
that scenario is about (no step lost at a join, no restart for an etcd failure, ...).

CI runs the ``ci`` group (``matrix.CI``). The rest is marked ``chaos_full`` and runs
only when asked for, with ``ELASTIC_EXT_CHAOS_FULL=1`` or ``-m chaos_full`` (the latter
selects just the rest); the whole matrix is::

    ELASTIC_EXT_CHAOS_FULL=1 flock /tmp/elastic-ext-heavy.lock python -m pytest \\
        -p no:cacheprovider tests/test_chaos_matrix.py

Every test has a hard timeout (the scenario's own limit plus room for the reference
run); the runner kills every process it started by its tag and removes its
namespaces and mounts even when the test times out.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from elastic_ext.chaos import matrix
from elastic_ext.chaos.runner import RunOptions, RunResult, run_scenario
from tests.support.chaos import explain

FULL = os.environ.get("ELASTIC_EXT_CHAOS_FULL") == "1"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def reference_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Uninterrupted runs shared by the scenarios of one session (a few, not one per test)."""
    return tmp_path_factory.mktemp("chaos-reference")


def _cases() -> Iterator[object]:
    for name in matrix.GROUPS["full"]:
        marks: list[pytest.MarkDecorator] = [
            pytest.mark.timeout(matrix.scenario(name).settings.timeout + 240)]
        if name not in matrix.CI:
            marks.append(pytest.mark.chaos_full)
        if name in TIMED:
            marks.append(pytest.mark.quiet)
        yield pytest.param(name, marks=marks, id=name)


def _full_requested(config: pytest.Config) -> bool:
    """ELASTIC_EXT_CHAOS_FULL=1, or a ``-m`` expression that asks for chaos_full."""
    expression = str(config.getoption("markexpr", "") or "")
    return FULL or ("chaos_full" in expression and "not chaos_full" not in expression)


def _worlds(result: RunResult) -> list[int]:
    assert result.verdict is not None
    worlds: list[int] = []
    for segment in result.verdict.segments:
        if not worlds or worlds[-1] != segment.world_size:
            worlds.append(segment.world_size)
    return worlds


EXPECTED_WORLDS = {
    "kill-worker": [2], "kill-node": [3, 2], "kill-rank0": [3, 2], "freeze": [3, 2, 3],
    "etcd-follower": [2], "etcd-leader": [2], "etcd-outage": [2], "kill-all": [2], "join": [2, 3],
    "preempt": [2], "disk-full": [2], "partition": [3, 2, 3], "notice": [3, 2],
    "notice-below-min": [2], "notice-spread": [3, 2, 3], "terminate-rank0": [3, 2],
    "drop-two": [3, 1, 3],
}
NO_RESTART = {"etcd-follower", "etcd-leader", "etcd-outage", "disk-full"}
NOTHING_LOST = {"join", "preempt", "notice", "notice-below-min", "notice-spread",
                "terminate-rank0", *NO_RESTART}
NOTICE_TO_TRAINING_S = 2.0
"""Issue 23: from a notice to one node to the first step of the smaller world."""
TIMED = {"notice", "etcd-leader"}
"""The scenarios with a bound on time (below): they run alone (``quiet``), as their bound is
this machine's, not that of a machine busy with other jobs (on CI's 2 cores beside two
other end-to-end tests ``notice`` measured 2.06 s)."""
ELECTION_S = 2.0
"""Time enough for two etcd members to elect a new leader (about 1 s)."""


@pytest.mark.parametrize("name", list(_cases()))
def test_scenario(name: str, tmp_path: Path, reference_cache: Path,
                  request: pytest.FixtureRequest) -> None:
    if name not in matrix.CI and not _full_requested(request.config):
        pytest.skip("full chaos matrix: set ELASTIC_EXT_CHAOS_FULL=1 or select -m chaos_full")
    result = run_scenario(matrix.scenario(name),
                          RunOptions(workdir=tmp_path, reference_cache=reference_cache))
    if result.skipped:
        pytest.skip(result.skipped)
    verdict = result.verdict
    assert verdict is not None and verdict.ok, explain(result)
    assert _worlds(result) == EXPECTED_WORLDS[name], explain(result)
    if name in NO_RESTART:
        assert not verdict.restarts, explain(result)
    else:
        assert verdict.restarts, explain(result)
    if name in NOTHING_LOST:
        assert verdict.lost_steps == 0
    if len(EXPECTED_WORLDS[name]) == 1:
        assert verdict.params_check.startswith("equal"), verdict.params_check
    if name == "disk-full":
        writer_logs = "".join(p.read_text(errors="replace") for p in result.logs.values()
                              if p.exists())
        assert "could not write the snapshot" in writer_logs  # the fault did hit a snapshot
    if name == "etcd-leader":
        # the leader changes in the middle of training: the job still steps once a new
        # leader is in office and before the old member is back
        assert result.observation is not None
        down = next(f.time for f in result.observation.faults if f.verb == "kill-etcd")
        back = next(f.time for f in result.observation.faults if f.restore)
        assert any(down + ELECTION_S < t < back for seg in verdict.segments
                   for t in seg.step_times), explain(result)
    if name == "notice":
        assert result.observation is not None
        notice = result.observation.faults[0].time
        smaller = next(seg for seg in verdict.segments if seg.world_size == 2)
        assert smaller.step_times[0] - notice <= NOTICE_TO_TRAINING_S, explain(result)
