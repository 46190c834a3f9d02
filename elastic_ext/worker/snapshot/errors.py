"""The exceptions of the snapshot package, apart so that every module can raise them."""

from __future__ import annotations


class SnapshotError(RuntimeError):
    """A snapshot could not be written or restored."""


class SnapshotWriteError(SnapshotError):
    """Writing a snapshot failed (disk full, permissions, ...); older snapshots are untouched."""


class SnapshotMismatchError(SnapshotError):
    """The snapshot was taken of a different model or optimizer than the one given."""


__all__ = ["SnapshotError", "SnapshotMismatchError", "SnapshotWriteError"]
