from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from elastic_ext.local.processes import ProcessSet
from tests.support import machine_share
from tests.support.handler_lab import make_lab  # noqa: F401 - a fixture of the in-process tests

REAL_PART_MARKERS = ("slow", "etcd", "slurm", "netns", "chaos_full")
"""A test with none of these is in the fast lane (``tests/run.sh --fast``); if it starts
a real part anyway, it fails, naming the marker that moves it out, in every run (so the
lane cannot slowly grow slow)."""


def real_part_started_by(argv: list[str]) -> str | None:
    """What real part ``argv`` starts that the fast lane leaves out, with its marker."""
    if not argv:
        return None
    program = Path(argv[0]).name
    if program == "torchrun" or "torch.distributed.run" in argv:
        return "a torchrun agent (mark it slow)"
    if program == "etcd":
        return "an etcd server (mark it etcd)"
    if program == "ip" and "netns" in argv:
        return "a network namespace (mark it netns)"
    return None


def has_real_parts(item: pytest.Item) -> bool:
    return any(item.get_closest_marker(name) for name in REAL_PART_MARKERS)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that asks for a real etcd is marked ``etcd`` (the fast lane leaves it out), and
    the tests are put in the order that shares the machine best (``machine_share.order``).
    Labs of network namespaces may run side by side: each takes its own /24 and names under
    a lock (``NetnsLab.allocate``, ``SlurmLab.up``)."""
    for item in items:
        if {"etcd", "etcd_cluster"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.etcd)
        if item.get_closest_marker("quiet") and not has_real_parts(item):
            raise pytest.UsageError(f"{item.nodeid} is marked quiet but starts no real part: "
                                    "a quiet test is one with real parts (mark it slow)")
    items[:] = machine_share.order(items, has_real_parts)


@pytest.fixture(autouse=True)
def _share_the_machine(request: pytest.FixtureRequest,
                       tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Under xdist, a quiet test runs alone (``tests/support/machine_share.py``)."""
    if not hasattr(request.config, "workerinput"):
        yield
        return
    shared = tmp_path_factory.getbasetemp().parent  # the session's, above every worker's
    with machine_share.machine_share(shared, exclusive=bool(
            request.node.get_closest_marker("quiet"))):
        yield


@pytest.fixture(autouse=True)
def _fast_lane_starts_no_real_parts(request: pytest.FixtureRequest,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    if any(request.node.get_closest_marker(name) for name in REAL_PART_MARKERS):
        return
    original = subprocess.Popen.__init__

    def guarded(self: subprocess.Popen[Any], args: Any, *rest: Any, **kwargs: Any) -> None:
        if isinstance(args, (str, bytes, os.PathLike)):
            argv = str(args).split() if kwargs.get("shell") else [str(args)]
        else:
            argv = [str(a) for a in args]
        part = real_part_started_by(argv)
        if part is not None:
            pytest.fail(f"{request.node.nodeid} is in the fast lane but starts {part}")
        original(self, args, *rest, **kwargs)

    monkeypatch.setattr(subprocess.Popen, "__init__", guarded)


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
