"""The snapshot hook a training loop calls: commit state cheaply, restore it on every rank.

It ties the other modules together: a commit stages the state in host memory (the
only part the loop waits for) and one background thread writes the payload and
then its manifest durably; restore picks the newest snapshot that verifies on rank
0, loads that one on every rank, and refuses a snapshot of a different model.
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
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist

from elastic_ext.distributed import collective_device, rank, world_size
from elastic_ext.procinfo import pid_alive
from elastic_ext.snapshot.durable import durable_write, fsync_dir, newest_valid, verify
from elastic_ext.snapshot.errors import SnapshotError, SnapshotMismatchError, SnapshotWriteError
from elastic_ext.snapshot.layout import FORMAT_VERSION, Manifest, manifest_name, payload_name
from elastic_ext.snapshot.payload import load_payload, write_payload
from elastic_ext.snapshot.retention import retention_plan, stale_tmp_files
from elastic_ext.snapshot.rng import capture_rng, restore_rng
from elastic_ext.snapshot.staging import HostStaging

logger = logging.getLogger("elastic_ext.snapshot")  # the whole package logs under one name

DEFAULT_KEEP = 3
RNG_KEY = "__rng__"
WRITER_NICE_ENV = "ELASTIC_EXT_SNAPSHOT_NICE"
DEFAULT_WRITER_NICE = 10


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


@dataclass(frozen=True)
class Restored:
    """What :meth:`Snapshotter.restore` loaded; ``state`` holds the entries it did not apply."""

    step: int
    path: Path
    state: dict[str, Any]
    created: float | None = None
    """Unix time the snapshot became durable (its manifest's); None if that is unreadable."""


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
    """Commits and restores training state in ``directory``; global rank 0 writes.

    ``commit`` returns as soon as the state is in host memory; ``commit_now`` (for a
    preemption) returns once the snapshot is durable on every rank's view of it;
    ``restore`` picks and loads the newest valid snapshot on every rank. With
    ``torch.distributed`` initialized, ``commit_now`` and ``restore`` are collective:
    call them on every rank.
    """

    def __init__(self, directory: str | os.PathLike[str], *, keep: int = DEFAULT_KEEP,
                 capture_rng_states: bool = True) -> None:
        if keep < 1:
            raise ValueError("keep must be at least 1")
        self.directory = Path(directory)
        self.keep = keep
        self.capture_rng_states = capture_rng_states
        self.is_writer = rank() == 0
        self._staging = HostStaging()
        self._inflight: concurrent.futures.Future[SnapshotInfo | None] | None = None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        if self.is_writer:
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
        ranks other than 0 it is already done and holds None.
        """
        start = time.perf_counter()
        if not self.is_writer:
            done: concurrent.futures.Future[SnapshotInfo | None] = concurrent.futures.Future()
            done.set_result(None)
            return done
        self._wait_inflight()
        tree = {name: (value.state_dict() if isinstance(value, Stateful) else value)
                for name, value in state.items()}
        if RNG_KEY in tree:
            raise ValueError(f"{RNG_KEY!r} is reserved for the RNG states")
        if self.capture_rng_states:
            tree[RNG_KEY] = capture_rng()
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
        try:
            directory.mkdir(parents=True, exist_ok=True)
            old_manifest = directory / manifest_name(step)

            def retire_old_manifest() -> None:
                # Redoing a step after a restart: once the new payload is safely written, make
                # the old snapshot of this step absent (not "corrupt") until the new manifest lands.
                if old_manifest.exists():
                    old_manifest.unlink()
                    fsync_dir(directory)

            payload = {"format": FORMAT_VERSION, "step": step, "state": tree}
            sha, size = durable_write(directory, payload_name(step),
                                      lambda f: write_payload(f, payload),
                                      before_replace=retire_old_manifest)
            manifest = Manifest(step=step, payload=payload_name(step), sha256=sha, size=size,
                                created=time.time())
            text = manifest.to_json().encode()
            durable_write(directory, manifest_name(step), lambda f: f.write(text))
        except (OSError, RuntimeError) as exc:
            raise SnapshotWriteError(f"could not write the snapshot of step {step} to {directory}: "
                                     f"{exc}; older snapshots are kept") from exc
        try:
            self._apply_retention()
        except OSError as exc:
            logger.warning("could not prune old snapshots in %s: %s", directory, exc)
        return SnapshotInfo(step=step, payload=directory / payload_name(step),
                            manifest=directory / manifest_name(step), sha256=sha, size=size,
                            blocking_s=blocking_s, write_s=time.perf_counter() - start)

    def _apply_retention(self) -> None:
        plan = retention_plan(os.listdir(self.directory), self.keep)
        for step in plan.manifests:  # manifest first: a half-deleted snapshot is simply absent
            (self.directory / manifest_name(step)).unlink(missing_ok=True)
        for step in plan.payloads:
            (self.directory / payload_name(step)).unlink(missing_ok=True)
        if plan.manifests or plan.payloads:
            fsync_dir(self.directory)

    def _remove_stale_tmp(self) -> None:
        for name in stale_tmp_files(os.listdir(self.directory), socket.gethostname(), pid_alive):
            logger.info("removing %s, left by a writer that died", self.directory / name)
            (self.directory / name).unlink(missing_ok=True)

    # -- restoring
    def latest(self) -> Manifest | None:
        """The newest snapshot here whose checksum verifies (local, no collective)."""
        return newest_valid(self.directory)

    def restore(self, objects: Mapping[str, Stateful], *, restore_rng_states: bool = True,
                weights_only: bool = True) -> Restored | None:
        """Load the newest valid snapshot into ``objects``; None when there is none.

        Rank 0 chooses the snapshot and every rank loads that one, so all agree even
        if the directory changes meanwhile. Modules are checked key by key and shape
        by shape before anything is loaded; a mismatch raises
        :class:`SnapshotMismatchError`. RNG states are rank 0's, restored everywhere.
        """
        chosen: int | None = None
        failure = ""
        if rank() == 0:
            try:
                manifest = self.latest()
                chosen = manifest.step if manifest else None
            except OSError as exc:
                failure = f"could not list snapshots in {self.directory}: {exc}"
        if world_size() > 1:
            box = torch.tensor([-1 if chosen is None else chosen, 1 if failure else 0],
                               dtype=torch.int64, device=collective_device())
            dist.broadcast(box, src=0)
            chosen = None if int(box[0]) < 0 else int(box[0])
            if int(box[1]) and not failure:
                failure = "rank 0 could not list the snapshots; see its log"
        if failure:
            raise SnapshotError(failure)
        if chosen is None:
            return None
        return self._load(chosen, objects, restore_rng_states, weights_only)

    def _load(self, step: int, objects: Mapping[str, Stateful], restore_rng_states: bool,
              weights_only: bool) -> Restored:
        path = self.directory / payload_name(step)
        if rank() != 0:
            try:
                verify(self.directory, step)
            except (OSError, ValueError) as exc:
                raise SnapshotError(
                    f"rank 0 chose {path} but this rank cannot read it intact ({exc}); "
                    f"is {self.directory} on a filesystem every node shares?") from exc
        payload = load_payload(path, weights_only=weights_only)
        if payload.get("format") != FORMAT_VERSION:
            raise SnapshotError(f"{path} is not a snapshot of format {FORMAT_VERSION}")
        state: dict[str, Any] = dict(payload["state"])
        for name, obj in objects.items():
            if name not in state:
                raise SnapshotMismatchError(
                    f"{path} has no entry {name!r} (it has {sorted(state)})")
            saved = state.pop(name)
            if isinstance(obj, torch.nn.Module):
                problems = shape_mismatches(obj.state_dict(), saved)
                if problems:
                    shown = "; ".join(problems[:5]) + ("; ..." if len(problems) > 5 else "")
                    raise SnapshotMismatchError(
                        f"{path} was taken of a different model than {name!r}: {shown}")
            try:
                obj.load_state_dict(saved)
            except (RuntimeError, ValueError, KeyError, TypeError) as exc:
                raise SnapshotMismatchError(f"{path} does not fit {name!r}: {exc}") from exc
        rng = state.pop(RNG_KEY, None)
        if restore_rng_states and rng is not None:
            restore_rng(rng)
        logger.info("restored step %d from %s", step, path)
        return Restored(step=step, path=path, state=state, created=self._created(step))

    def _created(self, step: int) -> float | None:
        try:
            text = (self.directory / manifest_name(step)).read_text()
            return Manifest.from_json(text, step).created
        except (OSError, ValueError):
            return None


__all__ = [
    "DEFAULT_KEEP",
    "DEFAULT_WRITER_NICE",
    "RNG_KEY",
    "WRITER_NICE_ENV",
    "Restored",
    "SnapshotInfo",
    "Snapshotter",
    "Stateful",
    "shape_mismatches",
]
