"""State snapshots for training loops: cheap for the loop, durable on disk.

A commit copies the state to reusable host buffers (the only part the loop waits
for) and one background thread writes it: a temporary file, fsync, an atomic
rename, an fsync of the directory, then a small manifest carrying the payload's
sha256, written the same way. A snapshot exists only once its manifest does, so
a crash at any moment leaves the previous snapshot intact and loadable.

Restore takes the newest snapshot whose checksum verifies, skipping corrupt or
truncated ones with a warning that names the file, and refuses a snapshot taken
of a different model with :class:`SnapshotMismatchError`.

State replicated under DDP is written once, by global rank 0, into its own view of
the directory; it need not be shared. A worker that leaves without a durable
snapshot keeps its last completed step in node memory (``local``), and restore
takes the newest step any rank holds, checks that its holders agree (``agreement``)
and has the lowest holder send it to every rank (``handoff``). Sharded state (FSDP2,
HSDP) is ``sharded``'s: every rank keeps its own chunks (``shards``), a copy goes to
another node (``redundancy``: the HSDP replica twin, else a buddy ring), and the next
world reshards the newest whole step (``shard_agreement``) from peers' memory through
DCP's planner (``peer_reader`` over ``memory_storage``, moved by ``shard_transfer``).

This package exports what a training loop and an operator need. The parts, one
job each, are importable on their own: ``layout`` (file names, the manifest),
``retention`` (what to keep and delete), ``durable`` (atomic writes, verification),
``payload`` (the file format), ``tree`` (the walk over a state tree), ``staging``
(host buffers), ``held`` (which step the state holds, on the CPU and the GPU), ``rng``
(RNG states), ``local`` (copies in node memory), ``agreement`` (who restores what,
decided), ``handoff`` (the collectives that move it), ``errors`` and ``hook``
(:class:`Snapshotter`).
"""

from __future__ import annotations

from elastic_ext.worker.snapshot.durable import newest_valid, verify
from elastic_ext.worker.snapshot.errors import (
    SnapshotError,
    SnapshotMismatchError,
    SnapshotWriteError,
)
from elastic_ext.worker.snapshot.held import HeldStep
from elastic_ext.worker.snapshot.hook import (
    DEFAULT_KEEP,
    Restored,
    SnapshotInfo,
    Snapshotter,
    Source,
    Stateful,
)
from elastic_ext.worker.snapshot.layout import Manifest
from elastic_ext.worker.snapshot.local import LocalCopies
from elastic_ext.worker.snapshot.payload import load_payload

__all__ = [
    "DEFAULT_KEEP",
    "HeldStep",
    "LocalCopies",
    "Manifest",
    "Restored",
    "SnapshotError",
    "SnapshotInfo",
    "SnapshotMismatchError",
    "SnapshotWriteError",
    "Snapshotter",
    "Source",
    "Stateful",
    "load_payload",
    "newest_valid",
    "verify",
]
