"""The fast lane's guard: a test without a real-part marker (so in ``tests/run.sh --fast``)
that starts a torchrun agent, an etcd server or a network namespace fails, in any run,
naming the marker that moves it out; a marked test may."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import real_part_started_by

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("argv, marker", [
    (["torchrun", "--nnodes=1", "x.py"], "slow"),
    (["/usr/local/bin/torchrun", "-m", "trainer"], "slow"),
    ([sys.executable, "-m", "torch.distributed.run", "x.py"], "slow"),
    (["/usr/bin/etcd", "--name", "m0"], "etcd"),
    (["ip", "netns", "add", "ns1"], "netns"),
])
def test_each_real_part_is_named_with_its_marker(argv: list[str], marker: str) -> None:
    part = real_part_started_by(argv)
    assert part is not None and f"mark it {marker}" in part


@pytest.mark.parametrize("argv", [[sys.executable, "-c", "pass"], ["ip", "link", "show"],
                                  ["etcdctl", "get", "k"], []])
def test_other_programs_are_fine(argv: list[str]) -> None:
    assert real_part_started_by(argv) is None


def test_a_fast_lane_test_that_starts_an_etcd_server_fails(tmp_path: Path) -> None:
    script = tmp_path / "test_sneaky.py"
    script.write_text(textwrap.dedent("""
        import subprocess

        import pytest

        def test_sneaky():
            subprocess.run(["etcd", "--version"], capture_output=True)

        @pytest.mark.etcd
        def test_marked():
            subprocess.run(["etcd", "--version"], capture_output=True)
    """))
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest",
         "--rootdir", str(tmp_path), "-W", "ignore::pytest.PytestUnknownMarkWarning",
         str(script)],
        cwd=ROOT, env=dict(os.environ), capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "test_sneaky.py::test_sneaky is in the fast lane but starts an etcd server " \
        "(mark it etcd)" in run.stdout
    assert "1 failed, 1 passed" in run.stdout, run.stdout
