"""A sharded model's state (FSDP2, HSDP) kept, copied to another node, and handed off.

What ``Snapshotter`` does for a replicated (DDP) state, for one whose parameters and
optimizer state are DTensors spread over the ranks:

* **keep** (a fault, a membership stop): every rank writes its own set
  (``shards.ShardSet``) into node memory, with the buddy copies it holds and the set it
  last sent, so a step whose copy was still under way when the node died is whole at
  the previous step.
* **copy** (every ``copy_every`` steps, before the step boundary's agreement): without
  replicas across nodes, each rank sends its set to its keeper on the next node
  (``redundancy.keeper``, a buddy ring) and receives the set of the rank it keeps for,
  one flat buffer each way; the last two received are held (double-buffered), and the
  copy is waited for or runs in the background (``buddy``). Under
  HSDP the replica twin on another node already holds the same chunks: nothing is sent.
* **restore** (collective, at any world size): every rank reports the sets its node
  keeps; ``shard_agreement`` picks the newest step they cover whole; DCP's planner cuts
  it into the new world's shards and ``peer_reader.PeerReader`` moves the chunks from
  the ranks that hold them. A durable snapshot (DCP format, ``dcp-<step>`` in the
  snapshot directory, which every rank must be able to read) wins when it is newer.

GPU (NCCL): a set is captured by copying this rank's shards into pinned host memory on a
side stream that waits for the training stream's update, and the host waits for that
copy before the buffer is read (no copy of the whole state on the device); the chunks travel
through the GPU one piece at a time (``shard_transfer``). Gloo moves host memory
directly. The GPU path has not run here.
"""

from __future__ import annotations

import io
import logging
import os
import re
import shutil
import socket
import time
import warnings
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from elastic_ext.procinfo import pid_alive
from elastic_ext.worker import control
from elastic_ext.worker.snapshot.buddy import BuddyCopies
from elastic_ext.worker.snapshot.errors import SnapshotError, SnapshotMismatchError
from elastic_ext.worker.snapshot.hook import KEEP_COPY_TIMEOUT_S
from elastic_ext.worker.snapshot.optimizer_template import load_into, state_template
from elastic_ext.worker.snapshot.peer_reader import PeerReader
from elastic_ext.worker.snapshot.redundancy import ChunkKey, keeper
from elastic_ext.worker.snapshot.shard_agreement import ShardPlan, plan_shard_restore
from elastic_ext.worker.snapshot.shard_transfer import all_gather_objects
from elastic_ext.worker.snapshot.shards import (
    Layout,
    ShardSet,
    ShardSetDamagedError,
    capture,
    header_of,
    list_sets,
    metadata,
    plan_layout,
    read_set,
    with_digests,
    write_set,
)

logger = logging.getLogger("elastic_ext.worker.snapshot")  # the whole package logs under one name

REST_KEY = "__rest__"
"""Everything but the model and its optimizers (schedulers, the data position), as one
opaque item: the same on every rank."""
DURABLE_PREFIX = "dcp-"
_TMP_RE = re.compile(r"^\.shards-\d{10}-w\d+-r\d+\.bin\.(.+)\.(\d+)\.tmp$")  # write_set's
_LEN = 8


def is_sharded(module: torch.nn.Module) -> bool:
    """Whether ``module``'s parameters are DTensors (``fully_shard``, tensor parallel)."""
    return any(isinstance(p, DTensor) for p in module.parameters())


def replicas_of(module: torch.nn.Module) -> int:
    """The size of the replicate dimension of ``module``'s mesh: >1 under HSDP."""
    for p in module.parameters():
        if isinstance(p, DTensor):
            mesh = p.device_mesh
            return mesh.size(0) if mesh.ndim == 2 else 1
    return 1


@dataclass(frozen=True)
class ShardRestored:
    """What :meth:`ShardedState.restore` loaded."""

    step: int
    rest: dict[str, Any]
    source: str
    origin: str
    bytes: int


def durable_name(step: int) -> str:
    return f"{DURABLE_PREFIX}{step:010d}"


def newest_durable(directory: Path | None) -> int | None:
    """The newest complete DCP snapshot's step in ``directory`` (its ``.metadata`` written)."""
    if directory is None:
        return None
    try:
        names = os.listdir(directory)
    except OSError:
        return None
    steps = [int(n[len(DURABLE_PREFIX):]) for n in names
             if n.startswith(DURABLE_PREFIX) and n[len(DURABLE_PREFIX):].isdigit()
             and (directory / n / ".metadata").exists()]
    return max(steps, default=None)


class ShardedState:
    """Keeps, copies, snapshots and restores one sharded ``model`` with its optimizers.

    ``others`` (schedulers, anything ``Stateful``) travel whole, as does ``rest`` (the
    data position): they are the same on every rank. ``local_dir`` is the node-memory
    directory of this worker's agent (None: nothing is kept or copied); ``copy_every``
    0 turns the buddy copy off (a node loss then falls back to the durable snapshot);
    ``copy_in_background`` trades a step trained again (when a node dies while the copy
    is in flight) for the copy's time on the training thread.
    """

    def __init__(self, model: torch.nn.Module, optimizers: Mapping[str, torch.optim.Optimizer],
                 others: Mapping[str, Any], *, model_name: str, local_dir: Path | None,
                 snapshot_dir: Path | None, copy_every: int = 1, keep_snapshots: int = 3,
                 copy_in_background: bool = False) -> None:
        self.model, self.model_name = model, model_name
        self.optimizers, self.others = dict(optimizers), dict(others)
        self.local_dir, self.snapshot_dir = local_dir, snapshot_dir
        self.copy_every, self.keep_snapshots = copy_every, keep_snapshots
        self.copy_in_background = copy_in_background
        self._rank, self._world = dist.get_rank(), dist.get_world_size()
        self._per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        self._replicas = replicas_of(model)
        self._layout: Layout | None = None
        self._layout_of: tuple[int, ...] = ()
        self._group_params: dict[str, list[tuple[str, ...]]] = {}
        nodes = self._world // max(1, self._per_node)
        ring = (self._replicas == 1 and nodes >= 2 and self._world % self._per_node == 0
                and self.local_dir is not None and copy_every > 0)
        # Its own gloo group, so that the copy runs beside training (collective: every
        # rank decides the same and builds it).
        self._buddy = (BuddyCopies(self._rank, self._world, self._per_node,
                                   dist.new_group(backend="gloo")) if ring else None)
        if snapshot_dir is not None and self._rank == 0:
            snapshot_dir.mkdir(parents=True, exist_ok=True)
        # A group of its own for DCP's background save, as torch advises: its collectives
        # run beside the training's, which may be NCCL's (collective: every rank builds it).
        self._save_group = (dist.new_group(backend="gloo") if snapshot_dir is not None
                            else None)
        self._saving: Future[Any] | None = None
        self._copy_stream: torch.cuda.Stream | None = None

    # -- the state as DCP sees it
    def dcp_state(self) -> dict[str, Any]:
        """The model's and optimizers' state as DCP saves it (DTensors, param groups by
        name): what a durable snapshot holds beside :data:`REST_KEY`."""
        state: dict[str, Any] = {self.model_name: get_model_state_dict(self.model)}
        for name, optimizer in self.optimizers.items():
            state[name] = get_optimizer_state_dict(self.model, optimizer)
        return state

    def _rest_blob(self, rest: Mapping[str, Any]) -> bytes:
        """Everything that is the same on every rank, as one item: the others' state, the
        loop's ``rest``, and each optimizer's param groups (by parameter name)."""
        blob = io.BytesIO()
        torch.save({"others": {n: o.state_dict() for n, o in self.others.items()},
                    "rest": dict(rest), "param_groups": self._param_groups()}, blob)
        return blob.getvalue()

    def _param_groups(self) -> dict[str, list[dict[str, Any]]]:
        if self._layout is None:
            return {name: self.dcp_state()[name]["param_groups"] for name in self.optimizers}
        groups = {}
        for name, optimizer in self.optimizers.items():
            names = self._group_params[name]
            groups[name] = [{**{k: v for k, v in g.items() if k != "params"},
                             "params": list(names[i])}
                            for i, g in enumerate(optimizer.param_groups)]
        return groups

    def _tensors(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """``dcp_state`` without the param groups: the tensors a set holds."""
        return {name: ({"state": value["state"]} if name in self.optimizers else value)
                for name, value in state.items()}

    def _fingerprint(self) -> tuple[int, ...]:
        """Where the state's tensors live now: a cached layout is valid while this holds."""
        def ptr(t: torch.Tensor) -> int:
            return (t.to_local() if isinstance(t, DTensor) else t).data_ptr()
        ptrs = [ptr(p) for p in (*self.model.parameters(), *self.model.buffers())]
        for optimizer in self.optimizers.values():
            ptrs.extend(ptr(v) for st in optimizer.state.values() for v in st.values()
                        if isinstance(v, torch.Tensor))
        return tuple(ptrs)

    def _current_layout(self) -> Layout:
        fingerprint = self._fingerprint()
        if self._layout is None or fingerprint != self._layout_of:
            state = self.dcp_state()
            self._group_params = {name: [tuple(g["params"]) for g in state[name]["param_groups"]]
                                  for name in self.optimizers}
            self._layout = plan_layout(self._tensors(state))
            self._layout_of = self._fingerprint()  # get_optimizer_state_dict may create state
        return self._layout

    def _capture(self, step: int, rest: Mapping[str, Any], slot: int | None = None, *,
                 keeping: bool = False) -> ShardSet:
        layout = self._current_layout()
        extras = {REST_KEY: self._rest_blob(rest)}
        buffer = None
        if slot is not None:
            need = layout.nbytes + len(extras[REST_KEY]) + 64
            assert self._buddy is not None
            buffer = self._buddy.buffers[slot]
            if buffer is None or buffer.numel() < need:
                pinned = any(t.is_cuda for t in layout.sources)
                buffer = self._buddy.buffers[slot] = torch.empty(
                    need + 4096, dtype=torch.uint8, pin_memory=pinned)
        if not any(t.is_cuda for t in layout.sources):
            return capture(layout, extras, step=step, round_=control.current_round(),
                           world_size=self._world, owner=self._rank, buffer=buffer)
        # On a GPU: a side stream that starts once the training stream's queued work (the
        # update) is done, so the copy never waits behind the next step's kernels and the
        # training stream never waits for the copy; the host waits for the copy alone.
        # A keep does not wait for the training stream (a kernel may hang there): HeldStep
        # decides afterwards whether an update ran under the copy, and the copy has a time
        # limit.
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream()
        if not keeping:
            self._copy_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._copy_stream):
            shards = capture(layout, extras, step=step, round_=control.current_round(),
                             world_size=self._world, owner=self._rank, buffer=buffer)
            done = torch.cuda.Event()
            done.record()
        deadline = time.monotonic() + KEEP_COPY_TIMEOUT_S
        while keeping and not done.query():
            if time.monotonic() > deadline:
                raise TimeoutError(f"the device did not copy the shards to host memory "
                                   f"within {KEEP_COPY_TIMEOUT_S:.1f}s")
            time.sleep(0.001)
        done.synchronize()
        return shards

    # -- the buddy copy
    def copy_due(self, step: int) -> bool:
        return self._buddy is not None and step % self.copy_every == 0

    def copy(self, step: int, rest: Mapping[str, Any]) -> float:
        """Capture this rank's set of completed ``step`` and send it to its keeper
        (``buddy``: waited for, or with ``copy_in_background`` on a thread of its own);
        the seconds the training thread was held.

        Raises:
            Exception: this copy or the previous one failed (a peer died or hung).
        """
        assert self._buddy is not None
        started = time.perf_counter()
        slot = self._buddy.next_buffer()
        self._buddy.start(self._capture(step, rest, slot), background=self.copy_in_background)
        return time.perf_counter() - started

    # -- keeping in node memory
    def stage(self, step: int, rest: Mapping[str, Any]) -> ShardSet | None:
        """This rank's set of held ``step``, in host memory (the keep's first half); None
        when the device did not finish the copy in time (logged: a kernel hangs?)."""
        try:
            return self._capture(step, rest, keeping=True)
        except TimeoutError as exc:
            logger.warning("not keeping this rank's shards: %s (a kernel hangs?)", exc)
            return None

    def write(self, step: int, own: ShardSet | None) -> int | None:
        """Write ``own`` (from :meth:`stage`), the sets last sent and those held for others
        into node memory; ``step`` if this rank's own set was written, else None."""
        if self.local_dir is None:
            return None
        copies = self._buddy.kept() if self._buddy is not None else []
        sets = [*([own] if own is not None else []),
                *(c for c in copies if own is None or (c.owner, c.step) != (own.owner, own.step))]
        written = None
        for shards in sets:
            try:
                write_set(self.local_dir, with_digests(shards))
                if shards is own:
                    written = step
            except OSError as exc:
                logger.warning("could not keep the shards of step %d (rank %d) in %s: %s",
                               shards.step, shards.owner, self.local_dir, exc)
        return written

    def keep(self, step: int, rest: Mapping[str, Any]) -> int | None:
        return self.write(step, self.stage(step, rest))

    # -- durable snapshots
    def save(self, step: int, rest: Mapping[str, Any]) -> float:
        """A durable DCP snapshot of ``step``, done when this returns (collective); the
        seconds it took."""
        started = time.perf_counter()
        self.save_in_background(step, rest).result()
        return time.perf_counter() - started

    def save_in_background(self, step: int, rest: Mapping[str, Any]) -> Future[Any]:
        """Stage a DCP snapshot of ``step`` in host memory and write it in the background
        (``dcp.async_save`` on a gloo group of its own; collective). The previous one is
        waited for first. The future is done once every rank's files and the metadata are
        written; older snapshots beyond ``keep_snapshots`` are then removed."""
        assert self.snapshot_dir is not None
        try:
            self.wait_for_save()
        except Exception as exc:  # its own callback reported it; this one may succeed
            logger.debug("the previous snapshot failed: %s", exc)
        state = {**self.dcp_state(), REST_KEY: self._rest_blob(rest)}
        future = dcp.async_save(state, checkpoint_id=self.snapshot_dir / durable_name(step),
                                process_group=self._save_group)
        assert isinstance(future, Future)  # the default stager's answer (no staging response)
        if self._rank == 0:
            future.add_done_callback(self._after_save)
        self._saving = future
        return future

    def wait_for_save(self) -> None:
        """Wait for the snapshot in flight, if any; its error is raised."""
        saving, self._saving = self._saving, None
        if saving is not None:
            saving.result()

    def _after_save(self, future: Future[Any]) -> None:
        if future.exception() is None:
            self._drop_old_snapshots()

    def _drop_old_snapshots(self) -> None:
        assert self.snapshot_dir is not None
        steps = sorted((int(n[len(DURABLE_PREFIX):]) for n in os.listdir(self.snapshot_dir)
                        if n.startswith(DURABLE_PREFIX) and n[len(DURABLE_PREFIX):].isdigit()),
                       reverse=True)
        for old in steps[self.keep_snapshots:]:
            shutil.rmtree(self.snapshot_dir / durable_name(old), ignore_errors=True)

    # -- restoring
    def restore(self) -> ShardRestored | None:
        """Load the newest whole step (node memory of any rank, or the durable snapshot)
        into the model, optimizers and others on every rank (collective); None: nothing."""
        mine = self._read_kept()
        durable = newest_durable(self.snapshot_dir)
        reports = all_gather_objects(([s.header() for s in mine], durable))
        plan = plan_shard_restore([headers for headers, _ in reports])
        if self._rank == 0:
            for warning in plan.warnings:
                logger.warning("%s", warning)
        seen = [d for _, d in reports]
        known = [d for d in seen if d is not None]
        on_disk = min(known) if len(known) == len(seen) else None
        if self._rank == 0 and on_disk is None and any(d is not None for d in seen):
            logger.warning("only some ranks see a durable snapshot in %s: sharded snapshots "
                           "need a directory every rank can read (a shared file system)",
                           self.snapshot_dir)
        if plan.step is not None and (on_disk is None or plan.step >= on_disk):
            return self._load_from_memory(plan, mine)
        if on_disk is not None:
            return self._load_from_disk(on_disk)
        return None

    def _read_kept(self) -> list[ShardSet]:
        """The sets in node memory this rank serves: the node's local ranks share the
        files out round-robin; a damaged one is skipped, named."""
        if self.local_dir is None:
            return []
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if local_rank == 0:
            sweep_dead_writers(self.local_dir)
        found = []
        for i, (_, _, _, path) in enumerate(list_sets(self.local_dir)):
            if i % self._per_node != local_rank:
                continue
            try:
                found.append(read_set(path))
            except ShardSetDamagedError as exc:
                logger.warning("%s", exc)
        return found

    def _load_from_memory(self, plan: ShardPlan, mine: list[ShardSet]) -> ShardRestored:
        assert plan.step is not None
        local: dict[ChunkKey, torch.Tensor] = {}
        for key, index in plan.holdings.get(self._rank, {}).items():
            shards = mine[index]
            chunk = next(c for c in shards.chunks if c.key == key)
            local[key] = shards.chunk_bytes(chunk)
        lengths = {(fqn, tuple(off)): int(length) for h in plan.headers
                   for fqn, off, _s, length, *_ in h["chunks"]}
        chosen = {key for held in plan.holdings.values() for key in held}
        sets = [header_of(h, torch.empty(int(h["nbytes"]), dtype=torch.uint8))
                for h in plan.headers]
        reader = PeerReader(metadata(sets, chosen), local, holdings=plan.holdings,
                            lengths=lengths)
        rest = self._load(reader, f"the kept shards of step {plan.step}")
        if self.local_dir is not None:
            self._drop_kept_before(plan.step)
        origin = (f"the kept shards of step {plan.step} (world {plan.world_size}) in the "
                  "ranks' node memory")
        logger.info("restored step %d from %s", plan.step, origin)
        # As the replicated hand-off names it: "local" when every chunk was on this node.
        moved = int(sum(all_gather_objects(reader.moved_bytes)))
        return ShardRestored(step=plan.step, rest=rest, source="peer" if moved else "local",
                             origin=origin, bytes=moved)

    def _load_from_disk(self, step: int) -> ShardRestored:
        assert self.snapshot_dir is not None
        path = self.snapshot_dir / durable_name(step)
        rest = self._load(dcp.FileSystemReader(path), str(path), no_dist=False)
        logger.info("restored step %d from %s", step, path)
        return ShardRestored(step=step, rest=rest, source="disk", origin=str(path), bytes=0)

    def _load(self, reader: Any, origin: str, no_dist: bool = True) -> dict[str, Any]:
        """Load through DCP: from peers' memory the tensors only (``no_dist``: the param
        groups travel in the rest), from disk DCP's usual layout."""
        templates = ({name: state_template(self.model, optimizer, name, reader.metadata)
                      for name, optimizer in self.optimizers.items()} if no_dist else {})
        quick = bool(templates) and all(t is not None for t in templates.values())
        if quick:  # no optimizer step to create what DCP loads into
            state: dict[str, Any] = {self.model_name: get_model_state_dict(self.model),
                                     **templates, REST_KEY: b""}
        else:
            full = self.dcp_state()
            state = {**(self._tensors(full) if no_dist else full), REST_KEY: b""}
        try:
            with warnings.catch_warnings():  # no_dist is deliberate: the reader is collective
                warnings.filterwarnings("ignore", message=".*assuming the intent is to load")
                dcp.load(state, storage_reader=reader, no_dist=no_dist)
        except BaseException as exc:  # DCP wraps every failure in a CheckpointException
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            raise SnapshotMismatchError(f"{origin} does not fit this model and optimizer: "
                                        f"{_first_failure(exc)}") from exc
        packed = state[REST_KEY]  # the blob itself from memory; from disk, bytes holding it
        if isinstance(packed, bytes):
            packed = torch.load(io.BytesIO(packed), weights_only=True)
        set_model_state_dict(self.model, state[self.model_name])
        for name, optimizer in self.optimizers.items():
            loaded = dict(state[name])
            if quick:
                load_into(optimizer, self.model, loaded, packed["param_groups"][name])
                continue
            if "param_groups" not in loaded:
                loaded["param_groups"] = packed["param_groups"][name]
            set_optimizer_state_dict(self.model, optimizer, loaded)
        for name, obj in self.others.items():
            if name in packed["others"]:
                obj.load_state_dict(packed["others"][name])
        # The entries of objects not named yet (a framework's, tracked later) come back as
        # a replicated restore leaves them: for the framework to load itself.
        unclaimed = {n: v for n, v in packed["others"].items() if n not in self.others}
        return {**unclaimed, **packed["rest"]}

    def _drop_kept_before(self, step: int) -> None:
        assert self.local_dir is not None
        for old, _, _, path in list_sets(self.local_dir):
            if old < step:
                path.unlink(missing_ok=True)


def sweep_dead_writers(directory: Path) -> None:
    """Remove the temporary files of this host's writers that died mid-write (a worker
    killed while keeping): nobody else would, and they hold node memory."""
    host = socket.gethostname()
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        match = _TMP_RE.match(name)
        if match and match[1] == host and not pid_alive(int(match[2])):
            logger.info("removing %s, left by a worker that died keeping its shards",
                        directory / name)
            (directory / name).unlink(missing_ok=True)


def _first_failure(exc: BaseException) -> str:
    failures = getattr(exc, "failures", None)
    if isinstance(failures, Mapping) and failures:
        first = next(iter(failures.values()))
        return str(getattr(first, "args", [first])[0] if isinstance(first, tuple) else first)
    return str(exc)


__all__ = ["DURABLE_PREFIX", "REST_KEY", "ShardRestored", "ShardedState", "SnapshotError",
           "durable_name", "is_sharded", "keeper", "newest_durable", "replicas_of"]
