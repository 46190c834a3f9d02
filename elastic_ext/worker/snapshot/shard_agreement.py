"""Which kept step a sharded job continues from: decided from what every rank holds.

The sharded analogue of ``agreement``: pure, so every rank computes the same answer
from the same reports and the rule is tested without processes. Each rank of the new
world reports the shard sets its node keeps (its own, a buddy's copy, an HSDP replica's
own set: ``shards.ShardSet`` headers). A step of one world can be restored when the
copies at hand cover every tensor of it whole; the newest such step wins, sets of the
same step at another world size being another candidate (a job restored and stopped
again before it trained). Copies of one chunk must agree (sha256): when they do not,
those of the newest round win if they agree among themselves (a frozen node woke with
an older round's copy), else the chunk is not used and the step is not restorable from
memory. Every unusable copy is named in a warning.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from elastic_ext.worker.snapshot.redundancy import ChunkKey

Report = Sequence[Mapping[str, Any]]
"""One rank's kept sets, as ``ShardSet.header()`` dicts (their ``chunks`` with sha256)."""


@dataclass(frozen=True)
class ShardPlan:
    """The step to restore and who can serve which chunk; ``step`` None: nothing in memory
    covers a whole step (``warnings`` say why)."""

    step: int | None = None
    world_size: int = 0
    """The world size that trained ``step``: the saved chunks are cut for it."""
    holdings: Mapping[int, Mapping[ChunkKey, int]] = field(default_factory=dict)
    """For each rank of the new world, the chunks it can serve and from which of its
    reported sets (an index into its report)."""
    headers: tuple[Mapping[str, Any], ...] = ()
    """One header per set used: together they give the checkpoint's metadata."""
    warnings: tuple[str, ...] = ()


def _name(key: ChunkKey) -> str:
    return f"{key[0]}@{list(key[1])}"


@dataclass
class _Copy:
    holder: int
    index: int
    sha256: str
    round: int
    length: int


def plan_shard_restore(reports: Sequence[Report]) -> ShardPlan:
    """The newest step whose chunks the reported sets cover whole, and its holders."""
    warnings: list[str] = []
    groups: dict[tuple[int, int], list[tuple[int, int, Mapping[str, Any]]]] = {}
    for holder, report in enumerate(reports):
        for index, header in enumerate(report):
            groups.setdefault((int(header["step"]), int(header["world_size"])), []).append(
                (holder, index, header))
    for step, world in sorted(groups, key=lambda g: (-g[0], -g[1])):
        found = _covering(step, world, groups[(step, world)], warnings)
        if found is not None:
            return ShardPlan(step=step, world_size=world, holdings=found[0], headers=found[1],
                             warnings=tuple(warnings))
    return ShardPlan(warnings=tuple(warnings))


def _covering(step: int, world: int, sets: list[tuple[int, int, Mapping[str, Any]]],
              warnings: list[str]
              ) -> tuple[dict[int, dict[ChunkKey, int]], tuple[Mapping[str, Any], ...]] | None:
    """The holdings that cover ``step`` at ``world`` whole, or None (with a warning)."""
    sizes: dict[str, tuple[int, ...]] = {}
    for _, _, header in sets:
        for fqn, (_, size) in header["tensors"].items():
            if sizes.setdefault(fqn, tuple(size)) != tuple(size):
                warnings.append(f"the kept sets of step {step} (world {world}) disagree on the "
                                f"shape of {fqn}; not using them")
                return None
    copies: dict[ChunkKey, list[_Copy]] = {}
    shapes: dict[ChunkKey, tuple[str | None, tuple[int, ...]]] = {}
    for holder, index, header in sets:
        for fqn, offsets, _start, length, sha, dtype, chunk_sizes in header["chunks"]:
            key = (fqn, tuple(offsets))
            copies.setdefault(key, []).append(
                _Copy(holder, index, sha, int(header["round"]), int(length)))
            shapes[key] = (dtype, tuple(chunk_sizes))
    usable: dict[ChunkKey, list[_Copy]] = {}
    for key, found in copies.items():
        agreed = _agreeing(step, key, found, warnings)
        if agreed:
            usable[key] = agreed
    volume: dict[str, int] = dict.fromkeys(sizes, 0)
    for key in usable:
        dtype, chunk_sizes = shapes[key]
        if dtype is not None:
            volume[key[0]] = volume.get(key[0], 0) + math.prod(chunk_sizes)
    short = sorted(fqn for fqn, size in sizes.items() if volume.get(fqn, 0) != math.prod(size))
    # A non-tensor item (the param groups, the loop's position) whose every copy was
    # refused leaves the step short as surely as a missing chunk.
    items = {key[0] for key, (dtype, _) in shapes.items() if dtype is None}
    short = sorted({*short, *(items - {key[0] for key in usable})})
    if short:
        owners = sorted({int(h["owner"]) for _, _, h in sets})
        missing = sorted(set(range(world)) - set(owners))
        shown = ", ".join(short[:3]) + (f" and {len(short) - 3} more" if len(short) > 3 else "")
        warnings.append(f"step {step} (world {world}) is not whole in memory: {shown} "
                        f"lack chunks; sets of ranks {missing} are nowhere kept")
        return None
    holdings: dict[int, dict[ChunkKey, int]] = {}
    used: dict[tuple[int, int], Mapping[str, Any]] = {}
    for key, agreed in usable.items():
        for copy in agreed:
            holdings.setdefault(copy.holder, {}).setdefault(key, copy.index)
    for holder, index, header in sets:
        if any(i == index for i in holdings.get(holder, {}).values()):
            used[(holder, index)] = header
    return holdings, tuple(used[k] for k in sorted(used))


def _agreeing(step: int, key: ChunkKey, found: list[_Copy], warnings: list[str]) -> list[_Copy]:
    """The copies of one chunk that may be used: all of them when they agree, else those of
    the newest round if they agree, else none."""
    if len({c.sha256 for c in found}) <= 1:
        return found
    newest = max(c.round for c in found)
    latest = [c for c in found if c.round == newest]
    listing = ", ".join(f"rank {c.holder}: {c.sha256[:12]} (round {c.round})" for c in found)
    if len({c.sha256 for c in latest}) == 1:
        stale = sorted({c.holder for c in found if c.round != newest})
        warnings.append(f"the copies of {_name(key)} at step {step} differ ({listing}); ranks "
                        f"{stale} hold an older round's, not used")
        return latest
    warnings.append(f"the copies of {_name(key)} at step {step} differ ({listing}); none is "
                    "used")
    return []


__all__ = ["Report", "ShardPlan", "plan_shard_restore"]
