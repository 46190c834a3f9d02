"""Reading the JSON-lines files etcd-ext and the trainer append to (metrics, agent events)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


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
