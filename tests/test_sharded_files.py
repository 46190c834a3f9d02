"""The files a sharded job leaves: dead writers' temporary files, durable DCP snapshots."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from elastic_ext.worker.snapshot.sharded import durable_name, newest_durable, sweep_dead_writers


def dead_pid() -> int:
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    return int(proc.stdout)


def test_a_dead_writers_temporary_file_is_swept_and_nothing_else(tmp_path: Path) -> None:
    host = socket.gethostname()
    dead = tmp_path / f".shards-0000000003-w4-r0.bin.{host}.{dead_pid()}.tmp"
    alive = tmp_path / f".shards-0000000003-w4-r1.bin.{host}.{os.getpid()}.tmp"
    elsewhere = tmp_path / f".shards-0000000003-w4-r2.bin.other.host.{dead_pid()}.tmp"
    kept = tmp_path / "shards-0000000003-w4-r0.bin"
    for path in (dead, alive, elsewhere, kept):
        path.write_bytes(b"x")
    sweep_dead_writers(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        p.name for p in (alive, elsewhere, kept))


def test_the_newest_durable_snapshot_is_the_newest_complete_one(tmp_path: Path) -> None:
    assert newest_durable(None) is None
    assert newest_durable(tmp_path / "missing") is None
    for step in (5, 10, 15):
        (tmp_path / durable_name(step)).mkdir()
    for step in (5, 10):  # 15 is still being written: no .metadata yet
        (tmp_path / durable_name(step) / ".metadata").write_bytes(b"")
    (tmp_path / "dcp-notanumber").mkdir()
    assert newest_durable(tmp_path) == 10
