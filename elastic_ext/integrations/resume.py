"""What the framework integrations share for their framework's resume path.

The restored step is written as the framework's checkpoint in a directory in node
memory (``/dev/shm``), read once at the start of training and removed then. A worker
that dies before that leaves it behind, so each new one sweeps the directories of
workers no longer alive on this machine (same pid namespace). Until the framework
has built what it restores into, the restored entries are kept as they came.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from elastic_ext.control_channel import node_memory_directory, remove_abandoned
from elastic_ext.worker.loop import ElasticLoop
from elastic_ext.worker.snapshot import Restored, SnapshotMismatchError, Stateful

PREFIX = "elastic-ext-resume-"


def new_resume_dir() -> Path:
    """A fresh directory of this process's in node memory, after removing those of
    workers no longer alive."""
    base = node_memory_directory()
    remove_abandoned(base, PREFIX)
    return Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=base))


class Carried:
    """A restored entry, kept as it came until the framework's own object replaces it
    (``ElasticLoop.framework.track``): a fault before training started keeps the whole step."""

    def __init__(self, state: Mapping[str, Any]) -> None:
        self.state = dict(state)

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self.state = dict(state_dict)


def restore_for_framework(loop: ElasticLoop, model: Stateful, kept: Sequence[str],
                          callback: str, **also: Stateful) -> Restored | None:
    """An integration's collective restore: the newest step any rank holds, loaded into
    ``model`` (and ``also``: optimizers the framework made already), its framework's
    entries (``kept``) carried until the framework's objects replace them; None for a
    fresh start (nothing, or a step 0 kept before training).

    Raises:
        SnapshotMismatchError: the newest state is of another model, or was not taken by
            ``callback`` (an entry of ``kept`` is missing).
    """
    loop.restore({"model": model, **also})
    restored = loop.framework.restored
    if restored is None or restored.step == 0:
        return None
    missing = [name for name in kept if name not in restored.state]
    if missing:
        raise SnapshotMismatchError(
            f"{restored.origin} has no {', '.join(missing)}: it was not taken by {callback}; "
            "give this run another --snapshot-dir")
    loop.framework.track(**{name: Carried(restored.state[name]) for name in kept})
    return restored


__all__ = ["PREFIX", "Carried", "new_resume_dir", "restore_for_framework"]
