"""Files that are either absent, old or complete, and finding the newest intact snapshot.

A write goes to a temporary file, is fsynced, renamed over its target, and the
directory fsynced, so a crash at any moment leaves the previous file in place. The
sha256 is computed as the bytes go out, so a payload is never read back to hash it;
``verify`` recomputes it when a snapshot is chosen for restore.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from elastic_ext.worker.snapshot.layout import (
    FORMAT_VERSION,
    Manifest,
    manifest_name,
    payload_name,
    tmp_name,
)
from elastic_ext.worker.snapshot.payload import write_payload
from elastic_ext.worker.snapshot.retention import newest_first, retention_plan

logger = logging.getLogger("elastic_ext.worker.snapshot")  # the whole package logs under one name

_HASH_CHUNK = 8 << 20


def fsync_dir(directory: Path) -> None:
    """Make the renames and unlinks done in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class HashingWriter:
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

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


def durable_write(directory: Path, name: str, fill: Callable[[HashingWriter], object],
                  before_replace: Callable[[], None] | None = None) -> tuple[str, int]:
    """Write ``directory/name`` so that it is absent, old, or complete; returns (sha256, size).

    tmp file, fsync, rename over the target, fsync the directory. On any error the
    temporary file is removed (it may be what filled the disk) and the error raised.
    ``before_replace`` runs once the new content is safely on disk, just before the rename.
    """
    tmp = directory / tmp_name(name, socket.gethostname(), os.getpid())
    writer: HashingWriter | None = None
    try:
        with open(tmp, "wb", buffering=0) as raw:
            writer = HashingWriter(raw)
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
    fsync_dir(directory)
    return writer.hexdigest(), writer.size


def write_snapshot(directory: Path, step: int, tree: Any, keep: int, round_: int = 0) -> Manifest:
    """Write the snapshot of ``step`` (payload, then its manifest) and keep the newest ``keep``.

    Redoing a step (after a restart) retires the old manifest once the new payload is
    safely written, so the old snapshot is absent, never corrupt, until the new one lands.
    OSError and RuntimeError come from the disk or the serializer; a failure to prune
    old snapshots is only logged.
    """
    directory.mkdir(parents=True, exist_ok=True)
    old_manifest = directory / manifest_name(step)

    def retire_old_manifest() -> None:
        if old_manifest.exists():
            old_manifest.unlink()
            fsync_dir(directory)

    payload = {"format": FORMAT_VERSION, "step": step, "state": tree}
    sha, size = durable_write(directory, payload_name(step), lambda f: write_payload(f, payload),
                              before_replace=retire_old_manifest)
    manifest = Manifest(step=step, payload=payload_name(step), sha256=sha, size=size,
                        created=time.time(), round=round_)
    text = manifest.to_json().encode()
    durable_write(directory, manifest_name(step), lambda f: f.write(text))
    try:
        prune(directory, keep)
    except OSError as exc:
        logger.warning("could not prune old snapshots in %s: %s", directory, exc)
    return manifest


def prune(directory: Path, keep: int) -> None:
    """Delete all but the newest ``keep`` snapshots (manifests first: a half-deleted
    snapshot is simply absent) and payloads left without a manifest."""
    plan = retention_plan(os.listdir(directory), keep)
    for step in plan.manifests:
        (directory / manifest_name(step)).unlink(missing_ok=True)
    for step in plan.payloads:
        (directory / payload_name(step)).unlink(missing_ok=True)
    if plan.manifests or plan.payloads:
        fsync_dir(directory)


def file_sha256(path: Path) -> tuple[str, int]:
    """The sha256 and size of the file at ``path``, read in chunks."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return digest.hexdigest(), size


def verify(directory: Path, step: int) -> Manifest:
    """The manifest of ``step`` if its payload is complete and its checksum matches.

    Otherwise ValueError says what is wrong, or OSError that a file could not be read.
    """
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
    """The newest snapshot whose checksum verifies; each one skipped is logged by file name."""
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


__all__ = [
    "HashingWriter",
    "durable_write",
    "file_sha256",
    "fsync_dir",
    "newest_valid",
    "prune",
    "verify",
    "write_snapshot",
]
