"""Which step every rank continues from, and who sends it: decided from what each holds.

Pure functions over the ranks' reports, so the rule (the newest step any rank holds;
holders of that step must agree on its checksum; a copy in node memory before one on
disk; the lowest holder sends) is tested without processes. The collective that
gathers the reports and moves the bytes is ``elastic_ext.worker.snapshot.handoff``.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from elastic_ext.worker.snapshot.layout import Manifest


class Kind(enum.Enum):
    MEMORY = "memory"  # a copy kept in node memory (elastic_ext.worker.snapshot.local)
    DISK = "disk"      # a snapshot in the rank's --snapshot-dir


@dataclass(frozen=True)
class Copy:
    """One restorable copy: its step, payload size and sha256 (hex), when it was written, and
    (kept in memory) the round whose workers trained it."""

    step: int
    size: int
    sha256: str
    created: float = 0.0
    round: int = 0

    @classmethod
    def of(cls, manifest: Manifest | None) -> Copy | None:
        return None if manifest is None else cls(manifest.step, manifest.size, manifest.sha256,
                                                 manifest.created, manifest.round)


@dataclass(frozen=True)
class Holding:
    """What one rank can restore from; ``failed``: it could not look (its log says why)."""

    memory: Copy | None = None
    disk: Copy | None = None
    failed: bool = False
    node: int = 0
    """Where the rank's snapshot directory is (a hash of its host name and the directory's
    path): ranks with the same one read the same disk copy instead of receiving it."""

    def copy(self, kind: Kind) -> Copy | None:
        return self.memory if kind is Kind.MEMORY else self.disk


@dataclass(frozen=True)
class Plan:
    """Where the restored state comes from; ``step`` None: nothing to restore."""

    step: int | None = None
    kind: Kind | None = None
    source: int = -1
    """The rank that sends its copy (the lowest holder)."""
    copy: Copy | None = None
    receivers: tuple[int, ...] = ()
    """The ranks whose node does not hold this very copy: only they receive it; the others
    read it where their node keeps it (node memory, or the node's snapshot directory)."""
    warnings: tuple[str, ...] = ()

    @property
    def everyone_holds(self) -> bool:
        """Every rank reads the copy on its own node: nothing is sent."""
        return self.step is not None and not self.receivers


_PREFERENCE = {Kind.MEMORY: 1, Kind.DISK: 0}  # at the same step, memory is faster


def plan_restore(holdings: Sequence[Holding]) -> Plan:
    """The newest step any rank holds, and the lowest rank holding it sends it.

    Holders of the newest step in node memory must hold the same bytes. If they do not,
    the copies trained in the newest round win when they agree: a node that was frozen
    may wake holding the same step from the round the others left it behind in (it
    completed an update they had not, and they went on without it). Otherwise that
    step's memory copies are not used and the next candidate is tried, with a warning.
    Disk snapshots of one step may differ in their RNG states (a step redone after a
    restart); the lowest rank's wins.
    """
    warnings: list[str] = []
    excluded: set[tuple[Kind, int]] = set()
    while True:
        candidates = {(copy.step, _PREFERENCE[kind], kind)
                      for holding in holdings for kind in Kind
                      if (copy := holding.copy(kind)) is not None
                      and (kind, copy.step) not in excluded}
        if not candidates:
            return Plan(warnings=tuple(warnings))
        step, _, kind = max(candidates, key=lambda c: (c[0], c[1]))
        holders = [(rank, copy) for rank, holding in enumerate(holdings)
                   if (copy := holding.copy(kind)) is not None and copy.step == step]
        digests = {copy.sha256 for _, copy in holders}
        if len(digests) > 1 and kind is Kind.MEMORY:
            newest = max(copy.round for _, copy in holders)
            latest = [(rank, copy) for rank, copy in holders if copy.round == newest]
            if len({copy.sha256 for _, copy in latest}) == 1:
                stale = sorted(rank for rank, copy in holders if copy.round != newest)
                warnings.append(f"ranks {stale} hold step {step} from a round before {newest}, "
                                "which the others trained again; using round "
                                f"{newest}'s")
                holders, digests = latest, {latest[0][1].sha256}
        if len(digests) > 1:
            listing = ", ".join(f"rank {rank}: {copy.sha256[:12]}" for rank, copy in holders)
            if kind is Kind.MEMORY:
                warnings.append(f"the ranks holding step {step} in node memory hold different "
                                f"states ({listing}); not using them")
                excluded.add((kind, step))
                continue
            warnings.append(f"snapshots of step {step} differ between ranks ({listing}); "
                            f"using rank {holders[0][0]}'s")
        source, copy = holders[0]
        on_nodes = {holdings[rank].node for rank, held in holders if held.sha256 == copy.sha256}
        receivers = tuple(rank for rank, holding in enumerate(holdings)
                          if not _reads_it(holding, kind, copy, on_nodes))
        return Plan(step=step, kind=kind, source=source, copy=copy, receivers=receivers,
                    warnings=tuple(warnings))


def _reads_it(holding: Holding, kind: Kind, copy: Copy, on_nodes: set[int]) -> bool:
    """Whether a rank can read ``copy`` without receiving it: it holds it, or (on disk,
    which only a node's local rank 0 reports) its node does."""
    own = holding.copy(kind)
    if own is not None and own.sha256 == copy.sha256 and own.step == copy.step:
        return True
    return kind is Kind.DISK and holding.node in on_nodes


__all__ = ["Copy", "Holding", "Kind", "Plan", "plan_restore"]
