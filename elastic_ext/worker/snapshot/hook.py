"""The snapshot hook a training loop calls: commit state cheaply, restore it on every rank.

It ties the other modules together: a commit stages the state in host memory (the
only part the loop waits for) and one background thread writes the payload and
then its manifest durably; ``keep`` leaves the state of the last completed step in
node memory for the next workers on the node; restore finds the newest step any rank
holds, in node memory or on disk, has the lowest holder send it to every rank, and
refuses a snapshot of a different model.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

import torch
import torch.distributed as dist

from elastic_ext.procinfo import pid_alive
from elastic_ext.worker.distributed import collective_device, rank, world_size
from elastic_ext.worker.snapshot.agreement import Copy, Holding, Kind, Plan, plan_restore
from elastic_ext.worker.snapshot.durable import newest_valid, write_snapshot
from elastic_ext.worker.snapshot.errors import (
    SnapshotError,
    SnapshotMismatchError,
    SnapshotWriteError,
)
from elastic_ext.worker.snapshot.handoff import gather, local_rank, node_id, send
from elastic_ext.worker.snapshot.layout import FORMAT_VERSION, Manifest, payload_name
from elastic_ext.worker.snapshot.local import LocalCopies
from elastic_ext.worker.snapshot.payload import load_payload_buffer, map_payload
from elastic_ext.worker.snapshot.retention import stale_tmp_files
from elastic_ext.worker.snapshot.rng import gather_rng, restore_rank_rng
from elastic_ext.worker.snapshot.staging import HostStaging, stage_for_keep

logger = logging.getLogger("elastic_ext.worker.snapshot")  # the whole package logs under one name

DEFAULT_KEEP = 3
RNG_KEY = "__rng__"
WRITER_NICE_ENV = "ELASTIC_EXT_SNAPSHOT_NICE"
DEFAULT_WRITER_NICE = 10
KEEP_COPY_TIMEOUT_S = 2.0
"""How long a keep waits for the device to copy the state to the host: within the
trainer's 3 s stop grace, so a hung kernel costs the copy, never the exit."""


@runtime_checkable
class Stateful(Protocol):
    """Anything with ``state_dict``/``load_state_dict``: modules, optimizers, schedulers."""

    def state_dict(self) -> Mapping[str, Any]: ...

    def load_state_dict(self, state_dict: Any, /) -> Any: ...


@dataclass(frozen=True)
class SnapshotInfo:
    """One durable snapshot, as the writer reports it."""

    step: int
    payload: Path
    manifest: Path
    sha256: str
    size: int
    blocking_s: float
    write_s: float


class Source:
    """Where a restored state came from, as the ``restore`` metrics event names it."""

    LOCAL = "local"  # this rank's own copy in node memory
    PEER = "peer"    # another rank's copy in node memory, sent over the process group
    DISK = "disk"    # a snapshot directory (this rank's or, sent, another's)
    NONE = "none"    # nothing to restore: a fresh start


@dataclass(frozen=True)
class Restored:
    """What :meth:`Snapshotter.restore` loaded; ``state`` holds the entries it did not apply."""

    step: int
    path: Path | None
    """The file loaded on this rank; None when it was sent by another rank."""
    state: dict[str, Any]
    created: float | None = None
    """Unix time the copy was written (its manifest's)."""
    source: str = Source.DISK
    """One of :class:`Source`'s values."""
    origin: str = ""
    """The copy in words, for messages: ``rank 2's copy of step 40 in node memory``."""
    bytes: int = 0
    """Size of the payload loaded (or sent, on the sending rank)."""
    seconds: float = 0.0
    """Time from the start of ``restore`` until the state was applied."""


def shape_mismatches(expected: Mapping[str, Any], found: Mapping[str, Any]) -> list[str]:
    """Human-readable differences between two flat tensor state dicts (keys and shapes)."""
    problems = []
    for key in expected:
        if key not in found:
            problems.append(f"missing {key!r}")
        elif isinstance(expected[key], torch.Tensor) and isinstance(found[key], torch.Tensor):
            want, got = tuple(expected[key].shape), tuple(found[key].shape)
            if want != got:
                problems.append(f"{key!r} has shape {got} in the snapshot, {want} in this model")
    problems.extend(f"unexpected {key!r}" for key in found if key not in expected)
    return problems


def _lower_writer_priority() -> None:
    """The writer runs at a lower priority so that it takes idle cycles, not the loop's.

    On a CPU-only machine the writer competes with the training threads for the same
    cores; ``ELASTIC_EXT_SNAPSHOT_NICE`` (0..19, default 10) sets how much it yields.
    """
    try:
        nice = int(os.environ.get(WRITER_NICE_ENV, DEFAULT_WRITER_NICE))
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), max(0, min(19, nice)))
    except (AttributeError, OSError, ValueError):
        pass


class Snapshotter:
    """Commits training state to ``directory``, keeps it in node memory, restores it.

    Global rank 0 writes snapshots into its own view of ``directory``, which need not
    be shared: restore asks every node. ``commit`` returns as soon as the state is in
    host memory; ``commit_now`` (for a preemption) returns once the snapshot is
    durable; ``keep`` writes the last completed step into node memory; ``restore``
    loads the newest step any rank holds on every rank. With ``torch.distributed``
    initialized, ``commit_now`` and ``restore`` are collective: call them on every rank.

    ``directory`` None: no snapshots on disk, only the copies in node memory.
    ``local``: where ``keep`` writes; by default the directory of this worker's
    etcd-ext agent (none under another launcher: ``keep`` does nothing).
    """

    def __init__(self, directory: str | os.PathLike[str] | None, *, keep: int = DEFAULT_KEEP,
                 capture_rng_states: bool = True,
                 local: LocalCopies | None | Literal["agent"] = "agent") -> None:
        if keep < 1:
            raise ValueError("keep must be at least 1")
        self.directory = Path(directory) if directory is not None else None
        self.keep = keep
        self.capture_rng_states = capture_rng_states
        self.local = LocalCopies.of_this_node() if local == "agent" else local
        self.is_writer = rank() == 0 and self.directory is not None
        self._staging = HostStaging()
        self._inflight: concurrent.futures.Future[SnapshotInfo | None] | None = None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        if self.is_writer:
            assert self.directory is not None
            self.directory.mkdir(parents=True, exist_ok=True)
            self._remove_stale_tmp()

    # -- committing
    def commit(self, step: int,
               state: Mapping[str, Any]) -> concurrent.futures.Future[SnapshotInfo | None]:
        """Copy ``state`` to host memory and write it in the background.

        ``state`` maps names to stateful objects (their ``state_dict()`` is taken) or
        to plain values (tensors, numbers, containers). If the previous write is still
        running, this waits for it first: that wait counts as blocking. The future
        holds the :class:`SnapshotInfo` once durable, or the write's exception; on
        ranks other than 0, and without a directory, it is already done and holds None.
        """
        start = time.perf_counter()
        rng = gather_rng() if self.capture_rng_states and self.directory is not None else None
        if not self.is_writer:
            done: concurrent.futures.Future[SnapshotInfo | None] = concurrent.futures.Future()
            done.set_result(None)
            return done
        self._wait_inflight()
        tree = _state_tree(state)
        if RNG_KEY in tree:
            raise ValueError(f"{RNG_KEY!r} is reserved for the RNG states")
        if rng is not None:
            tree[RNG_KEY] = rng
        copied, event = self._staging.capture(tree)
        blocking = time.perf_counter() - start
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="snapshot-writer",
                initializer=_lower_writer_priority)
        future: concurrent.futures.Future[SnapshotInfo | None] = self._executor.submit(
            self._write, step, copied, event, blocking)
        self._inflight = future
        return future

    def commit_now(self, step: int, state: Mapping[str, Any]) -> SnapshotInfo | None:
        """Commit and wait until the snapshot is durable; collective when distributed.

        Every rank returns only after rank 0's write succeeded, so none exits before
        the snapshot is on disk. Raises :class:`SnapshotWriteError` on every rank if
        it failed.
        """
        start = time.perf_counter()
        error: BaseException | None = None
        info: SnapshotInfo | None = None
        try:
            info = self.commit(step, state).result()
        except Exception as exc:  # reported to every rank below, raised on this one
            error = exc
        if world_size() > 1:
            failed = torch.tensor([1 if error is not None else 0], dtype=torch.int64,
                                  device=collective_device())
            dist.all_reduce(failed, op=dist.ReduceOp.MAX)
            if error is None and int(failed.item()):
                raise SnapshotWriteError(f"rank 0 could not write the snapshot of step {step} to "
                                         f"{self.directory}; see its log")
        if error is not None:
            raise error
        if self.local is not None and local_rank() == 0:  # every rank knows it is durable now
            self.local.drop_older_than(step)
        if info is not None:
            info = SnapshotInfo(info.step, info.payload, info.manifest, info.sha256, info.size,
                                blocking_s=time.perf_counter() - start, write_s=info.write_s)
        return info

    def flush(self, timeout: float | None = None) -> SnapshotInfo | None:
        """Wait for the write in flight, if any; returns its info or raises its error."""
        future = self._inflight
        if future is None:
            return None
        return future.result(timeout=timeout)

    def close(self) -> None:
        """Wait for the write in flight and stop the writer.

        The write's error, if any, stays in its future: ``close`` does not raise it.
        """
        try:
            self._wait_inflight()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None

    def _wait_inflight(self) -> None:
        future = self._inflight
        if future is not None:
            concurrent.futures.wait([future])
            self._inflight = None

    def _write(self, step: int, tree: Any, event: torch.cuda.Event | None,
               blocking_s: float) -> SnapshotInfo:
        start = time.perf_counter()
        if event is not None:
            event.synchronize()
        directory = self.directory
        assert directory is not None
        try:
            manifest = write_snapshot(directory, step, tree, self.keep)
        except (OSError, RuntimeError) as exc:
            raise SnapshotWriteError(f"could not write the snapshot of step {step} to {directory}: "
                                     f"{exc}; older snapshots are kept") from exc
        if self.local is not None:
            self.local.drop_older_than(step)
        return SnapshotInfo(step=step, payload=directory / manifest.payload,
                            manifest=directory / f"{Path(manifest.payload).stem}.json",
                            sha256=manifest.sha256, size=manifest.size,
                            blocking_s=blocking_s, write_s=time.perf_counter() - start)

    def keep_local(self, step: int, state: Mapping[str, Any], *,
                   timeout_s: float = KEEP_COPY_TIMEOUT_S) -> Manifest | None:
        """Keep the state of completed ``step`` in node memory for the next workers here.

        Synchronous and local (no collective): for a worker that is about to leave
        without a durable snapshot. The state is staged in host memory first
        (``staging.stage_for_keep``: CUDA tensors on a side stream, within
        ``timeout_s``), so the bytes are the same whichever device or local rank kept
        it. RNG states are left out (see ``elastic_ext.worker.snapshot.local``). None when
        there is nowhere to keep it, when another worker of this node kept that step
        already, or when the copy or the write failed (logged). On a GPU, keep only a
        step the device finished (``held.HeldStep`` decides which).
        """
        if self.local is None:
            return None
        staged = self.stage_kept(state, timeout_s=timeout_s)
        return None if staged is None else self.write_kept(step, staged)

    def stage_kept(self, state: Mapping[str, Any], *,
                   timeout_s: float = KEEP_COPY_TIMEOUT_S) -> Any | None:
        """The first half of ``keep_local``: ``state`` in host memory, None if the device
        did not finish the copy in time (logged)."""
        try:
            return stage_for_keep(_state_tree(state), timeout_s)
        except TimeoutError as exc:
            logger.warning("not keeping the state: %s (a kernel hangs?)", exc)
            return None

    def write_kept(self, step: int, staged: Any) -> Manifest | None:
        """The second half of ``keep_local``: write what ``stage_kept`` returned."""
        if self.local is None or staged is None:
            return None
        return self.local.write(step, staged)

    def _remove_stale_tmp(self) -> None:
        assert self.directory is not None
        for name in stale_tmp_files(os.listdir(self.directory), socket.gethostname(), pid_alive):
            logger.info("removing %s, left by a writer that died", self.directory / name)
            (self.directory / name).unlink(missing_ok=True)

    # -- restoring
    def latest(self) -> Manifest | None:
        """The newest snapshot here whose checksum verifies (local, no collective)."""
        return newest_valid(self.directory) if self.directory is not None else None

    def restore(self, objects: Mapping[str, Stateful], *, restore_rng_states: bool = True,
                weights_only: bool = True) -> Restored | None:
        """Load the newest step any rank holds into ``objects`` on every rank; None if none.

        Every rank reports its newest copy in node memory and (local rank 0 of each
        node) its newest valid snapshot on disk; the newest step wins, a copy in memory
        before one on disk, and the lowest rank holding it sends it to all, unless
        every rank holds that very copy. Modules are checked key by key and shape by
        shape before anything is loaded; a mismatch raises
        :class:`SnapshotMismatchError`. RNG states travel only in disk snapshots, every
        rank's: each rank gets its own (``rng.restore_rank_rng`` for another world size).
        """
        started = time.perf_counter()
        mine, paths = self._look()
        holdings = gather(mine)
        failed = [r for r, holding in enumerate(holdings) if holding.failed]
        if failed:
            raise SnapshotError(f"rank {failed[0]} could not list its snapshots in "
                                f"{self.directory}; see its log")
        plan = plan_restore(holdings)
        if rank() == 0:
            for warning in plan.warnings:
                logger.warning("%s", warning)
        if plan.step is None:
            return None
        return self._receive(plan, paths, objects, restore_rng_states, weights_only, started)

    def _look(self) -> tuple[Holding, dict[Kind, Path]]:
        """This rank's newest copy in node memory and, on local rank 0, on disk."""
        memory = disk = None
        failed = False
        paths: dict[Kind, Path] = {}
        if self.local is not None:
            try:
                memory = self.local.newest()
            except OSError as exc:
                logger.warning("could not look for kept state in %s: %s", self.local.directory,
                               exc)
            if memory is not None:
                paths[Kind.MEMORY] = self.local.directory / memory.payload
        if self.directory is not None and local_rank() == 0:
            try:
                disk = newest_valid(self.directory)
            except OSError as exc:
                logger.error("could not list snapshots in %s: %s", self.directory, exc)
                failed = True
            if disk is not None:
                paths[Kind.DISK] = self.directory / disk.payload
        return Holding(memory=Copy.of(memory), disk=Copy.of(disk), failed=failed,
                       node=node_id(self.directory)), paths

    def _receive(self, plan: Plan, paths: dict[Kind, Path], objects: Mapping[str, Stateful],
                 restore_rng_states: bool, weights_only: bool, started: float) -> Restored:
        """Ranks whose node holds the copy map it from there; the source sends it to the
        others (``Plan.receivers``), which load it from the bytes received."""
        assert plan.kind is not None and plan.copy is not None and plan.step is not None
        where = "node memory" if plan.kind is Kind.MEMORY else "its snapshot directory"
        origin = f"rank {plan.source}'s copy of step {plan.step} in {where}"
        path: Path | None = None
        buffer: torch.Tensor | None = None
        if rank() not in plan.receivers:
            path = paths.get(plan.kind)
            if path is None:  # a disk copy another local rank of this node reported
                assert self.directory is not None
                path = self.directory / payload_name(plan.step)
            origin = str(path)
            buffer = map_payload(path, plan.copy.size)
        if plan.receivers:
            buffer = send(buffer, plan.copy, plan.source, plan.receivers)
        assert buffer is not None
        payload = load_payload_buffer(buffer, origin, weights_only=weights_only)
        if plan.kind is Kind.DISK:
            source = Source.DISK
        else:
            source = Source.LOCAL if path is not None else Source.PEER
        state = self._apply(payload, origin, objects, restore_rng_states, plan.step)
        logger.info("restored step %d from %s", plan.step, origin)
        if self.local is not None and local_rank() == 0:
            self.local.drop_older_than(plan.step)
        return Restored(step=plan.step, path=path, state=state, created=plan.copy.created or None,
                        source=source, origin=origin, bytes=plan.copy.size,
                        seconds=time.perf_counter() - started)

    def _apply(self, payload: dict[str, Any], origin: str, objects: Mapping[str, Stateful],
               restore_rng_states: bool, step: int) -> dict[str, Any]:
        """Load ``payload``'s entries into ``objects``; the entries left over."""
        if payload.get("format") != FORMAT_VERSION:
            raise SnapshotError(f"{origin} is not a snapshot of format {FORMAT_VERSION}")
        state: dict[str, Any] = dict(payload["state"])
        for name, obj in objects.items():
            if name not in state:
                raise SnapshotMismatchError(
                    f"{origin} has no entry {name!r} (it has {sorted(state)})")
            saved = state.pop(name)
            if isinstance(obj, torch.nn.Module):
                problems = shape_mismatches(obj.state_dict(), saved)
                if problems:
                    shown = "; ".join(problems[:5]) + ("; ..." if len(problems) > 5 else "")
                    raise SnapshotMismatchError(
                        f"{origin} was taken of a different model than {name!r}: {shown}")
            try:
                obj.load_state_dict(saved)
            except (RuntimeError, ValueError, KeyError, TypeError) as exc:
                raise SnapshotMismatchError(f"{origin} does not fit {name!r}: {exc}") from exc
        rng = state.pop(RNG_KEY, None)
        if restore_rng_states and rng is not None:
            restore_rank_rng(rng, step)
        return state


def _state_tree(state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` with each stateful object replaced by its ``state_dict()``."""
    return {name: (value.state_dict() if isinstance(value, Stateful) else value)
            for name, value in state.items()}


__all__ = [
    "DEFAULT_KEEP",
    "DEFAULT_WRITER_NICE",
    "KEEP_COPY_TIMEOUT_S",
    "RNG_KEY",
    "WRITER_NICE_ENV",
    "Restored",
    "SnapshotInfo",
    "Source",
    "Snapshotter",
    "Stateful",
    "shape_mismatches",
]
