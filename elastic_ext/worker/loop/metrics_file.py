"""The ``--metrics`` file of the bundled trainer and of loops on ``ElasticLoop``: one JSON
object per line, appended and flushed by global rank 0.

Every line has ``event``, ``step``, ``world_size``, ``restart`` (TORCHELASTIC_RESTART_COUNT)
and ``time`` (unix seconds). Events: ``start`` (``resumed_from``, ``rank`` and when the
worker was launched, its ``main`` ran, its group and its state were ready), ``restore``
(``source``: peer, local, disk or none; ``bytes``, ``seconds``), ``step`` (``loss``;
``epoch`` and ``offset``: where the data stands after it), ``snapshot`` (``blocking_s``,
logged once the snapshot is durable), ``stopped`` (the agent restarted the round at a
step boundary: ``reason``, ``kept``), ``fault`` (a worker left mid-step: ``why``,
``kept``), ``preempted`` (``signal``), ``done`` (``params_sha256`` from the trainer).
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any, TextIO


class MetricsLog:
    """Appends events; a no-op on ranks other than 0 or without a file.

    The snapshot writer thread logs ``snapshot`` events, hence the lock.
    """

    def __init__(self, path: Path | None, *, enabled: bool, world_size: int, restart: int) -> None:
        self.world_size = world_size
        self.restart = restart
        self._lock = threading.Lock()
        self._file: TextIO | None = None
        if path is not None and enabled:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def emit(self, event: str, step: int, **fields: Any) -> None:
        if self._file is None:
            return
        record = {"event": event, "step": step, "world_size": self.world_size,
                  "restart": self.restart, "time": time.time(), **fields}
        line = json.dumps(record) + "\n"
        with self._lock:
            if self._file is not None:
                self._file.write(line)
                self._file.flush()

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None



__all__ = ["MetricsLog"]
