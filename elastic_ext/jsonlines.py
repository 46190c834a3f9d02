"""Reading the JSON-lines files etcd-ext and the trainer append to (metrics, agent events)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


def read_json_lines(path: Path) -> list[dict[str, Any]]:
    """Every complete JSON object in ``path``, one per line; none if the file is absent.

    A line that does not parse (the last one, still being written) is skipped.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    records = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


class JsonLinesTail:
    """Reads a JSON-lines file incrementally, for a poll that would otherwise parse the whole
    file each time (a test waiting on a long run's metrics spent a few percent of a core on
    it). A line still being written waits for the next poll."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.events: list[dict[str, Any]] = []
        self._offset = 0

    def poll(self) -> list[dict[str, Any]]:
        """The records completed since the last poll (also appended to ``events``)."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n")
        if end < 0:
            return []
        self._offset += end + 1
        new: list[dict[str, Any]] = []
        for line in data[:end].splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                logger.warning("unreadable line in %s: %r", self.path, line[:200])
                continue
            if isinstance(record, dict):
                new.append(record)
        self.events.extend(new)
        return new
