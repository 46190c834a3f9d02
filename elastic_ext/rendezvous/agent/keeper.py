"""The agent's background thread: heartbeat, watch the others, tell torch when to restart.

torch's agent polls ``num_nodes_waiting()`` every monitor interval while its workers are
healthy and restarts them, without spending a local restart, when it is positive. The
keeper makes that number cover every reason to leave the current round: a dead or frozen
participant, a node waiting to join, a newer round, or a worker's report that a peer
failed. It never blocks the agent: the agent reads the keeper's last verdict.

One keeper judges everyone (the watcher: ``joins.closer_of``) and publishes its
``liveness.Verdict``; the others read it when the watcher's heartbeat moves, and judge
only the watcher (with ``heartbeat_mode=lease`` on etcd, a heartbeat is a lease keep-alive and
the keys arrive by a watch: ``etcd_backend``). On any store the keeper holds a connection
to each watched node's presence port and reads a killed agent's end from it (``presence``).

It also carries this node's preemption notice to the run's state and settles it with
the other nodes' (``drain.py``), and passes a whole-job stop on to the workers.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from elastic_ext.agent.control import AgentControl
from elastic_ext.rendezvous.agent.events import EventKind, EventLog
from elastic_ext.rendezvous.agent.notices import NoticeRelay
from elastic_ext.rendezvous.agent.presence import (
    PresenceListener,
    PresenceProbe,
    PresenceWatch,
    unreachable_among,
)
from elastic_ext.rendezvous.agent.run_view import RunView, watcher_verdict
from elastic_ext.rendezvous.errors import CorruptStateError
from elastic_ext.rendezvous.protocol.clock import SYSTEM_CLOCK, Clock
from elastic_ext.rendezvous.protocol.head import Head
from elastic_ext.rendezvous.protocol.joins import closer_of
from elastic_ext.rendezvous.protocol.liveness import LEFT, Liveness, Verdict
from elastic_ext.rendezvous.protocol.policy import Limits, head_pressure
from elastic_ext.rendezvous.protocol.state import Phase, Reason, RunState, Status
from elastic_ext.rendezvous.stores.contract import StoreBackend
from elastic_ext.rendezvous.stores.wire import presence_port_of

logger = logging.getLogger(__name__)

PROGRESS_WITHOUT_REPORTS_S = 120.0
"""Workers that never report steps (``control.report_progress``; the bundled trainer and
``PreemptionGuard`` do) count as progressing once their round has run this long."""


@dataclass(frozen=True)
class Pressure:
    """The keeper's verdict: how many reasons to leave the round, the first, and its kind."""

    count: int = 0
    why: str = ""
    reason: Reason = Reason.FAILURE


class Keeper:
    """Runs ``tick`` every ``interval`` in its own thread once started; ``tick`` alone in tests."""

    def __init__(self, backend: StoreBackend, node: str, *, interval: float, timeout: float,
                 limits: Limits, control: AgentControl, events: EventLog,
                 clock: Clock = SYSTEM_CLOCK) -> None:
        self._backend = backend
        self._node = node
        self._interval = interval
        self._limits = limits
        self._control = control
        self._events = events
        self._clock = clock
        self._liveness = Liveness(timeout, clock.monotonic, expiring=backend.heartbeats_expire)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()  # tick now: a state change, a notice to relay, or stop
        self._thread: threading.Thread | None = None
        self._round: tuple[str, int] | None = None
        self._pressure = Pressure()
        self._reported_dead: set[str] = set()  # once per death, not at every round
        self._failing_since: float | None = None
        self._peers: frozenset[str] = frozenset()  # the last state's members and waiting
        self._view = RunView(backend, node)  # the state's head, the whole state if judging
        self._nodes: tuple[object, frozenset[str]] = (None, frozenset())  # whom it names
        self._dead: frozenset[str] = frozenset()  # the last tick's judgement
        self._also_watched: set[str] = set()
        self._inherited: set[str] = set()  # dead by the last verdict we trusted
        self._inherited_left: set[str] = set()
        self._published: Verdict | None = None
        self._presence = PresenceListener()
        self._probe = PresenceProbe()
        self._held = PresenceWatch()  # used by the tick's thread only
        self._ports: dict[str, int] = {}  # presence ports from the heartbeats last read
        self._addrs: dict[str, str] = {}  # node addresses from the states read
        self._lost_told: tuple[str, int] | None = None  # the round whose workers know
        self._round_since = clock.monotonic()  # when the watched round was handed over
        self._progressed = False  # the watched round's workers completed a step
        self._steps_reported = False  # this agent's workers ever reported one
        self._notices = NoticeRelay(backend, node, limits=limits, control=control,
                                    events=events, clock=clock, wake=self._wake.set)

    # -- what the handler reads ---------------------------------------------------------
    @property
    def pressure(self) -> Pressure:
        with self._lock:
            return self._pressure

    def dead_among(self, nodes: set[str]) -> frozenset[str]:
        """Of ``nodes``, those judged dead or gone at the last tick (by us, or by the node
        that watches everyone: ``liveness.Verdict``)."""
        with self._lock:
            return self._dead & (nodes - {self._node})

    def watch_also(self, nodes: Iterable[str]) -> None:
        """Nodes to judge beyond the state's (an open round's joiners, which only the
        closer reads): they count when this agent is the one watching everyone."""
        with self._lock:
            self._also_watched = set(nodes) - {self._node}

    def ports_unknown(self, nodes: Iterable[str]) -> list[str]:
        """Of ``nodes``, those whose presence port this keeper has not read."""
        with self._lock:
            return sorted(n for n in nodes if n not in self._ports and n != self._node)

    def learn_ports(self, ports: Mapping[str, int], addrs: Mapping[str, str] | None = None
                    ) -> None:
        """Presence ports (and addresses) the caller read (the state names them; this
        keeper reads only the watcher's heartbeat unless it watches everyone)."""
        with self._lock:
            self._ports.update({n: p for n, p in ports.items() if n != self._node})
            self._addrs.update(addrs or {})

    @property
    def presence_port(self) -> int:
        return self._presence.port

    def gone_among(self, nodes: Iterable[str], addrs: Mapping[str, str]) -> frozenset[str]:
        """Nodes whose agent is gone for sure: their presence port refuses connections.
        Called by the rendezvous for the nodes a round would otherwise wait for."""
        with self._lock:
            targets = {n: (addrs[n], self._ports[n]) for n in nodes
                       if n in self._ports and n in addrs}
        return self._probe.gone_among(targets)

    def peer_silence(self) -> dict[str, float]:
        """Seconds since each peer's heartbeat last moved, as this agent sees it, for the
        nodes of the current round and those waiting (for metrics)."""
        with self._lock:
            silence = self._liveness.silence()
            peers = self._peers
        return {node: age for node, age in silence.items() if node in peers}

    def unreachable_among(self, nodes: Iterable[str], addrs: Mapping[str, str]) -> frozenset[str]:
        """Of ``nodes``, those whose machine does not answer at all (``presence.answers``)."""
        with self._lock:
            targets = {n: (addrs[n], self._ports[n]) for n in nodes
                       if n in self._ports and n in addrs and n != self._node}
        return unreachable_among(targets)

    @property
    def workers_report_steps(self) -> bool:
        """Whether this agent's workers ever reported a training step: they speak the
        protocol (``control.report_progress``), so they also say when training is done."""
        with self._lock:
            return self._steps_reported

    def round_progressed(self) -> bool:
        """Whether the watched round's workers completed a training step."""
        with self._lock:
            return self._progressed

    def watch_round(self, round_: tuple[str, int] | None) -> None:
        with self._lock:
            self._round = round_
            self._view.member_of = round_ or self._view.member_of
            self._pressure = Pressure()
            self._round_since = self._clock.monotonic()
            self._progressed = False

    # -- the thread ---------------------------------------------------------------------
    def start(self) -> None:
        self._backend.on_state_change(self._wake.set)  # act on a change at once, not next tick
        self._thread = threading.Thread(target=self._run, name="etcd-ext-keeper", daemon=True)
        self._thread.start()
        self._notices.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5 * self._interval + 5)
            if self._thread.is_alive():  # leaving revokes its heartbeat (etcd_backend.leave)
                logger.warning("etcd-ext: keeper still in a store call; leaving without it")
        self._notices.close()
        if self._thread is None or not self._thread.is_alive():
            self._held.close()
        self._presence.close()

    def _run(self) -> None:
        """A tick every ``interval``, and one whenever woken in between, which neither
        moves the next nor beats (``StoreBackend.keeper_read``'s ``due``)."""
        due_at = self._clock.monotonic()
        while not self._stop.is_set():
            due = self._clock.monotonic() >= due_at
            if due:
                due_at = self._clock.monotonic() + self._interval
            self.tick(due)
            self._wake.wait(max(0.0, due_at - self._clock.monotonic()))
            self._wake.clear()

    def tick(self, due: bool = True) -> None:
        with self._lock:
            watched = self._round
            also = self._also_watched
        try:
            self._presence.drain()
            view = self._view
            watcher = view.head.closer if view.head else None
            judging = view.judges(self._dead)
            state = view.state(read=False) if judging else None
            if self._nodes[0] != (state, also):  # O(N) once per state, not at every tick
                known = state.known_nodes() if state else set()
                self._nodes = ((state, also), frozenset((known | also) - {self._node}))
            nodes = self._nodes[1]
            observed = sorted(nodes) if judging else [watcher] if watcher else []
            read = self._backend.keeper_read(self._node, self._presence.port, observed, due)
            fresh = view.refresh(read.state_version)
            head, token = view.head, view.token
            # The whole state only for a node that judges everyone (it names them), now or
            # from this tick on: the others follow the head, a few bytes (``head.py``).
            state = view.state(read=judging or view.judges(self._dead))
            beats = read.beats
        except CorruptStateError as exc:
            logger.error("etcd-ext: %s", exc)
            return
        except Exception as exc:  # the store is down or slow: we see nothing, judge nothing
            with self._lock:
                self._liveness.blind()
                # Workers stuck on a dead peer cannot wait for the store to come back: let
                # the agent take them into the rendezvous, which waits or fails clearly.
                if self._round is not None and not self._pressure.count and \
                        self._control.fault_reported(self._round[1]) is not None:
                    self._pressure = Pressure(1, "a worker reported a peer fault while the "
                                                 "store is unreachable", Reason.FAILURE)
            if self._failing_since is None:
                self._failing_since = self._clock.monotonic()
                logger.warning("etcd-ext: store unreachable, heartbeats paused: %s", exc)
            self._notices.without_store()
            return
        if self._failing_since is not None:
            logger.warning("etcd-ext: store reachable again after %.1fs",
                           self._clock.monotonic() - self._failing_since)
            self._failing_since = None
        with self._lock:
            self._liveness.forget(beats)  # judge only whom we watch now
            self._liveness.observe(beats)
            for node, value in beats.items():
                port = presence_port_of(value)
                if port is not None:
                    self._ports[node] = port
            if fresh:  # whom we report ages of, and where they listen
                peers, infos = view.peers()
                self._peers = frozenset(peers) - {self._node}
                for node, info in infos.items():
                    self._addrs[node] = info.addr
                    if info.presence is not None:
                        self._ports.setdefault(node, info.presence)
            verdict_read = Verdict.from_bytes(read.verdict)
            dead, left = self._judge(head, watcher, judging, nodes, beats, verdict_read)
            self._dead = dead
            for node in sorted(dead - self._reported_dead):
                if node in left:
                    self._events.emit(EventKind.NODE_LEFT, f"node {node} left", peer=node)
                else:
                    self._events.emit(EventKind.NODE_DEAD,
                                      f"node {node} declared dead (no heartbeat change"
                                      + ("" if judging else f", judged by {watcher}") + ")",
                                      peer=node)
            self._reported_dead = (self._reported_dead | dead) - (set(beats) - dead)
            # Only the watcher publishes, and only a judgement of everyone: a tick that
            # read the state that made us the watcher read one heartbeat, not all.
            verdict = watcher_verdict(self._node, state, dead, left) \
                if judging and state is not None and closer_of(state) == self._node else None
            if self._round is None or self._round != watched:
                record_progress = False  # not in a round, or it changed while we read
            elif head is None:
                # The last agent of a finished job removed the run's keys while this one
                # was away (frozen): nothing to train with any more.
                if not self._pressure.count:
                    self._leave_round(Pressure(1, "the run's state is gone: the job finished",
                                               Reason.MEMBERSHIP))
                record_progress = False
            else:
                record_progress = self._note_progress(head)
                self._weigh(head, dead, view.lost_of(self._round, dead, verdict_read))
        if verdict is not None and verdict != self._published:
            self._publish(verdict)
        self._notices.act(head, token, dead, lambda: view.read_state(None))
        if record_progress and state is not None:
            self._record_progress(state, view.state_token)
        if watched is not None:
            self.check_worker_report()

    def _judge(self, head: Head | None, watcher: str | None, judging: bool,
               nodes: frozenset[str], beats: Mapping[str, bytes | None], verdict: Verdict | None
               ) -> tuple[frozenset[str], frozenset[str]]:
        """(dead, left) among ``nodes`` (under ``_lock``): our own judgement when we watch
        everyone, else the watcher's published verdict and our judgement of the watcher.
        A node that becomes the watcher keeps the last verdict's dead until they beat."""
        # Connections to everyone only from the watcher itself: while a dead watcher makes
        # every keeper judge everyone, N keepers holding N connections each would be N².
        held = beats if watcher in (None, self._node) else [watcher]
        own = self._liveness.dead_among(beats) | self._held.gone_among(
            {n: (self._addrs[n], self._ports[n]) for n in held
             if n in self._ports and n in self._addrs})
        left = {n for n in own if beats.get(n) == LEFT}
        if judging:
            inherited = {n for n in self._inherited & nodes if not self._liveness.moved(n)}
            return frozenset(own | inherited), frozenset(left | (self._inherited_left & inherited))
        if head is not None and verdict is not None and verdict.by == watcher \
                and verdict.generation == head.generation:
            self._inherited, self._inherited_left = set(verdict.dead), set(verdict.left)
            return frozenset(own | verdict.dead), frozenset(left | verdict.left)
        return frozenset(own), frozenset(left)

    def _weigh(self, head: Head, dead: frozenset[str], lost: frozenset[str]) -> None:
        """Turn what we read into a reason to leave our round, if any (under ``_lock``)."""
        assert self._round is not None
        if lost and self._lost_told != self._round:
            # Also after another reason came first: the stop must not wait on them.
            self._control.publish_peer_lost(self._round[1],
                                            f"dead or hung: {', '.join(sorted(lost))}")
            self._lost_told = self._round
        if self._pressure.count:
            return  # sticky until the next round: the agent acts on the first reason
        count, why, reason = head_pressure(
            head, self._node, dead, lost, self._limits, self._round,
            self._control.fault_reported(self._round[1]) is not None)
        if count:
            self._leave_round(Pressure(count, why, reason))

    def _publish(self, verdict: Verdict) -> None:
        """Write our verdict for the others (only when it changed: one write per change)."""
        try:
            self._backend.write_verdict(verdict.to_bytes())
            self._published = verdict
        except Exception as exc:  # the next tick tries again
            logger.debug("etcd-ext: could not publish the verdict: %s", exc)

    def _note_progress(self, head: Head) -> bool:
        """Update what we know of the watched round's progress (under ``_lock``); True when
        the run's state should learn it from us (rank 0 of the round)."""
        assert self._round is not None
        if not self._progressed:
            if self._control.progress_reported(self._round[1]):
                self._progressed = self._steps_reported = True
            elif not self._steps_reported and \
                    self._clock.monotonic() - self._round_since >= PROGRESS_WITHOUT_REPORTS_S:
                self._progressed = True
        # Rank 0 writes it: its workers take part in every step, and one writer is one
        # write, where every agent trying would be N compare-and-swaps of the whole state.
        return (self._progressed and (head.generation, head.round) == self._round
                and head.phase is Phase.CLOSED and head.status is Status.ACTIVE
                and head.progress_round < head.round and head.closer == self._node)

    def _record_progress(self, state: RunState, token: object | None) -> None:
        """Tell the run that its round trained (one write per round, whoever is first), so
        that restarts after it are not counted as rounds without progress."""
        try:
            self._backend.set_state(replace(state, progress_round=state.round).to_bytes(), token)
        except Exception as exc:  # the next tick tries again
            logger.debug("etcd-ext: could not record the round's progress: %s", exc)

    def check_worker_report(self) -> None:
        """Act on a worker's peer-fault report now rather than at the next tick: the agent
        polls ``num_nodes_waiting`` every tenth of a second, the keeper ticks every second."""
        with self._lock:
            if self._round is None or self._pressure.count:
                return
            setup = self._control.setup_fault_reported(self._round[1])
            if setup is not None:  # the node's machinery, not the training: free
                self._leave_round(Pressure(1, f"a worker's launcher reported: {setup}",
                                           Reason.MEMBERSHIP))
            elif self._control.fault_reported(self._round[1]) is not None:
                self._leave_round(Pressure(1, "a worker reported a peer fault", Reason.FAILURE))

    def _leave_round(self, pressure: Pressure) -> None:
        """Record the first reason to restart this round's workers (under ``_lock``)."""
        assert self._round is not None
        logger.info("etcd-ext: leaving round %d: %s", self._round[1], pressure.why)
        self._pressure = pressure
        self._control.publish_leaving(self._round[1], pressure.reason.value)
        self._events.emit(EventKind.LEAVING_ROUND, f"leaving round {self._round[1]}: "
                          f"{pressure.why}", round=self._round[1], why=pressure.why,
                          reason=pressure.reason.value)


