"""State snapshots for training loops: cheap for the loop, durable on disk.

A commit copies the state to reusable host buffers (the only part the loop waits
for) and one background thread writes it: a temporary file, fsync, an atomic
rename, an fsync of the directory, then a small manifest carrying the payload's
sha256, written the same way. A snapshot exists only once its manifest does, so
a crash at any moment leaves the previous snapshot intact and loadable.

Restore takes the newest snapshot whose checksum verifies, skipping corrupt or
truncated ones with a warning that names the file, and refuses a snapshot taken
of a different model with :class:`SnapshotMismatchError`.

State replicated under DDP is written once, by global rank 0, into a directory
every rank can read (a shared filesystem when the job spans nodes). Sharded state
(FSDP, tensor parallel) is out of scope: every rank would have to write its part.

Layout of the directory::

    snapshot-0000000120.snap   payload (see ``write_payload``)
    snapshot-0000000120.json   manifest: step, payload name, sha256, size

The payload is a small header (``torch.save`` of the state with every dense tensor
replaced by a reference, plus a table of dtypes and shapes) followed by the tensors'
raw bytes. Writing raw bytes with ``os.write`` and hashing them with ``hashlib``
releases the GIL for all the heavy work, where ``torch.save`` copies each tensor into
a Python ``bytes`` object and checksums it with the GIL held, which stalls the
training thread. ``load_payload`` reads one back.
"""

from __future__ import annotations

import concurrent.futures
import copy
import errno
import hashlib
import io
import json
import logging
import os
import random
import re
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol, runtime_checkable

import numpy as np
import torch
import torch.distributed as dist

from elastic_ext.local.processes import pid_alive

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
DEFAULT_KEEP = 3
RNG_KEY = "__rng__"
PAYLOAD_MAGIC = b"EXTSNAP1"
_TENSOR_REF = "__elastic_ext_tensor__"
_ALIGN = 64
_NAME_RE = re.compile(r"^snapshot-(\d{10})\.(snap|json)$")
_TMP_RE = re.compile(r"^\.(snapshot-\d{10}\.(?:snap|json))\.(.+)\.(\d+)\.tmp$")
_HASH_CHUNK = 8 << 20


class SnapshotError(RuntimeError):
    """A snapshot could not be written or restored."""


class SnapshotWriteError(SnapshotError):
    """Writing a snapshot failed (disk full, permissions, ...); older snapshots are untouched."""


class SnapshotMismatchError(SnapshotError):
    """The snapshot was taken of a different model or optimizer than the one given."""


@runtime_checkable
class Stateful(Protocol):
    """Anything with ``state_dict``/``load_state_dict``: modules, optimizers, schedulers."""

    def state_dict(self) -> Mapping[str, Any]: ...

    def load_state_dict(self, state_dict: Any, /) -> Any: ...


# --------------------------------------------------------------------------- names
def payload_name(step: int) -> str:
    return f"snapshot-{step:010d}.snap"


def manifest_name(step: int) -> str:
    return f"snapshot-{step:010d}.json"


def parse_name(name: str) -> tuple[int, str] | None:
    """``(step, "snap" | "json")`` for a snapshot file name, None for anything else."""
    match = _NAME_RE.match(name)
    return (int(match.group(1)), match.group(2)) if match else None


def parse_tmp_name(name: str) -> tuple[str, str, int] | None:
    """``(target name, host, pid)`` for a writer's temporary file, None otherwise."""
    match = _TMP_RE.match(name)
    return (match.group(1), match.group(2), int(match.group(3))) if match else None


def tmp_name(name: str, host: str, pid: int) -> str:
    """The temporary name a writer uses; host and pid say whose it is if it is left behind."""
    return f".{name}.{host}.{pid}.tmp"


# ------------------------------------------------------------------ pure selection
@dataclass(frozen=True)
class Manifest:
    """What the manifest file says about one payload."""

    step: int
    payload: str
    sha256: str
    size: int
    created: float

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT_VERSION, "step": self.step, "payload": self.payload,
                           "sha256": self.sha256, "bytes": self.size, "created": self.created},
                          sort_keys=True)

    @classmethod
    def from_json(cls, text: str, expected_step: int) -> Manifest:
        """Parse and sanity-check a manifest; ValueError says what is wrong with it."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"manifest is not valid JSON ({exc})") from None
        if not isinstance(raw, dict):
            raise ValueError("manifest is not a JSON object")
        if raw.get("format") != FORMAT_VERSION:
            raise ValueError(f"unknown manifest format {raw.get('format')!r}")
        try:
            manifest = cls(step=int(raw["step"]), payload=str(raw["payload"]),
                           sha256=str(raw["sha256"]), size=int(raw["bytes"]),
                           created=float(raw["created"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"manifest lacks a valid field: {exc}") from None
        if manifest.step != expected_step or manifest.payload != payload_name(expected_step):
            raise ValueError(f"manifest describes step {manifest.step} / {manifest.payload}")
        if not re.fullmatch(r"[0-9a-f]{64}", manifest.sha256) or manifest.size < 0:
            raise ValueError("manifest has a malformed sha256 or size")
        return manifest


def newest_first(names: Iterable[str]) -> list[int]:
    """Steps that have a manifest among ``names``, newest first: the order restore tries."""
    steps = {parsed[0] for name in names if (parsed := parse_name(name)) and parsed[1] == "json"}
    return sorted(steps, reverse=True)


@dataclass(frozen=True)
class RetentionPlan:
    manifests: tuple[int, ...]
    payloads: tuple[int, ...]


def retention_plan(names: Iterable[str], keep: int) -> RetentionPlan:
    """What to delete so that only the newest ``keep`` snapshots remain.

    Payloads without a manifest (a crash between the two renames) are deleted when
    they are older than the newest complete snapshot; a newer one may still be in
    the middle of being written by someone, so it is left alone.
    """
    if keep < 1:
        raise ValueError("keep must be at least 1")
    manifests = newest_first(names)
    payloads = {parsed[0] for name in names if (parsed := parse_name(name)) and parsed[1] == "snap"}
    doomed = manifests[keep:]
    kept = set(manifests[:keep])
    newest = manifests[0] if manifests else None
    orphans = {s for s in payloads - kept if newest is not None and s < newest}
    return RetentionPlan(manifests=tuple(doomed), payloads=tuple(sorted(orphans | set(doomed) & payloads)))


def stale_tmp_files(names: Iterable[str], host: str, alive: Callable[[int], bool]) -> list[str]:
    """Temporary files this host's dead writers left behind (other hosts' are theirs to clean)."""
    stale = []
    for name in names:
        parsed = parse_tmp_name(name)
        if parsed and parsed[1] == host and not alive(parsed[2]):
            stale.append(name)
    return sorted(stale)


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


# ------------------------------------------------------------------- side effects
def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _HashingWriter:
    """A write-only file object that hashes what passes through, so the payload is read once.

    It writes to an unbuffered file and loops over short writes, so that the disk
    filling up surfaces here as the OSError it is. The error is kept for the caller,
    in case a serializer in between reports it in words of its own.
    """

    def __init__(self, raw: IO[bytes]) -> None:
        self._raw = raw
        self._hash = hashlib.sha256()
        self.size = 0
        self.error: OSError | None = None

    def write(self, data: bytes | memoryview) -> int:
        view = memoryview(data).cast("B")
        try:
            done = 0
            while done < len(view):
                written = self._raw.write(view[done:])
                if not written:
                    raise OSError(errno.EIO, "short write")
                done += written
        except OSError as exc:
            self.error = exc
            raise
        self._hash.update(view)
        self.size += len(view)
        return len(view)

    def flush(self) -> None:
        pass

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


def durable_write(directory: Path, name: str, fill: Callable[[_HashingWriter], object],
                  before_replace: Callable[[], None] | None = None) -> tuple[str, int]:
    """Write ``directory/name`` so that it is either absent, old, or complete; returns (sha256, size).

    tmp file, fsync, rename over the target, fsync the directory. On any error the
    temporary file is removed (it may be what filled the disk) and the error raised.
    ``before_replace`` runs once the new content is safely on disk, just before the rename.
    """
    tmp = directory / tmp_name(name, socket.gethostname(), os.getpid())
    writer: _HashingWriter | None = None
    try:
        with open(tmp, "wb", buffering=0) as raw:
            writer = _HashingWriter(raw)
            fill(writer)
            os.fsync(raw.fileno())
        if before_replace is not None:
            before_replace()
        os.replace(tmp, directory / name)
    except BaseException as exc:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            logger.warning("could not remove temporary file %s", tmp)
        if writer is not None and writer.error is not None and exc is not writer.error:
            raise writer.error from exc  # the disk's own words, not the serializer's
        raise
    _fsync_dir(directory)
    return writer.hexdigest(), writer.size


def file_sha256(path: Path) -> tuple[str, int]:
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return digest.hexdigest(), size


def verify(directory: Path, step: int) -> Manifest:
    """The manifest of ``step`` if its payload is complete and its checksum matches; else ValueError."""
    manifest_path = directory / manifest_name(step)
    manifest = Manifest.from_json(manifest_path.read_text(), step)
    payload = directory / manifest.payload
    try:
        size = payload.stat().st_size
    except FileNotFoundError:
        raise ValueError(f"payload {payload} is missing") from None
    if size != manifest.size:
        raise ValueError(f"payload {payload} has {size} bytes, the manifest says {manifest.size} "
                         "(truncated?)")
    digest, _ = file_sha256(payload)
    if digest != manifest.sha256:
        raise ValueError(f"payload {payload} has sha256 {digest[:16]}..., the manifest says "
                         f"{manifest.sha256[:16]}... (corrupt)")
    return manifest


def newest_valid(directory: Path) -> Manifest | None:
    """The newest snapshot whose checksum verifies; each one skipped is logged with its file name."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return None
    for step in newest_first(names):
        try:
            return verify(directory, step)
        except (OSError, ValueError) as exc:
            logger.warning("skipping snapshot %s: %s", directory / manifest_name(step), exc)
    return None


# ------------------------------------------------------------------ payload format
def _split_tensors(tree: Any, tensors: list[torch.Tensor]) -> Any:
    """The tree with each dense tensor replaced by ``{_TENSOR_REF: index}`` into ``tensors``."""
    if isinstance(tree, torch.Tensor):
        if tree.layout == torch.strided and not tree.is_nested and tree.device.type == "cpu" \
                and tree.is_contiguous():
            tensors.append(tree)
            return {_TENSOR_REF: len(tensors) - 1}
        return tree  # sparse and the like stay in the header, serialized by torch.save
    if isinstance(tree, Mapping):
        if _TENSOR_REF in tree:
            raise ValueError(f"{_TENSOR_REF!r} is a reserved key")
        out: dict[Any, Any] = OrderedDict() if isinstance(tree, OrderedDict) else {}
        for key, value in tree.items():
            out[key] = _split_tensors(value, tensors)
        return out
    if isinstance(tree, list):
        return [_split_tensors(v, tensors) for v in tree]
    if isinstance(tree, tuple):
        items = [_split_tensors(v, tensors) for v in tree]
        return type(tree)(*items) if hasattr(tree, "_fields") else tuple(items)
    return tree


def _join_tensors(tree: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(tree, Mapping):
        if set(tree) == {_TENSOR_REF}:
            return tensors[int(tree[_TENSOR_REF])]
        out: dict[Any, Any] = OrderedDict() if isinstance(tree, OrderedDict) else {}
        for key, value in tree.items():
            out[key] = _join_tensors(value, tensors)
        return out
    if isinstance(tree, list):
        return [_join_tensors(v, tensors) for v in tree]
    if isinstance(tree, tuple):
        items = [_join_tensors(v, tensors) for v in tree]
        return type(tree)(*items) if hasattr(tree, "_fields") else tuple(items)
    return tree


def _byte_view(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]


def _padding(offset: int) -> int:
    return -offset % _ALIGN


def write_payload(out: Any, payload: Mapping[str, Any]) -> None:
    """Magic, header length (8 bytes, little endian), header, then each tensor's bytes.

    ``out`` needs only ``write``. Every part starts at a multiple of 64 bytes.
    """
    tensors: list[torch.Tensor] = []
    skeleton = _split_tensors(dict(payload), tensors)
    table = [(str(t.dtype).removeprefix("torch."), tuple(t.shape)) for t in tensors]
    buffer = io.BytesIO()
    torch.save({"payload": skeleton, "tensors": table}, buffer)
    header = buffer.getvalue()
    offset = 0
    for part in (PAYLOAD_MAGIC, len(header).to_bytes(8, "little"), header):
        out.write(part)
        offset += len(part)
    for tensor in tensors:
        out.write(b"\0" * _padding(offset))
        offset += _padding(offset)
        view = _byte_view(tensor)
        for start in range(0, len(view), _HASH_CHUNK):
            out.write(view[start:start + _HASH_CHUNK])
        offset += len(view)


def load_payload(path: str | os.PathLike[str], *, weights_only: bool = True) -> dict[str, Any]:
    """Read a payload written by :func:`write_payload` (no checksum check: see :func:`verify`)."""
    with open(path, "rb", buffering=0) as f:
        if f.read(len(PAYLOAD_MAGIC)) != PAYLOAD_MAGIC:
            raise SnapshotError(f"{path} is not an elastic-ext snapshot payload")
        length = int.from_bytes(f.read(8), "little")
        header = torch.load(io.BytesIO(f.read(length)), map_location="cpu", weights_only=weights_only)
        offset = len(PAYLOAD_MAGIC) + 8 + length
        tensors = []
        for dtype_name, shape in header["tensors"]:
            dtype = getattr(torch, dtype_name)
            if not isinstance(dtype, torch.dtype):
                raise SnapshotError(f"{path} names an unknown dtype {dtype_name!r}")
            f.seek(_padding(offset), os.SEEK_CUR)
            offset += _padding(offset)
            tensor = torch.empty(tuple(shape), dtype=dtype)
            view = _byte_view(tensor)
            done = 0
            while done < len(view):
                n = f.readinto(view[done:])
                if not n:
                    raise SnapshotError(f"{path} ends inside a tensor")
                done += n
            offset += len(view)
            tensors.append(tensor)
    result = _join_tensors(header["payload"], tensors)
    assert isinstance(result, dict)
    return result


# ---------------------------------------------------------------- state capture
def capture_rng() -> dict[str, Any]:
    """RNG states of torch (CPU and CUDA), numpy and python, in types ``weights_only`` loads."""
    np_state: tuple[Any, ...] = np.random.get_state(legacy=True)  # type: ignore[assignment]
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": (str(np_state[0]), torch.from_numpy(np.asarray(np_state[1], dtype=np.int64)),
                  int(np_state[2]), int(np_state[3]), float(np_state[4])),
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        cuda_states = list(state["cuda"])
        if len(cuda_states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda_states)
        else:
            logger.warning("not restoring CUDA RNG: snapshot has %d devices, this process sees %d",
                           len(cuda_states), torch.cuda.device_count())


class HostStaging:
    """Copies a state tree into host buffers that are reused from one commit to the next.

    Refilling a buffer costs a memcpy; allocating a fresh one costs page faults as
    well, several times more on a large model. CUDA tensors go to pinned buffers with
    non-blocking copies; the returned event says when they have landed.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[Any, ...], torch.Tensor] = {}
        self._used: set[tuple[Any, ...]] = set()
        self._cuda = False

    def capture(self, tree: Any) -> tuple[Any, torch.cuda.Event | None]:
        self._used = set()
        self._cuda = False
        copied = self._copy(tree, ())
        for key in list(self._buffers):
            if key not in self._used:
                del self._buffers[key]
        event = None
        if self._cuda:
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record()
        return copied, event

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def _copy(self, obj: Any, path: tuple[Any, ...]) -> Any:
        if isinstance(obj, torch.Tensor):
            return self._copy_tensor(obj, path)
        if isinstance(obj, Mapping):
            out: dict[Any, Any] = OrderedDict() if isinstance(obj, OrderedDict) else {}
            for key, value in obj.items():
                out[key] = self._copy(value, (*path, key))
            return out
        if isinstance(obj, list):
            return [self._copy(v, (*path, i)) for i, v in enumerate(obj)]
        if isinstance(obj, tuple):
            items = [self._copy(v, (*path, i)) for i, v in enumerate(obj)]
            return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
        return copy.deepcopy(obj)

    def _copy_tensor(self, tensor: torch.Tensor, path: tuple[Any, ...]) -> torch.Tensor:
        t = tensor.detach()
        if t.layout != torch.strided or t.is_nested:
            return t.to("cpu", copy=True)
        buf = self._buffers.get(path)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.is_cuda)
            self._buffers[path] = buf
        self._used.add(path)
        buf.copy_(t, non_blocking=t.is_cuda)
        self._cuda = self._cuda or t.is_cuda
        return buf


# ------------------------------------------------------------------- the hook
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


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _collective_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


WRITER_NICE_ENV = "ELASTIC_EXT_SNAPSHOT_NICE"
DEFAULT_WRITER_NICE = 10


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
        self.is_writer = _rank() == 0
        self._staging = HostStaging()
        self._inflight: concurrent.futures.Future[SnapshotInfo | None] | None = None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        if self.is_writer:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._remove_stale_tmp()

    # -- committing
    def commit(self, step: int, state: Mapping[str, Any]) -> concurrent.futures.Future[SnapshotInfo | None]:
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
                max_workers=1, thread_name_prefix="snapshot-writer", initializer=_lower_writer_priority)
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
        if _world() > 1:
            failed = torch.tensor([1 if error is not None else 0], dtype=torch.int64,
                                  device=_collective_device())
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
        """Wait for the write in flight (its error stays in its future, not raised) and stop the writer."""
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
                    _fsync_dir(directory)

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
            _fsync_dir(self.directory)

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
        if _rank() == 0:
            try:
                manifest = self.latest()
                chosen = manifest.step if manifest else None
            except OSError as exc:
                failure = f"could not list snapshots in {self.directory}: {exc}"
        if _world() > 1:
            box = torch.tensor([-1 if chosen is None else chosen, 1 if failure else 0],
                               dtype=torch.int64, device=_collective_device())
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
        if _rank() != 0:
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
                raise SnapshotMismatchError(f"{path} has no entry {name!r} (it has {sorted(state)})")
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
        return Restored(step=step, path=path, state=state)


__all__ = [
    "DEFAULT_KEEP",
    "HostStaging",
    "Manifest",
    "Restored",
    "RetentionPlan",
    "SnapshotError",
    "SnapshotInfo",
    "SnapshotMismatchError",
    "SnapshotWriteError",
    "Snapshotter",
    "Stateful",
    "capture_rng",
    "durable_write",
    "load_payload",
    "newest_first",
    "newest_valid",
    "restore_rng",
    "retention_plan",
    "shape_mismatches",
    "stale_tmp_files",
    "verify",
    "write_payload",
]
