"""The keeper's judgement of the others, apart from its I/O: who is dead or left, which
deaths to report, and the verdict to publish.

One keeper judges everyone (the watcher: ``joins.closer_of``) and publishes its
``liveness.Verdict``; the others judge only the watcher and go by its verdict, so that
liveness costs the store O(N) reads per interval for the job, not O(N) per agent. The
keeper's thread reads the store and hands what it read here (``Sighting``); what comes
back (``Judgement``) it turns into events and one verdict write. The probes of the presence
connections are injected (``gone_among``, ``answering``), as the clock is into ``Liveness``.

A judge that may be the slow one waits. When many of the nodes it watches go still at
once (more than half of at least ``MANY_WATCHED``), the likelier cause is its own
starvation or the store's, not that many machines died in the same second: it spares
those whose machine still accepts a fresh connection to its presence port (``answering``:
the kernel answers, so the machine is up) until they beat or their agent's port closes.
A machine that fell off the network does not answer and is judged as before; an agent
that died closes its port and is gone at once. What this costs: more than half of a large
job's agents frozen at once (their machines up) are found only when they are killed.

A follower is patient with the watcher. The watcher does the job's heaviest work (every
heartbeat, and in a round being formed its agent reads every join and writes the round),
and a follower judges only it: one follower's clock alone used to end the round of 1,024
nodes when a starved watcher's beat came late. A still watcher whose machine answers a
fresh dial is spared until it has been still ``WATCHER_PATIENCE`` heartbeat timeouts. A
killed watcher closes its port (gone at once), a lost machine does not answer; what this
costs: a frozen watcher whose machine is up is found after 2 timeouts instead of 1.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from elastic_ext.rendezvous.protocol.head import Head
from elastic_ext.rendezvous.protocol.joins import closer_of
from elastic_ext.rendezvous.protocol.liveness import LEFT, Liveness, Verdict
from elastic_ext.rendezvous.protocol.state import Phase, RunState

GoneAmong = Callable[[Iterable[str]], frozenset[str]]
"""Of the nodes given, those whose presence connection ended (``presence.PresenceWatch``)."""

Answering = Callable[[Iterable[str]], frozenset[str]]
"""Of the nodes given, those whose machine is not known silent (``presence.AnswerProbe``)."""

MANY_WATCHED = 8
"""The fewest watched nodes for which "more than half still at once" reads as the judge's
(or the store's) slowness: in a smaller job half is one or two nodes, as likely dead."""

WATCHER_PATIENCE = 2.0
"""Heartbeat timeouts a follower waits for a still watcher whose machine answers."""


def nobody_answers(nodes: Iterable[str]) -> frozenset[str]:
    """No machine known to answer: a judge in doubt spares nobody (the default)."""
    return frozenset()


@dataclass(frozen=True)
class Doubt:
    """A tick that judged nobody on a still counter: ``stale`` of the ``watched`` nodes were
    still at once, and ``spared`` of those have machines that answer."""

    stale: int
    watched: int
    spared: int
    watcher: str | None = None  # a follower spared the watcher (``WATCHER_PATIENCE``)

    @property
    def message(self) -> str:
        """What the keeper logs when a spell of doubt begins."""
        if self.watcher is not None:
            return (f"the watcher {self.watcher} went still but its machine answers on its "
                    f"presence port: it is likely busy or starved; waiting up to "
                    f"{WATCHER_PATIENCE:g} heartbeat timeouts before declaring it dead")
        return (f"{self.stale} of the {self.watched} nodes watched went still at once and "
                f"{self.spared} of them answer on their presence port: this judge or the "
                f"store is likely the slow one; waiting instead of declaring them dead")


def watcher_verdict(by: str, state: RunState, dead: frozenset[str], left: frozenset[str]
                    ) -> Verdict:
    """The verdict the watcher ``by`` publishes of ``state``: with the last closed round it
    names (its own, or the one an open round replaced) and the dead of that round, which
    the nodes that know their round only by its seat go by."""
    if state.phase is Phase.CLOSED:
        round_, lost = state.round, frozenset(n for n in dead if n in state.members)
    else:
        round_, lost = state.round - 1, frozenset(dead & set(state.previous))
    return Verdict(by, state.generation, dead, left, round_, lost)


def held_nodes(me: str, watcher: str | None, beats: Iterable[str]) -> Iterable[str]:
    """Whom ``me`` holds a presence connection to. Connections to everyone only from the
    watcher itself: while a dead watcher makes every keeper judge everyone, N keepers
    holding N connections each would be N²."""
    return beats if watcher in (None, me) else [watcher]


@dataclass(frozen=True)
class Sighting:
    """What one tick read: the head after the read, the watcher as the tick began, whether
    this keeper judges everyone, whom it would judge, their heartbeats, the verdict it read
    and the whole state (only when it judges everyone; None otherwise)."""

    head: Head | None
    watcher: str | None
    judging: bool
    nodes: frozenset[str]
    beats: Mapping[str, bytes | None]
    verdict: Verdict | None
    state: RunState | None


@dataclass(frozen=True)
class Death:
    """A death to report (an event, once per death): the node, whether it left, and what
    the event says."""

    node: str
    left: bool
    message: str


@dataclass(frozen=True)
class Judgement:
    """The tick's verdict: the dead and, of them, who left; the deaths not reported yet,
    and the verdict to publish, if it changed."""

    dead: frozenset[str]
    left: frozenset[str]
    to_report: tuple[Death, ...] = ()
    publish: Verdict | None = None
    doubt: Doubt | None = None


class Watcher:
    """One keeper's judgement from tick to tick; only the keeper's tick thread uses it."""

    def __init__(self, me: str, liveness: Liveness) -> None:
        self._me = me
        self.liveness = liveness
        self.dead: frozenset[str] = frozenset()  # the last tick's judgement
        self._nodes: tuple[object, frozenset[str]] = (None, frozenset())  # whom it names
        self._reported: set[str] = set()  # once per death, not at every round
        self._inherited: set[str] = set()  # dead by the last verdict we trusted
        self._inherited_left: set[str] = set()
        self._published: Verdict | None = None
        self._doubt: Doubt | None = None

    def nodes(self, state: RunState | None, also: set[str]) -> frozenset[str]:
        """Whom a keeper that judges everyone judges: the nodes ``state`` names and
        ``also``; worked out once per state (O(N)), not at every tick."""
        if self._nodes[0] != (state, also):
            known = state.known_nodes() if state else set()
            self._nodes = ((state, also), frozenset((known | also) - {self._me}))
        return self._nodes[1]

    def judge(self, seen: Sighting, gone_among: GoneAmong,
              answering: Answering = nobody_answers) -> Judgement:
        """(dead, left) among whom ``seen`` names, what to report of it and the verdict to
        publish, and the doubt that spared nodes, if any. Only the watcher publishes, and
        only a judgement of everyone: a tick that read the state that made us the watcher
        read one heartbeat, not all."""
        self.liveness.forget(seen.beats)  # judge only whom we watch now
        self.liveness.observe(seen.beats)
        self._doubt = None
        dead, left = self._dead_and_left(seen, gone_among, answering)
        self.dead = dead
        to_report = tuple(_death(node, node in left, seen)
                          for node in sorted(dead - self._reported))
        self._reported = (self._reported | dead) - (set(seen.beats) - dead)
        state = seen.state
        verdict = watcher_verdict(self._me, state, dead, left) \
            if seen.judging and state is not None and closer_of(state) == self._me else None
        publish = verdict if verdict is not None and verdict != self._published else None
        return Judgement(dead, left, to_report, publish, self._doubt)

    def published(self, verdict: Verdict) -> None:
        """``verdict`` was written: the next write is for a change of it."""
        self._published = verdict

    def _dead_and_left(self, seen: Sighting, gone_among: GoneAmong, answering: Answering
                       ) -> tuple[frozenset[str], frozenset[str]]:
        """Our own judgement when we watch everyone, else the watcher's published verdict
        and our judgement of the watcher. A node that becomes the watcher keeps the last
        verdict's dead until they beat."""
        beats, verdict, head = seen.beats, seen.verdict, seen.head
        still = self.liveness.dead_among(beats)
        spared = self._unless_doubtful(still, beats, answering) if seen.judging \
            else self._patient_with_the_watcher(still, seen.watcher, answering)
        own = spared | gone_among(held_nodes(self._me, seen.watcher, beats))
        left = {n for n in own if beats.get(n) == LEFT}
        if seen.judging:
            inherited = {n for n in self._inherited & seen.nodes
                         if not self.liveness.moved(n)}
            return frozenset(own | inherited), frozenset(left | (self._inherited_left
                                                                 & inherited))
        if head is not None and verdict is not None and verdict.by == seen.watcher \
                and verdict.generation == head.generation:
            self._inherited, self._inherited_left = set(verdict.dead), set(verdict.left)
            return frozenset(own | verdict.dead), frozenset(left | verdict.left)
        return frozenset(own), frozenset(left)

    def _unless_doubtful(self, dead: frozenset[str], watched: Mapping[str, object],
                         answering: Answering) -> frozenset[str]:
        """``dead`` less the nodes spared because many went still at once (the module's
        docstring): only those judged on a still counter, and only those whose machine
        answers."""
        still = frozenset(n for n in dead if not self.liveness.certain(n))
        if len(watched) < MANY_WATCHED or 2 * len(still) <= len(watched):
            return dead
        spared = answering(still) & still
        if spared:
            self._doubt = Doubt(len(still), len(watched), len(spared))
        return dead - spared

    def _patient_with_the_watcher(self, dead: frozenset[str], watcher: str | None,
                                  answering: Answering) -> frozenset[str]:
        """``dead`` less the watcher while it has been still fewer than
        ``WATCHER_PATIENCE`` timeouts and its machine answers (the module's docstring)."""
        if watcher is None or watcher not in dead or self.liveness.certain(watcher) \
                or self.liveness.still_for(watcher) >= WATCHER_PATIENCE * self.liveness.timeout:
            return dead
        if watcher not in answering([watcher]):
            return dead
        self._doubt = Doubt(1, 1, 1, watcher)
        return dead - {watcher}


def _death(node: str, left: bool, seen: Sighting) -> Death:
    """The report of ``node``'s death: it left, or we (or the watcher we go by) declared
    it dead."""
    if left:
        return Death(node, True, f"node {node} left")
    by = "" if seen.judging else f", judged by {seen.watcher}"
    return Death(node, False, f"node {node} declared dead (no heartbeat change{by})")
