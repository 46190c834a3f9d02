"""A writer killed with SIGKILL at any moment leaves the previous snapshot intact and loadable."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from elastic_ext.local.processes import ProcessSet, wait_until
from elastic_ext.worker.snapshot import Snapshotter, newest_valid

WRITER = Path(__file__).parent / "support" / "snapshot_writer.py"


@pytest.mark.timeout(90)
@pytest.mark.parametrize("kill_after", ["writing 3", "writing 5", "durable 6"])
def test_sigkill_during_a_write_leaves_a_loadable_snapshot(
        processes: ProcessSet, tmp_path: Path, kill_after: str) -> None:
    directory = tmp_path / "snaps"
    proc = processes.spawn("writer", [sys.executable, str(WRITER), str(directory), "50", "24"])
    wait_until(lambda: kill_after in proc.output() or proc.popen.poll() is not None,
               timeout=60, interval=0.002, what=kill_after)
    proc.kill()
    proc.wait(timeout=10)
    durable = [int(s) for s in re.findall(r"durable (\d+)", proc.output())]
    assert durable, proc.output()
    restored = Snapshotter(directory).restore({})
    assert restored is not None
    # The newest durable one, or one that finished in the instant before the kill.
    assert restored.step in (max(durable), max(durable) + 1)
    assert restored.state["step"] == restored.step
    assert bool((restored.state["state"]["w"] == restored.step).all())
    assert newest_valid(directory) is not None
    assert len([n for n in directory.iterdir() if n.suffix == ".json"]) <= 3
