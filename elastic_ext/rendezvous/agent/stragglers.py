"""The watcher's eye for stragglers: the paces in the round's heartbeats, the judge's
verdict (``protocol/straggler.py``), an event naming each slow node and, with
``straggler=drop``, the slow node left out of the job (``drain.with_left_out``: it leaves
as on a settled preemption notice, so the others restart for free at the next step
boundary and train on). Only the node that judges everyone reads every heartbeat, so only
it judges; the keeper calls ``observe`` at each of its ticks, off its lock.
"""

from __future__ import annotations

import logging

from elastic_ext.rendezvous.agent.events import EventKind, EventLog
from elastic_ext.rendezvous.protocol.clock import Clock
from elastic_ext.rendezvous.protocol.drain import with_left_out
from elastic_ext.rendezvous.protocol.pace import Pace
from elastic_ext.rendezvous.protocol.policy import Limits
from elastic_ext.rendezvous.protocol.state import Phase
from elastic_ext.rendezvous.protocol.straggler import StragglerJudge, StragglerRules
from elastic_ext.rendezvous.protocol.watcher import Sighting
from elastic_ext.rendezvous.stores.contract import StateDocument
from elastic_ext.rendezvous.stores.wire import pace_of

logger = logging.getLogger(__name__)


class StragglerWatch:
    """Judges the round's paces while this node watches everyone; used by the keeper's
    tick thread only."""

    def __init__(self, backend: StateDocument, node: str, rules: StragglerRules,
                 limits: Limits, events: EventLog, clock: Clock) -> None:
        self._backend = backend
        self._node = node
        self._limits = limits
        self._events = events
        self._clock = clock
        self._judge = StragglerJudge(rules, limits.min_nodes)
        self._round: tuple[str, int] | None = None
        self._to_drop: dict[str, str] = {}  # named and to be left out: node -> why

    def observe(self, seen: Sighting, own: Pace | None, token: object | None) -> None:
        """One tick: judge the closed round's paces (``own``: this node's, which its own
        heartbeat read does not give back), name the slow, leave out those to drop.
        ``token``: the whole state's, for the compare-and-swap."""
        state = seen.state
        if not seen.judging or state is None or state.phase is not Phase.CLOSED:
            self._round = None
            return
        round_ = (state.generation, state.round)
        if round_ != self._round:  # a new round: new workers, new paces, judged afresh
            self._round, self._to_drop = round_, {}
            self._judge = StragglerJudge(self._judge.rules, self._limits.min_nodes)
        paces = {n: own if n == self._node else pace_of(seen.beats.get(n))
                 for n in state.order if n not in state.leaving}
        for slow in self._judge.observe(paces, self._clock.monotonic()):
            logger.warning("etcd-ext: %s", slow.message)
            self._events.emit(EventKind.SLOW, slow.message, peer=slow.node, own_s=slow.own_s,
                              others_s=slow.others_s, step_s=slow.step_s, gain=slow.gain,
                              dropped=slow.drop)
            if slow.drop:
                self._to_drop[slow.node] = (f"a straggler ({slow.own_s / slow.others_s:.1f}x "
                                            f"the others' own step time)")
        for node, why in list(self._to_drop.items()):
            decided = with_left_out(state, node, why, self._limits)
            if decided is None:  # the job stops, the node left, or MIN forbids it now
                logger.warning("etcd-ext: %s is not left out after all: the job stops, it "
                               "leaves already, or the others would be fewer than MIN", node)
                self._to_drop.pop(node)
                continue
            try:
                result = self._backend.set_state(decided.to_bytes(), token)
            except Exception as exc:  # the next tick tries again
                logger.debug("etcd-ext: could not leave out %s: %s", node, exc)
                return
            if result is not None and result[2]:
                logger.info("etcd-ext: %s", decided.note)
                self._to_drop.pop(node)
            return  # one write per tick: the next reads the state it made
