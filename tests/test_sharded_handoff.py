"""A sharded model (FSDP2 ``fully_shard``, HSDP) kept in node memory and handed to another
world (issue #40): real gloo ranks on loopback, forked from the test, each "node" (two
ranks) with a node-memory directory of its own.

Each phase forks one process per rank: restore (``ShardedState.restore``), train a few
steps with the buddy copy, keep, and report as JSON the step restored, digests of the
whole model and optimizer state (gathered, so the same at any world size) right after the
restore and after the keep, and every warning the snapshot package logged. A node's loss
is its directory emptied between two phases. A restored state is right when its digest is
the one the previous phase kept, bit for bit.

No torchrun agent, etcd or network namespace: the fast lane's. The ranks die with the test
(``PR_SET_PDEATHSIG``, and killed at the end of each phase whatever happened), a phase that
hangs fails after ``PHASE_S`` seconds, and collectives time out after ``COLLECTIVE_S``.
"""

from __future__ import annotations

import ctypes
import datetime
import hashlib
import json
import logging
import os
import shutil
import signal
import struct
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from elastic_ext.net import free_port

pytestmark = pytest.mark.timeout(120)

PHASE_S = 60.0
COLLECTIVE_S = 30
PER_NODE = 2


@dataclass(frozen=True)
class Phase:
    """One world's run: restore, train ``steps``, keep."""

    world: int
    dirs: tuple[str, ...]
    """The node-memory directory of each node, in node order (rank // PER_NODE)."""
    steps: int
    out: str
    hsdp: bool = False
    copy_every: int = 1
    port: int = 0
    digest_every_step: bool = False
    keep: bool = True
    background: bool = False
    """The buddy copy on a thread of its own (``copy_in_background``)."""
    """False: the ranks stop right after the restore, as if they crashed there."""


@dataclass
class Result:
    """What every rank of a phase reported; the digests are rank 0's (the gathered whole
    state is there only)."""

    ranks: list[dict[str, Any]] = field(default_factory=list)

    @property
    def restored(self) -> int | None:
        steps = {r["restored"] for r in self.ranks}
        assert len(steps) == 1, steps
        return steps.pop()

    def one(self, key: str) -> Any:
        values = {json.dumps(r[key], sort_keys=True) for r in self.ranks}
        assert len(values) == 1, (key, values)
        return json.loads(values.pop())

    def digest(self, key: str) -> Any:
        return self.ranks[0][key]

    @property
    def warnings(self) -> list[str]:
        return [w for r in self.ranks for w in r["warnings"]]


# -- one rank (forked)


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() == 1:  # the test died before the prctl
        os._exit(1)


def _build(world: int, hsdp: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 33), torch.nn.ReLU(), torch.nn.Linear(33, 5))
    if hsdp:
        mesh = init_device_mesh("cpu", (world // PER_NODE, PER_NODE),
                                mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def _digest(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """sha256 of the whole (unsharded) model and optimizer state: collective, the whole
    state on rank 0 (elsewhere the digest of nothing)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd = get_model_state_dict(model, options=options)
    optim_sd = get_optimizer_state_dict(model, optimizer, options=options)
    h = hashlib.sha256()
    for name in sorted(model_sd):
        h.update(name.encode())
        h.update(torch.as_tensor(model_sd[name]).numpy().tobytes())
    states: dict[str, Any] = dict(optim_sd.get("state", {}))  # type: ignore[arg-type]
    for param, st in sorted(states.items()):
        for name in sorted(st):
            h.update(f"{param}.{name}".encode())
            h.update(torch.as_tensor(st[name]).numpy().tobytes())
    return h.hexdigest()


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _rank(rank: int, phase: Phase) -> None:
    _die_with_parent()
    torch.set_num_threads(1)
    import torch.distributed as dist

    from elastic_ext.worker.control import CONTROL_DIR_ENV
    from elastic_ext.worker.snapshot.sharded import ShardedState

    os.environ.pop(CONTROL_DIR_ENV, None)  # round 0
    os.environ.update(LOCAL_WORLD_SIZE=str(PER_NODE), LOCAL_RANK=str(rank % PER_NODE))
    collected = _Collect()
    logging.getLogger("elastic_ext.worker.snapshot").addHandler(collected)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{phase.port}", rank=rank,
                            world_size=phase.world,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_S))
    model, optimizer = _build(phase.world, phase.hsdp)
    state = ShardedState(model, {"optimizer": optimizer}, {}, model_name="model",
                         local_dir=Path(phase.dirs[rank // PER_NODE]), snapshot_dir=None,
                         copy_every=phase.copy_every, copy_in_background=phase.background)
    restored = state.restore()
    step = restored.step if restored is not None else 0
    result: dict[str, Any] = {
        "rank": rank, "restored": restored.step if restored else None,
        "rest": restored.rest if restored else None,
        "source": restored.source if restored else None,
        "moved": restored.bytes if restored else 0,
        "restored_digest": _digest(model, optimizer), "digests": {}, "kept": None,
        "digest": None}
    if phase.keep:
        torch.manual_seed(100 + step)
        for s in range(step, step + phase.steps):
            loss = model(torch.randn(16, 8)).pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if state.copy_due(s + 1):
                state.copy(s + 1, {"pos": s + 1})
            if phase.digest_every_step:
                result["digests"][str(s + 1)] = _digest(model, optimizer)
        result["kept"] = state.keep(step + phase.steps, {"pos": step + phase.steps})
        result["digest"] = _digest(model, optimizer)
    result["warnings"] = collected.messages
    Path(phase.out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    # Only on success: after a failure the others wait in a collective, and the test's side
    # kills them as soon as it sees this rank fail.
    dist.destroy_process_group()


# -- the test's side


def run(phase: Phase) -> Result:
    """Every rank of ``phase``, forked; what they reported. Fails (killing the ranks) if
    one fails or the phase outlasts ``PHASE_S``."""
    out = Path(phase.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    phase = replace(phase, port=free_port("127.0.0.1"))
    context = mp.start_processes(_rank, args=(phase,), nprocs=phase.world, join=False,
                                 start_method="fork")
    deadline = time.monotonic() + PHASE_S
    try:
        while not context.join(timeout=0.5):
            if time.monotonic() > deadline:
                pytest.fail(f"the world-{phase.world} phase did not end in {PHASE_S:.0f} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
            process.join(5)
    return Result([json.loads((out / f"rank{r}.json").read_text()) for r in range(phase.world)])


@pytest.fixture
def nodes(tmp_path: Path) -> list[Path]:
    """Node-memory directories of three nodes."""
    dirs = [tmp_path / f"node{i}" for i in range(3)]
    for d in dirs:
        d.mkdir()
    return dirs


def lose(node: Path) -> None:
    """The node's memory is gone (its agent came back on a fresh machine)."""
    shutil.rmtree(node)
    node.mkdir()


def phase(world: int, dirs: list[Path], steps: int, tmp_path: Path, **kw: Any) -> Phase:
    return Phase(world=world, dirs=tuple(str(d) for d in dirs), steps=steps,
                 out=str(tmp_path / f"out-w{world}-{time.monotonic_ns()}"), **kw)


def assert_restored(result: Result, step: int, kept: str) -> None:
    """Every rank continued from ``step``, with the state ``kept`` bit for bit."""
    assert result.restored == step, result.ranks
    # from node memory: "peer" when some chunk went from one rank to another, else "local"
    assert result.one("source") == ("peer" if any(r["moved"] for r in result.ranks)
                                    else "local")
    assert result.one("rest") == {"pos": step}
    assert kept != hashlib.sha256().hexdigest()  # rank 0's digest is of the whole state
    assert result.digest("restored_digest") == kept


def kept_files(node: Path) -> list[str]:
    return sorted(n for n in os.listdir(node) if n.startswith("shards-"))


def flip_a_tensor_byte(path: Path) -> None:
    """Flip a bit in the first byte of the first tensor chunk of a kept set's file (after
    its length, the header's sha256 in hex and the JSON header, the buffer:
    ``shards.write_set``)."""
    raw = bytearray(path.read_bytes())
    (length,) = struct.unpack_from("<Q", raw)
    header = json.loads(raw[8 + 64:8 + length])
    start = next(c[2] for c in header["chunks"] if c[5] is not None and c[3] > 0)
    raw[8 + length + start] ^= 0x01
    path.write_bytes(bytes(raw))


def hand_offs(nodes: list[Path], tmp_path: Path, hsdp: bool) -> None:
    """World 4 (nodes 0, 1) -> node 1 lost -> world 2 (node 0) -> world 6 (nodes 0-2) ->
    node 0 lost -> world 4 (nodes 1, 2): each restore bit-exact."""
    first = run(phase(4, nodes[:2], 3, tmp_path, hsdp=hsdp))
    assert first.restored is None and first.warnings == []
    assert first.one("kept") == 3
    if hsdp:  # the replica twin holds the same chunks: nothing is copied
        assert kept_files(nodes[0]) == [f"shards-0000000003-w4-r{r}.bin" for r in (0, 1)]
    else:  # own sets, the previous step sent, both steps held for node 1's ranks
        assert kept_files(nodes[0]) == [f"shards-000000000{s}-w4-r{r}.bin"
                                        for s in (2, 3) for r in range(4)]
    lose(nodes[1])

    second = run(phase(2, nodes[:1], 2, tmp_path, hsdp=hsdp))
    assert_restored(second, 3, first.digest("digest"))
    if not hsdp:  # the two ranks share node 0's files out: rank 0 needs rows rank 1 serves
        assert second.one("source") == "peer"

    third = run(phase(6, nodes, 2, tmp_path, hsdp=hsdp))
    assert_restored(third, 5, second.digest("digest"))
    lose(nodes[0])

    fourth = run(phase(4, nodes[1:], 1, tmp_path, hsdp=hsdp))
    assert_restored(fourth, 7, third.digest("digest"))
    assert not any("not whole" in w or "differ" in w for w in fourth.warnings), fourth.warnings


def test_a_fully_sharded_model_survives_losing_a_node_at_any_world_size(
        nodes: list[Path], tmp_path: Path) -> None:
    hand_offs(nodes, tmp_path, hsdp=False)


def test_an_hsdp_model_survives_losing_a_node_at_any_world_size(
        nodes: list[Path], tmp_path: Path) -> None:
    hand_offs(nodes, tmp_path, hsdp=True)


def test_a_damaged_copy_falls_back_to_the_previous_whole_step(
        nodes: list[Path], tmp_path: Path) -> None:
    """Node 1 is lost, and on node 0 the copy of rank 2's step-3 set (kept nowhere else)
    has a flipped byte: step 3 is not whole, step 2 (the copies held before) is."""
    first = run(phase(4, nodes[:2], 3, tmp_path, digest_every_step=True))
    lose(nodes[1])
    damaged = nodes[0] / "shards-0000000003-w4-r2.bin"
    flip_a_tensor_byte(damaged)

    second = run(phase(2, nodes[:1], 1, tmp_path))
    assert_restored(second, 2, first.digest("digests")["2"])
    assert first.digest("digests")["2"] != first.digest("digest")
    warnings = second.warnings
    assert [w for w in warnings if str(damaged) in w and "fails its sha256" in w], warnings
    assert [w for w in warnings if "step 3 (world 4) is not whole" in w
            and "ranks [2]" in w], warnings
    assert not any("Traceback" in w for w in warnings)


def test_copies_in_the_background_restore_the_step_whose_copy_arrived(
        nodes: list[Path], tmp_path: Path) -> None:
    """With the copy on a thread of its own, the last step's copy may still be in flight at
    the keep: node 1's loss then costs that step, never a mix of two."""
    first = run(phase(4, nodes[:2], 3, tmp_path, background=True, digest_every_step=True))
    lose(nodes[1])
    second = run(phase(2, nodes[:1], 1, tmp_path))
    step = second.restored
    assert step in (2, 3), second.ranks
    assert_restored(second, step, first.digest("digests")[str(step)])


def test_a_restore_that_is_not_followed_by_a_keep_can_be_repeated(
        nodes: list[Path], tmp_path: Path) -> None:
    """The ranks die right after restoring: what they restored from is still kept."""
    first = run(phase(4, nodes[:2], 2, tmp_path))
    lose(nodes[1])
    crashed = run(phase(2, nodes[:1], 0, tmp_path, keep=False))
    assert_restored(crashed, 2, first.digest("digest"))
    again = run(phase(2, nodes[:1], 1, tmp_path))
    assert_restored(again, 2, first.digest("digest"))


def test_without_copies_a_lost_node_restores_nothing_rather_than_a_wrong_state(
        nodes: list[Path], tmp_path: Path) -> None:
    first = run(phase(4, nodes[:2], 2, tmp_path, copy_every=0))
    assert kept_files(nodes[0]) == [f"shards-0000000002-w4-r{r}.bin" for r in (0, 1)]
    lose(nodes[1])

    second = run(phase(2, nodes[:1], 1, tmp_path, copy_every=0))
    assert second.restored is None and second.one("source") is None
    # the model is as built, not half of step 2
    assert second.digest("restored_digest") == first.digest("restored_digest")
    assert [w for w in second.warnings if "step 2 (world 4) is not whole" in w
            and "ranks [2, 3]" in w], second.warnings
