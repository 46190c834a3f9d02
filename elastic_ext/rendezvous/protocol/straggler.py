"""Stragglers: a node whose own work per step is slower than the others' by a margin, for a
while. Pure, over the nodes' paces (``pace.py``); the node that watches everyone asks it
at each tick (``agent/stragglers.py``).

DDP trains at the pace of its slowest rank: N nodes make N samples per step time t_slow.
Without the slow node the others would make N - 1 per t_others, so leaving it out pays when
(N - 1) / t_others > N / t_slow. t_others is measured where it can be: the job's step time
while no node was slow, earlier in the round (``baseline``); a node slow from the round's
start is judged by the ratio of its own time to the others' instead (a slow machine is
slow in all of its step: t_others = t_slow x others' own / its own). Either way the same
gain holds when the job keeps its global batch (the others then take on its samples:
N / (N - 1) times the work each, in N / (N - 1) times the time). ``straggler=drop`` leaves
it out when it pays (free, as a node leaving on a preemption notice: at the next step
boundary, nothing trained twice), weighed again at every tick while it stays slow, and
only while the job keeps ``--nnodes`` MIN; ``warn`` (the default) only names it.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field

from elastic_ext.rendezvous.protocol.pace import Pace

MODES = ("off", "warn", "drop")


@dataclass(frozen=True)
class StragglerRules:
    """``--rdzv-conf straggler``, ``straggler_margin``, ``straggler_for``."""

    mode: str = "warn"
    margin: float = 1.5  # own time above this many times the others' median is slow
    for_s: float = 30.0  # slow for this long (continuously) before it is named

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"straggler={self.mode!r}: give one of {', '.join(MODES)}")


@dataclass(frozen=True)
class Slow:
    """A node named slow: its own time, the others' median, and whether to leave it out."""

    node: str
    own_s: float
    others_s: float
    step_s: float  # the job's step time now (every node's: DDP steps together)
    for_s: float
    gain: float  # samples per second without it / with it (> 1: leaving it out pays)
    drop: bool

    @property
    def message(self) -> str:
        then = ("it is to be left out at the next step boundary" if self.drop else
                "it stays (straggler=drop leaves out a node when that pays and MIN allows)")
        return (f"{self.node} is a straggler: its own step work takes {self.own_s:.3f}s, "
                f"the other nodes' {self.others_s:.3f}s ({self.own_s / self.others_s:.1f}x) "
                f"for {self.for_s:.0f}s; without it the job would train "
                f"{self.gain:.2f}x the samples per second: {then}")


def gain_without(node: str, paces: Mapping[str, Pace], baseline_s: float | None = None
                 ) -> float:
    """Samples per second without ``node`` over samples per second with it, from the
    nodes' paces (each with an own time): (N - 1) / t_others over N / t_slow, t_others the
    step time ``baseline_s`` measured while nobody was slow, else estimated from the own
    times (the module's docstring)."""
    n = len(paces)
    own = paces[node].own_s
    others = [p.own_s for name, p in paces.items() if name != node and p.own_s is not None]
    if n < 2 or own is None or not others:
        return 0.0
    t_slow = statistics.median(p.step_s for p in paces.values())
    t_others = baseline_s if baseline_s is not None else t_slow * max(others) / own
    return ((n - 1) / t_others) / (n / t_slow)


@dataclass
class StragglerJudge:
    """Which of a round's nodes are stragglers; ``observe`` at every tick of the watcher.
    One judge per round: its paces are the round's workers'."""

    rules: StragglerRules
    min_nodes: int
    _since: dict[str, float] = field(default_factory=dict)  # slow since, per node
    _named: set[str] = field(default_factory=set)  # named in their current slow spell
    _dropped: set[str] = field(default_factory=set)  # told to leave
    _baseline: float | None = None  # the round's step time while no node was slow
    _rise: tuple[float, float] | None = None  # a step time above the margin, and since when

    def observe(self, paces: Mapping[str, Pace | None], now: float) -> list[Slow]:
        """The nodes newly named slow among a round's ``paces`` (None: not known yet), each
        once per spell, and once more if dropping it pays only later in the spell. Only
        nodes with an own time compare (DDP's: ``pace.py``); with fewer than two, nobody
        is judged."""
        known = {n: p for n, p in paces.items() if p is not None and p.own_s is not None}
        if self.rules.mode == "off" or len(known) < 2:
            self._since.clear()
            self._named.clear()
            return []
        slow = self.slow_now(known)
        if slow:
            self._rise = None
        else:
            self._note_baseline(statistics.median(p.step_s for p in known.values()), now)
        named: list[Slow] = []
        for node in sorted(set(known) - slow):
            self._since.pop(node, None)
            self._named.discard(node)
        for node in sorted(slow):
            since = self._since.setdefault(node, now)
            if now - since < self.rules.for_s or node in self._dropped:
                continue
            pace = known[node]
            assert pace.own_s is not None
            gain = gain_without(node, known, self._baseline)
            drop = (self.rules.mode == "drop" and gain > 1.0
                    and len(paces) - 1 - len(self._dropped) >= self.min_nodes)
            if node in self._named and not drop:
                continue  # named already; dropping it does not pay (yet)
            self._named.add(node)
            if drop:
                self._dropped.add(node)
            others = statistics.median(p.own_s for n, p in known.items()
                                       if n != node and p.own_s is not None)
            named.append(Slow(node, pace.own_s, others,
                              statistics.median(p.step_s for p in known.values()),
                              now - since, gain, drop))
        for gone in set(self._since) - set(known):
            self._since.pop(gone)
            self._named.discard(gone)
        return named

    def _note_baseline(self, step_s: float, now: float) -> None:
        """Take ``step_s`` as the step time without a straggler, unless it jumped by more
        than the margin: the others' paces (waiting for the slow one in the all-reduce)
        can reach the store a heartbeat before the slow node's own, and taking the slowed
        step time then as the baseline would make dropping it look like a loss. A jump that
        no node explains for ``for_s`` is the whole job's new pace."""
        if self._baseline is None or step_s <= self.rules.margin * self._baseline:
            self._baseline, self._rise = step_s, None
            return
        if self._rise is None:
            self._rise = (step_s, now)
        elif now - self._rise[1] >= self.rules.for_s:
            self._baseline, self._rise = step_s, None

    def slow_now(self, paces: Mapping[str, Pace | None]) -> set[str]:
        """The nodes slower than the margin at this moment, however briefly (for
        ``elastic-ext status``)."""
        known = {n: p.own_s for n, p in paces.items() if p is not None and p.own_s is not None}
        if len(known) < 2:
            return set()
        return {n for n, own in known.items()
                if own > self.rules.margin * statistics.median(
                    o for m, o in known.items() if m != n)}
