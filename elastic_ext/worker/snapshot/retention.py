"""Which snapshot files to try first and which to delete, decided from file names alone.

Pure functions over a directory listing, so the rules (keep the newest N, never
touch a payload that may still be being written, clean only this host's dead
writers' temporary files) are tested without a disk or a clock.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from elastic_ext.worker.snapshot.layout import parse_name, parse_tmp_name


def newest_first(names: Iterable[str]) -> list[int]:
    """Steps that have a manifest among ``names``, newest first: the order restore tries."""
    steps = {parsed[0] for name in names if (parsed := parse_name(name)) and parsed[1] == "json"}
    return sorted(steps, reverse=True)


@dataclass(frozen=True)
class RetentionPlan:
    """Steps whose manifest, and steps whose payload, are to be deleted (manifests first)."""

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
    return RetentionPlan(manifests=tuple(doomed),
                         payloads=tuple(sorted(orphans | set(doomed) & payloads)))


def stale_tmp_files(names: Iterable[str], host: str, alive: Callable[[int], bool]) -> list[str]:
    """Temporary files this host's dead writers left behind (other hosts' are theirs to clean)."""
    stale = []
    for name in names:
        parsed = parse_tmp_name(name)
        if parsed and parsed[1] == host and not alive(parsed[2]):
            stale.append(name)
    return sorted(stale)


__all__ = ["RetentionPlan", "newest_first", "retention_plan", "stale_tmp_files"]
