"""The trainer with damaged snapshots, another model's snapshots, and a full disk (one process)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from elastic_ext.jsonlines import read_json_lines
from elastic_ext.local.processes import ProcessSet
from elastic_ext.worker.snapshot.layout import manifest_name, payload_name
from tests.conftest import mounted_tmpfs
from tests.support.trainer_runs import env, finish, of, run_to_end, trainer_cmd

ARGS = ("--steps", "30", "--global-batch-size", "8", "--dataset-size", "64", "--seed", "3")


def _args(snaps: Path, metrics: Path, *extra: str) -> list[str]:
    return trainer_cmd(*ARGS, "--snapshot-dir", str(snaps), "--snapshot-every", "10",
                       "--metrics", str(metrics), *extra)


@pytest.mark.timeout(120)
def test_damaged_newest_snapshot_falls_back_and_another_model_is_refused(
        processes: ProcessSet, tmp_path: Path) -> None:
    """The newest snapshot corrupt and the one before it truncated: one resumed run skips
    both (each logged by name, with what is wrong) and continues from the one before them."""
    snaps, metrics = tmp_path / "snaps", tmp_path / "m.jsonl"
    run_to_end(processes, "first", _args(snaps, metrics), timeout=60)
    uninterrupted = of(read_json_lines(metrics), "done")[-1]["params_sha256"]
    assert sorted(e["step"] for e in of(read_json_lines(metrics), "snapshot")) == [10, 20, 30]

    # Corrupt: one flipped byte in the middle of the newest payload.
    newest = snaps / payload_name(30)
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0x01
    newest.write_bytes(bytes(data))
    # Truncated: the payload before it cut short.
    with open(snaps / payload_name(20), "r+b") as f:
        f.truncate(1000)
    resumed = run_to_end(processes, "damaged", _args(snaps, metrics), timeout=60)
    assert of(read_json_lines(metrics), "start")[-1]["resumed_from"] == 10
    skipped = {step: [line for line in resumed.output().splitlines()
                      if f"skipping snapshot {snaps / manifest_name(step)}" in line]
               for step in (30, 20)}
    assert len(skipped[30]) == 1 and "corrupt" in skipped[30][0], resumed.output()[-4000:]
    assert len(skipped[20]) == 1 and "truncated" in skipped[20][0], resumed.output()[-4000:]
    assert of(read_json_lines(metrics), "done")[-1]["params_sha256"] == uninterrupted

    # Another model: refused with a clear error, nothing trained, snapshots untouched.
    before = sorted(p.name for p in snaps.iterdir())
    other = processes.spawn("other-model", _args(snaps, metrics, "--model-size", "small"),
                            env=env())
    assert finish(other, 60) != 0
    assert "SnapshotMismatchError" in other.output() and "different model" in other.output()
    assert sorted(p.name for p in snaps.iterdir()) == before


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """120 KiB: room for two snapshots of the tiny model (~43 KB each), not for a third."""
    with mounted_tmpfs(tmp_path, "120k") as mount_point:
        yield mount_point


@pytest.mark.timeout(120)
def test_disk_full_training_goes_on_and_the_previous_snapshot_loads(
        processes: ProcessSet, tmp_path: Path, small_tmpfs: Path) -> None:
    metrics = tmp_path / "m.jsonl"
    args = trainer_cmd(*ARGS, "--snapshot-dir", str(small_tmpfs), "--snapshot-every", "5",
                       "--metrics", str(metrics))
    first = processes.spawn("full", args, env=env())
    code = finish(first, 60)
    log = first.output()
    evs = read_json_lines(metrics)
    assert [e["step"] for e in of(evs, "snapshot")] == [5, 10]
    assert ("snapshot of step 15 failed, training goes on" in log
            and "No space left on device" in log)
    assert max(e["step"] for e in of(evs, "step")) == 30  # it trained on past the failures
    # The last snapshot is the job's result: failing to write it is an error, and a clear one.
    assert code == 1 and not of(evs, "done")
    assert "could not write the snapshot of step 30" in log and "older snapshots are kept" in log
    assert not [p for p in small_tmpfs.iterdir() if p.name.endswith(".tmp")]

    second = processes.spawn("after", args, env=env())
    finish(second, 60)
    assert of(read_json_lines(metrics), "start")[-1]["resumed_from"] == 10
