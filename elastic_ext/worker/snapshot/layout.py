"""What the files of a snapshot directory are called, and what a manifest says.

Writer, restore, retention and outside tools (``elastic-ext status``, the chaos
runner) must agree on these names; nothing here touches the disk::

    snapshot-0000000120.snap   payload (see ``elastic_ext.worker.snapshot.payload``)
    snapshot-0000000120.json   manifest: step, payload name, sha256, size
    .snapshot-0000000120.snap.<host>.<pid>.tmp   a writer's file before its rename
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

FORMAT_VERSION = 1
_NAME_RE = re.compile(r"^snapshot-(\d{10})\.(snap|json)$")
_TMP_RE = re.compile(r"^\.(snapshot-\d{10}\.(?:snap|json))\.(.+)\.(\d+)\.tmp$")


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


@dataclass(frozen=True)
class Manifest:
    """What the manifest file says about one payload."""

    step: int
    payload: str
    sha256: str
    size: int
    created: float
    round: int = 0
    """For a copy kept in node memory: the rendezvous round whose workers trained it (a
    newer round's copy of a step supersedes an older one's); 0 on disk."""

    def to_json(self) -> str:
        fields = {"format": FORMAT_VERSION, "step": self.step, "payload": self.payload,
                  "sha256": self.sha256, "bytes": self.size, "created": self.created}
        if self.round:
            fields["round"] = self.round
        return json.dumps(fields, sort_keys=True)

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
                           created=float(raw["created"]), round=int(raw.get("round", 0)))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"manifest lacks a valid field: {exc}") from None
        if manifest.step != expected_step or manifest.payload != payload_name(expected_step):
            raise ValueError(f"manifest describes step {manifest.step} / {manifest.payload}")
        if not re.fullmatch(r"[0-9a-f]{64}", manifest.sha256) or manifest.size < 0:
            raise ValueError("manifest has a malformed sha256 or size")
        return manifest


__all__ = [
    "FORMAT_VERSION",
    "Manifest",
    "manifest_name",
    "parse_name",
    "parse_tmp_name",
    "payload_name",
    "tmp_name",
]
