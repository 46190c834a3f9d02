from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from elastic_ext.local.processes import ProcessSet


@pytest.fixture
def processes(tmp_path: Path):
    """Spawn helper whose every process (and descendant) is killed at teardown."""
    pset = ProcessSet(tmp_path / "logs")
    try:
        yield pset
    finally:
        try:
            pset.cleanup()
        finally:
            if os.environ.get("ELASTIC_EXT_SHOW_LOGS"):
                for proc in pset.procs:
                    print(f"===== {proc.name} =====\n{proc.output()[-20000:]}")


@pytest.fixture
def etcd(processes: ProcessSet, tmp_path: Path):
    """One real etcd member on free loopback ports, with its own data directory."""
    from elastic_ext.local.etcd import etcd_available, start_cluster

    if not etcd_available():
        pytest.fail("etcd server binary not found: apt-get install -y etcd-server")
    return start_cluster(processes, tmp_path, size=1)


@pytest.fixture
def etcd_cluster(processes: ProcessSet, tmp_path: Path):
    """A real 3-member etcd cluster on loopback."""
    from elastic_ext.local.etcd import start_cluster

    return start_cluster(processes, tmp_path, size=3)


@contextmanager
def mounted_tmpfs(tmp_path: Path, size: str) -> Iterator[Path]:
    """A filesystem of ``size`` of its own under ``tmp_path`` (needs root, as in CI)."""
    mount_point = tmp_path / f"tmpfs-{uuid.uuid4().hex[:6]}"
    mount_point.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs",
                             str(mount_point)], capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({result.stderr.strip()}); "
                    "tests/test_snapshot.py covers ENOSPC through /dev/full")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 640 KiB filesystem of its own."""
    with mounted_tmpfs(tmp_path, "640k") as mount_point:
        yield mount_point
