"""The GPU rules of kept state, tested by their construction on the CPU (no GPU here).

Kept bytes depend on the values only (the writer takes host tensors only, and a view
writes what its contiguous copy writes), and a step counts as held only once the
device finished its update with a healthy communicator (``HeldStep`` with fake device
markers standing in for CUDA events).
"""

from __future__ import annotations

import io
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

from elastic_ext.worker.snapshot import HeldStep, LocalCopies, Snapshotter
from elastic_ext.worker.snapshot.payload import load_payload, write_payload
from elastic_ext.worker.snapshot.staging import stage_for_keep


def payload_bytes(state: Mapping[str, object]) -> bytes:
    out = io.BytesIO()
    write_payload(out, state)
    return out.getvalue()


def test_the_writer_refuses_a_tensor_that_is_not_on_the_host() -> None:
    with pytest.raises(ValueError, match="stage the state in host memory first"):
        payload_bytes({"w": torch.empty(3, device="meta")})


def test_views_and_transposes_write_the_bytes_of_their_contiguous_copies() -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    views = {"t": base.t(), "slice": base[1:3, ::2], "row": base[2]}
    copies = {name: view.contiguous().clone() for name, view in views.items()}
    assert not views["t"].is_contiguous() and not views["slice"].is_contiguous()
    assert payload_bytes(views) == payload_bytes(copies)


def test_two_local_ranks_keeping_the_same_values_write_the_same_bytes(tmp_path: Path) -> None:
    """One rank's optimizer state holds views of a flat buffer, the other's plain tensors:
    the kept payloads, and so their checksums, are equal, which the hand-off relies on."""
    flat = torch.linspace(0, 1, 30)
    as_views: dict[str, Any] = {"model": {"a": flat[:10].view(2, 5), "b": flat[10:].view(4, 5).t()},
                "data": {"offset": 7}}
    plain: dict[str, Any] = {"model": {"a": flat[:10].view(2, 5).clone(),
                       "b": flat[10:].view(4, 5).t().contiguous()}, "data": {"offset": 7}}
    kept = []
    for name, state in (("rank0", as_views), ("rank1", plain)):
        (tmp_path / name).mkdir()
        snapshots = Snapshotter(None, local=LocalCopies(tmp_path / name))
        manifest = snapshots.keep_local(5, state)
        assert manifest is not None
        kept.append(manifest)
    assert kept[0].sha256 == kept[1].sha256
    loaded = load_payload(tmp_path / "rank0" / kept[0].payload)
    assert torch.equal(loaded["state"]["model"]["b"], plain["model"]["b"])


def test_staging_for_a_keep_hands_the_writer_contiguous_host_tensors_only() -> None:
    base = torch.arange(12.0).reshape(3, 4)
    staged = stage_for_keep({"m": {"t": base.t(), "x": base}, "n": 3}, timeout_s=1.0)
    assert staged["n"] == 3
    for tensor in (staged["m"]["t"], staged["m"]["x"]):
        assert tensor.device.type == "cpu" and tensor.is_contiguous()
    assert torch.equal(staged["m"]["t"], base.t())


class FakeMarker:
    """A CUDA event's shape: ``done`` says whether the stream got past it."""

    def __init__(self) -> None:
        self.recorded = False
        self.done = False

    def record(self) -> None:
        self.recorded = True

    def query(self) -> bool:
        return self.done


class FakeDevice:
    def __init__(self) -> None:
        self.markers: list[FakeMarker] = []
        self.error: str | None = None

    def new_marker(self) -> FakeMarker:
        marker = FakeMarker()
        self.markers.append(marker)
        return marker

    def held(self, step: int = 0) -> HeldStep[str]:
        return HeldStep(step, f"data@{step}", device=torch.device("cpu"),
                        new_marker=self.new_marker, communicator_error=lambda: self.error)


def keep(held: HeldStep[str], during_copy: object = None) -> tuple[int, str] | None:
    def stage(step: int, extra: str) -> str:
        if callable(during_copy):
            during_copy()
        return f"copy of {step} ({extra})"

    return held.keep(stage, lambda step, staged: staged)


def test_on_the_cpu_a_step_is_held_when_its_update_returns_and_never_during_it() -> None:
    held: HeldStep[str] = HeldStep(0, "data@0", device=torch.device("cpu"))
    with held.updating(1, "data@1"):
        assert held.step is None
    assert held.step == 1
    assert keep(held) == (1, "copy of 1 (data@1)")


def test_a_queued_update_is_not_held_until_the_device_finished_it() -> None:
    device = FakeDevice()
    held = device.held()
    with held.updating(1, "data@1"):
        pass
    before, after = device.markers
    assert before.recorded and after.recorded and held.step == 0
    # The stream is stuck before the update (a hung all-reduce): step 0 is copied.
    assert keep(held) == (0, "copy of 0 (data@0)")


def test_a_copy_during_which_the_update_started_is_thrown_away() -> None:
    device = FakeDevice()
    held = device.held()
    with held.updating(1, "data@1"):
        pass
    before, _ = device.markers
    assert keep(held, during_copy=lambda: setattr(before, "done", True)) is None


def test_an_update_under_way_when_the_worker_leaves_keeps_nothing() -> None:
    device = FakeDevice()
    held = device.held()
    with held.updating(1, "data@1"):
        pass
    device.markers[0].done = True  # the update started, not finished
    assert keep(held) is None


def test_an_update_that_raised_never_counts_and_guards_the_keep_like_a_queued_one() -> None:
    """An update that raised (a peer's fault inside it, or a framework's callbacks left
    between ``begin_update`` and ``end_update``) may have queued some kernels: it is
    never held, however the device ends, and a keep after its first kernel ran keeps
    nothing."""
    device = FakeDevice()
    held = device.held()
    with pytest.raises(RuntimeError), held.updating(1, "data@1"):
        raise RuntimeError("Connection closed by peer")
    assert keep(held) == (0, "copy of 0 (data@0)")  # nothing of it ran yet
    for marker in device.markers:
        marker.done = True
    held.confirm()
    assert held.step == 0 and keep(held) is None


def test_an_update_the_device_finished_with_a_healthy_communicator_is_held() -> None:
    device = FakeDevice()
    held = device.held()
    with held.updating(1, "data@1"):
        pass
    for marker in device.markers:
        marker.done = True
    assert keep(held) == (1, "copy of 1 (data@1)")


def test_an_update_finished_after_the_communicator_failed_is_not_trusted() -> None:
    """NCCL's watchdog aborted the communicator; the queued update then ran on partly
    reduced gradients: neither it nor (since it overwrote it) the step before is kept."""
    device = FakeDevice()
    held = device.held()
    with held.updating(1, "data@1"):
        pass
    device.error = "REMOTE_ERROR"
    for marker in device.markers:
        marker.done = True
    assert keep(held) is None
    held.confirm()
    assert held.step == 0


def test_the_step_boundary_confirms_the_update_and_the_next_one_is_judged_alone() -> None:
    device = FakeDevice()
    held = device.held()
    with held.updating(1, "data@1"):
        pass
    held.confirm()  # the agreement's result was read on the host
    assert held.step == 1
    with held.updating(2, "data@2"):
        pass
    assert keep(held) == (1, "copy of 1 (data@1)")  # update 2 still queued


def test_the_process_group_on_a_gpu_is_nccl_with_error_handling_set_before_it_exists(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun gives workers TORCH_NCCL_ASYNC_ERROR_HANDLING=1 (TearDown: the process
    dies); ours must be in the environment when the group is made, and the timeout ours."""
    import datetime

    import torch.distributed as dist

    from elastic_ext.worker import distributed

    seen: dict[str, object] = {}

    def fake_init(backend: str, **kwargs: object) -> None:
        seen.update(backend=backend, env=os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING"),
                    **kwargs)

    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    monkeypatch.setattr(dist, "init_process_group", fake_init)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: seen.update(device=device))
    name = distributed.init_process_group(timeout_s=7, device=torch.device("cuda", 1))
    assert name == "nccl" and seen["backend"] == "nccl" and seen["env"] == "2"
    assert seen["timeout"] == datetime.timedelta(seconds=7)
    assert seen["device"] == torch.device("cuda", 1)
    seen.clear()
    assert distributed.init_process_group(timeout_s=7, device=torch.device("cuda", 0),
                                          backend="gloo") == "gloo"  # ranks sharing a GPU
    assert seen["backend"] == "gloo"


def test_device_choices_that_cannot_work_are_refused_naming_the_fix(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from elastic_ext.worker import distributed

    assert distributed.choose_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="nccl needs --device cuda"):
        distributed.init_process_group(timeout_s=1, device=torch.device("cpu"), backend="nccl")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(ValueError, match="use --device cpu"):
        distributed.choose_device("cuda")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_RANK", "3")
    with pytest.raises(ValueError, match="--nproc-per-node"):
        distributed.choose_device("cuda")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert distributed.choose_device("cuda") == torch.device("cuda", 1)
