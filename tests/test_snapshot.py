"""The snapshot hook on real files, in this process (no torch.distributed: one writer)."""

from __future__ import annotations

import errno
import logging
import os
import random
import socket
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from elastic_ext.worker.snapshot import (
    LocalCopies,
    SnapshotError,
    SnapshotMismatchError,
    Snapshotter,
    SnapshotWriteError,
)
from elastic_ext.worker.snapshot.layout import manifest_name, payload_name, tmp_name


def _objects(width: int = 8, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer,
                                                      torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched


def _train(model: nn.Module, opt: torch.optim.Optimizer,
           sched: torch.optim.lr_scheduler.LRScheduler, steps: int) -> None:
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(5, 4)).pow(2).mean().backward()
        opt.step()
        sched.step()


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_commit_and_restore_round_trip(tmp_path: Path) -> None:
    model, opt, sched = _objects()
    _train(model, opt, sched, 3)
    snaps = Snapshotter(tmp_path)
    future = snaps.commit(3, {"model": model, "optimizer": opt, "scheduler": sched,
                              "data": {"offset": 9}})
    info = future.result(timeout=30)
    assert info is not None and info.step == 3 and info.blocking_s >= 0
    assert (tmp_path / payload_name(3)).exists() and (tmp_path / manifest_name(3)).exists()
    expected = _params(model)
    _train(model, opt, sched, 2)
    after_two_more = _params(model)

    fresh_model, fresh_opt, fresh_sched = _objects(seed=1)
    restored = Snapshotter(tmp_path).restore({"model": fresh_model, "optimizer": fresh_opt,
                                              "scheduler": fresh_sched})
    assert restored is not None and restored.step == 3
    assert restored.state == {"data": {"offset": 9}}
    assert restored.created is not None and 0 <= time.time() - restored.created < 60
    assert _same(_params(fresh_model), expected)
    assert fresh_sched.last_epoch == 3
    # The optimizer state came back too: two more steps from here land exactly where the
    # original did.
    torch.manual_seed(123)
    _train(fresh_model, fresh_opt, fresh_sched, 2)
    model2, opt2, sched2 = _objects(seed=1)
    Snapshotter(tmp_path).restore({"model": model2, "optimizer": opt2, "scheduler": sched2})
    torch.manual_seed(123)
    _train(model2, opt2, sched2, 2)
    assert _same(_params(fresh_model), _params(model2))
    assert not _same(after_two_more, expected)


def test_the_state_is_the_one_at_commit_time(tmp_path: Path) -> None:
    model, opt, sched = _objects()
    snaps = Snapshotter(tmp_path)
    future = snaps.commit(1, {"model": model})
    at_commit = _params(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # the loop goes on while the write may still be running
    future.result(timeout=30)
    fresh, _, _ = _objects(seed=5)
    Snapshotter(tmp_path).restore({"model": fresh})
    assert _same(_params(fresh), at_commit)


def test_rng_states_are_restored(tmp_path: Path) -> None:
    torch.manual_seed(11)
    np.random.seed(11)
    random.seed(11)
    snaps = Snapshotter(tmp_path)
    snaps.commit(1, {}).result(timeout=30)
    expected = (torch.rand(3), np.random.rand(3), random.random())
    torch.manual_seed(99)
    np.random.seed(99)
    random.seed(99)
    assert Snapshotter(tmp_path).restore({}) is not None
    got = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(got[0], expected[0])
    assert np.array_equal(got[1], expected[1])
    assert got[2] == expected[2]


def test_keeps_the_newest_three(tmp_path: Path) -> None:
    model, _, _ = _objects()
    snaps = Snapshotter(tmp_path)
    for step in range(1, 6):
        snaps.commit(step * 10, {"model": model})
    snaps.close()
    assert sorted(os.listdir(tmp_path)) == sorted(
        f(s) for s in (30, 40, 50) for f in (payload_name, manifest_name))


def test_redoing_a_step_replaces_it(tmp_path: Path) -> None:
    model, _, _ = _objects()
    snaps = Snapshotter(tmp_path)
    snaps.commit(10, {"model": model, "tag": "first"}).result(timeout=30)
    snaps.commit(10, {"model": model, "tag": "second"}).result(timeout=30)
    restored = Snapshotter(tmp_path).restore({})
    assert restored is not None and restored.state["tag"] == "second"


def _three_snapshots(tmp_path: Path) -> None:
    model, _, _ = _objects()
    snaps = Snapshotter(tmp_path)
    for step in (10, 20, 30):
        with torch.no_grad():
            next(model.parameters()).fill_(step)
        snaps.commit(step, {"model": model})
    snaps.close()


def _first_weight(restored_model: nn.Module) -> float:
    return float(next(restored_model.parameters()).detach().flatten()[0])


def test_corrupt_newest_is_skipped_with_a_warning(tmp_path: Path,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    _three_snapshots(tmp_path)
    payload = tmp_path / payload_name(30)
    data = bytearray(payload.read_bytes())
    data[len(data) // 2] ^= 0xFF
    payload.write_bytes(bytes(data))
    model, _, _ = _objects()
    with caplog.at_level(logging.WARNING, logger="elastic_ext.worker.snapshot"):
        restored = Snapshotter(tmp_path).restore({"model": model})
    assert restored is not None and restored.step == 20
    assert _first_weight(model) == 20
    assert str(tmp_path / manifest_name(30)) in caplog.text and "corrupt" in caplog.text


def test_truncated_newest_is_skipped_with_a_warning(tmp_path: Path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    _three_snapshots(tmp_path)
    payload = tmp_path / payload_name(30)
    with open(payload, "r+b") as f:
        f.truncate(payload.stat().st_size // 3)
    with caplog.at_level(logging.WARNING, logger="elastic_ext.worker.snapshot"):
        restored = Snapshotter(tmp_path).restore({})
    assert restored is not None and restored.step == 20
    assert str(tmp_path / manifest_name(30)) in caplog.text and "truncated" in caplog.text


def test_garbled_manifest_and_missing_payload_are_skipped(tmp_path: Path,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    _three_snapshots(tmp_path)
    (tmp_path / manifest_name(30)).write_text("{not json")
    (tmp_path / payload_name(20)).unlink()
    with caplog.at_level(logging.WARNING, logger="elastic_ext.worker.snapshot"):
        restored = Snapshotter(tmp_path).restore({})
    assert restored is not None and restored.step == 10
    assert str(tmp_path / manifest_name(30)) in caplog.text
    assert str(tmp_path / manifest_name(20)) in caplog.text


def test_nothing_to_restore(tmp_path: Path) -> None:
    assert Snapshotter(tmp_path / "empty").restore({}) is None


def test_a_different_model_is_refused_clearly(tmp_path: Path) -> None:
    model, opt, _ = _objects(width=8)
    Snapshotter(tmp_path).commit(5, {"model": model, "optimizer": opt}).result(timeout=30)
    other, other_opt, _ = _objects(width=16)
    before = _params(other)
    with pytest.raises(SnapshotMismatchError,
                       match=r"different model.*'0\.weight' has shape \(8, 4\) in "
                             r"the snapshot, \(16, 4\) in this model"):
        Snapshotter(tmp_path).restore({"model": other, "optimizer": other_opt})
    assert _same(_params(other), before)  # nothing was half-loaded


def test_missing_entry_is_refused(tmp_path: Path) -> None:
    model, opt, _ = _objects()
    Snapshotter(tmp_path).commit(5, {"model": model}).result(timeout=30)
    with pytest.raises(SnapshotMismatchError, match="no entry 'optimizer'"):
        Snapshotter(tmp_path).restore({"model": model, "optimizer": opt})


def test_leftovers_of_dead_writers_are_removed(tmp_path: Path) -> None:
    probe = subprocess.Popen(["true"])  # its pid no longer runs once reaped
    probe.wait()
    host = socket.gethostname()
    stale = tmp_path / tmp_name(payload_name(7), host, probe.pid)
    mine = tmp_path / tmp_name(payload_name(8), host, os.getpid())
    stale.write_bytes(b"partial")
    mine.write_bytes(b"in progress")
    Snapshotter(tmp_path)
    assert not stale.exists() and mine.exists()


def test_disk_full_keeps_the_previous_snapshot(small_tmpfs: Path) -> None:
    torch.manual_seed(0)
    small = {"w": torch.randn(200, 200)}    # ~160 KB
    big = {"w": torch.randn(400, 400)}      # ~640 KB: never fits next to the small one
    snaps = Snapshotter(small_tmpfs)
    snaps.commit(1, small).result(timeout=30)
    with pytest.raises(SnapshotWriteError, match=r"step 2 .*No space left on device"):
        snaps.commit(2, big).result(timeout=30)
    assert [n for n in os.listdir(small_tmpfs) if n.endswith(".tmp")] == []  # no partial file left
    snaps.commit(3, small).result(timeout=30)  # and the disk is usable again
    restored = Snapshotter(small_tmpfs).restore({})
    assert restored is not None and restored.step == 3
    assert torch.equal(restored.state["w"], small["w"])
    assert Snapshotter(small_tmpfs).latest().step == 3  # type: ignore[union-attr]


def test_injected_enospc_keeps_the_previous_snapshot(tmp_path: Path) -> None:
    """/dev/full answers every write with ENOSPC: put it where the writer's temporary file goes."""
    model, _, _ = _objects()
    snaps = Snapshotter(tmp_path)
    snaps.commit(1, {"model": model}).result(timeout=30)
    trap = tmp_path / tmp_name(payload_name(2), socket.gethostname(), os.getpid())
    trap.symlink_to("/dev/full")
    with pytest.raises(SnapshotWriteError) as failure:
        snaps.commit(2, {"model": model}).result(timeout=30)
    cause = failure.value.__cause__
    while cause is not None and not isinstance(cause, OSError):
        cause = cause.__cause__
    assert isinstance(cause, OSError) and cause.errno == errno.ENOSPC, repr(failure.value)
    assert not trap.exists() and not (tmp_path / manifest_name(2)).exists()
    restored = Snapshotter(tmp_path).restore({})
    assert restored is not None and restored.step == 1


def test_commit_now_without_distributed(tmp_path: Path) -> None:
    model, _, _ = _objects()
    info = Snapshotter(tmp_path).commit_now(4, {"model": model})
    assert info is not None and info.step == 4 and (tmp_path / manifest_name(4)).exists()


def test_a_failed_redo_of_a_step_keeps_the_old_snapshot_of_it(tmp_path: Path) -> None:
    model, _, _ = _objects()
    snaps = Snapshotter(tmp_path)
    snaps.commit(1, {"model": model, "tag": "old"}).result(timeout=30)
    (tmp_path / tmp_name(payload_name(1), socket.gethostname(), os.getpid())).symlink_to(
        "/dev/full")
    with pytest.raises(SnapshotWriteError):
        snaps.commit(1, {"model": model, "tag": "new"}).result(timeout=30)
    restored = Snapshotter(tmp_path).restore({})
    assert restored is not None and restored.step == 1 and restored.state["tag"] == "old"


def test_payload_round_trips_every_kind_of_tensor(tmp_path: Path) -> None:
    from collections import OrderedDict

    from elastic_ext.worker.snapshot import load_payload
    from elastic_ext.worker.snapshot.payload import write_payload

    tree = {
        "f32": torch.randn(3, 4), "bf16": torch.randn(5).to(torch.bfloat16),
        "f16": torch.randn(2, 2).half(), "i64": torch.arange(7),
        "bool": torch.tensor([True, False]),
        "scalar": torch.tensor(3.5), "empty": torch.zeros(0, 3),
        "sparse": torch.eye(3).to_sparse(),
        "nested": OrderedDict(a=[torch.ones(2), (1, "x", None)], b={5: 2.5}),
    }
    path = tmp_path / "p.snap"
    with open(path, "wb") as f:
        write_payload(f, tree)
    back = load_payload(path)
    assert isinstance(back["nested"], OrderedDict) and back["nested"]["b"] == {5: 2.5}
    assert back["nested"]["a"][1] == (1, "x", None)
    assert torch.equal(back["nested"]["a"][0], torch.ones(2))
    for key in ("f32", "bf16", "f16", "i64", "bool", "scalar", "empty"):
        want = tree[key]
        assert isinstance(want, torch.Tensor)
        assert back[key].dtype == want.dtype and torch.equal(back[key], want), key
    assert torch.equal(back["sparse"].to_dense(), torch.eye(3))
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 10)
    with pytest.raises(SnapshotError, match="ends inside a tensor"):
        load_payload(path)
    with pytest.raises(ValueError, match="reserved"):
        with open(tmp_path / "q.snap", "wb") as f:
            write_payload(f, {"x": {"__elastic_ext_tensor__": 1}})


def test_a_nodes_kept_copy_goes_once_a_newer_durable_or_restored_step_exists(
        tmp_path: Path) -> None:
    """Node memory holds one copy that someone could still choose, and no leftovers of a
    worker killed while keeping."""
    probe = subprocess.Popen(["true"])
    probe.wait()
    memory = tmp_path / "memory"
    memory.mkdir()
    half_kept = memory / tmp_name(payload_name(2), socket.gethostname(), probe.pid)
    half_kept.write_bytes(b"partial")
    model, _, _ = _objects()
    snaps = Snapshotter(tmp_path / "disk", local=LocalCopies(memory))
    assert not half_kept.exists()
    snaps.keep_local(3, {"model": model})
    snaps.commit(2, {"model": model}).result(timeout=30)  # older: the kept copy stays
    assert snaps.local is not None and snaps.local.newest() is not None
    snaps.commit(5, {"model": model}).result(timeout=30)
    assert snaps.local.newest() is None and os.listdir(memory) == [".lock"]
    snaps.keep_local(6, {"model": model})
    snaps.keep_local(8, {"model": model})  # one kept step per node
    assert sorted(os.listdir(memory)) == sorted([".lock", payload_name(8), manifest_name(8)])
    snaps.close()
