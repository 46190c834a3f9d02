"""Pure logic of the snapshot hook and the guard: names, manifests, retention, classification."""

from __future__ import annotations

import pytest
import torch

from elastic_ext.worker.preemption import GuardSettings, is_peer_fault
from elastic_ext.worker.snapshot import Manifest
from elastic_ext.worker.snapshot.hook import shape_mismatches
from elastic_ext.worker.snapshot.layout import (
    manifest_name,
    parse_name,
    parse_tmp_name,
    payload_name,
    tmp_name,
)
from elastic_ext.worker.snapshot.retention import newest_first, retention_plan, stale_tmp_files


def test_names_round_trip() -> None:
    assert parse_name(payload_name(42)) == (42, "snap")
    assert parse_name(manifest_name(7)) == (7, "json")
    assert parse_name("snapshot-42.snap") is None
    assert parse_name("snapshot-0000000042.pt") is None
    assert parse_name("notes.txt") is None
    assert parse_tmp_name(tmp_name(payload_name(5), "node-a.example", 1234)) == (
        payload_name(5), "node-a.example", 1234)
    assert parse_name(tmp_name(payload_name(5), "h", 1)) is None


def test_newest_first_counts_only_manifests() -> None:
    names = [payload_name(30), manifest_name(10), payload_name(10), manifest_name(20), "x.tmp"]
    assert newest_first(names) == [20, 10]


def _manifest(step: int = 5) -> Manifest:
    return Manifest(step=step, payload=payload_name(step), sha256="ab" * 32, size=10, created=1.0)


def test_manifest_round_trip() -> None:
    m = _manifest()
    assert Manifest.from_json(m.to_json(), 5) == m


@pytest.mark.parametrize("text", ["", "{", "[]", '{"format": 1}', '{"format": 99, "step": 5}'])
def test_broken_manifests_are_rejected(text: str) -> None:
    with pytest.raises(ValueError):
        Manifest.from_json(text, 5)


def test_manifest_of_another_step_is_rejected() -> None:
    with pytest.raises(ValueError, match="step"):
        Manifest.from_json(_manifest(6).to_json(), 5)


def test_retention_keeps_the_newest_k() -> None:
    names = [f(s) for s in (5, 10, 15, 20, 25) for f in (payload_name, manifest_name)]
    plan = retention_plan(names, keep=3)
    assert plan.manifests == (10, 5)
    assert plan.payloads == (5, 10)


def test_retention_deletes_old_orphans_but_not_newer_ones() -> None:
    names = [payload_name(3), manifest_name(10), payload_name(10), payload_name(12)]
    plan = retention_plan(names, keep=3)
    assert plan.manifests == ()
    assert plan.payloads == (3,)  # 12 may be a write in progress


def test_retention_needs_keep_of_at_least_one() -> None:
    with pytest.raises(ValueError):
        retention_plan([], keep=0)


def test_stale_tmp_files_are_this_hosts_dead_writers_only() -> None:
    names = [tmp_name(payload_name(1), "me", 10), tmp_name(payload_name(2), "me", 11),
             tmp_name(payload_name(3), "other", 10), payload_name(1)]
    assert (stale_tmp_files(names, "me", alive=lambda pid: pid == 11)
            == [tmp_name(payload_name(1), "me", 10)])


def test_shape_mismatches_are_described() -> None:
    want = {"a": torch.zeros(2, 3), "b": torch.zeros(4)}
    assert shape_mismatches(want, {"a": torch.ones(2, 3), "b": torch.ones(4)}) == []
    problems = shape_mismatches(want, {"a": torch.ones(3, 3), "c": torch.ones(1)})
    assert "'a' has shape (3, 3) in the snapshot, (2, 3) in this model" in problems
    assert "missing 'b'" in problems and "unexpected 'c'" in problems


@pytest.mark.parametrize("message", [
    "[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:17811: Connection reset by peer.",
    "[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 4000ms for recv operation "
    "to complete",
    "NCCL communicator was aborted on rank 1",
    "[c10d] TCPStore recvValue failed: Connection reset by peer",
])
def test_collective_failures_are_peer_faults(message: str) -> None:
    assert is_peer_fault(RuntimeError(message))


@pytest.mark.parametrize("exc", [
    RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x16 and 32x4)"),
    RuntimeError("DataLoader worker (pid 12) timed out after 30 seconds"),
    RuntimeError("could not open the feature store"),
    ValueError("bad value"),
    KeyError("x"),
])
def test_ordinary_errors_are_not_peer_faults(exc: BaseException) -> None:
    assert not is_peer_fault(exc)


def test_preempt_signals_get_the_longer_grace() -> None:
    import signal

    settings = GuardSettings(stop_grace_s=3, preempt_grace_s=30)
    assert settings.grace_for(signal.SIGTERM) == 3
    assert settings.grace_for(signal.SIGUSR2) == 30
