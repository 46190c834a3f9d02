"""The agent's background thread: heartbeat, watch the others, tell torch when to restart.

torch's agent polls ``num_nodes_waiting()`` every monitor interval while its workers are
healthy and restarts them, without spending a local restart, when it is positive. The
keeper makes that number cover every reason to leave the current round: a dead or frozen
participant, a node waiting to join, a newer round, or a worker's report that a peer
failed. It never blocks the agent: the agent reads the keeper's last verdict.

One keeper judges everyone (the watcher: ``joins.closer_of``) and publishes its
``liveness.Verdict``; the others read it when the watcher's heartbeat moves, and judge
only the watcher (``heartbeat_mode=lease``: ``stores/etcd/backend.py``). On any store the
keeper holds a connection to each watched node's presence port, and its sleep between
ticks ends when one ends: a killed agent is found when it dies (``presence``, ``wakeup``).

It also settles this node's preemption notice with the others' (``drain.py``), passes a
whole-job stop on to the workers, beats its workers' pace and, as the watcher, judges the
others' (``stragglers.py``) while beating on a thread of its own (``beater.py``).

Decisions apart from I/O, as in torch's ``dynamic_rendezvous.py``: the keeper reads the
store, asks the pure deciders (``watcher.py`` judges, ``pressure.py`` weighs the round,
``presence_book.py`` says where the others listen) and carries out their answers.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping
from dataclasses import replace

from elastic_ext.agent.control import AgentControl
from elastic_ext.rendezvous.agent.beater import Beater
from elastic_ext.rendezvous.agent.events import EventKind, EventLog
from elastic_ext.rendezvous.agent.hung_workers import stop_hung_workers
from elastic_ext.rendezvous.agent.notices import NoticeRelay
from elastic_ext.rendezvous.agent.presence import (
    AnswerProbe,
    PresenceListener,
    PresenceProbe,
    PresenceWatch,
    unreachable_among,
)
from elastic_ext.rendezvous.agent.presence_book import PresenceBook
from elastic_ext.rendezvous.agent.run_view import RunView
from elastic_ext.rendezvous.agent.stragglers import StragglerWatch
from elastic_ext.rendezvous.agent.wakeup import Wakeup
from elastic_ext.rendezvous.errors import CorruptStateError
from elastic_ext.rendezvous.protocol.clock import SYSTEM_CLOCK, Clock
from elastic_ext.rendezvous.protocol.hang import HangRules
from elastic_ext.rendezvous.protocol.joins import Succession
from elastic_ext.rendezvous.protocol.liveness import Liveness, Verdict
from elastic_ext.rendezvous.protocol.pace import Pace, node_pace
from elastic_ext.rendezvous.protocol.policy import Limits
from elastic_ext.rendezvous.protocol.pressure import Action, Pressure, RoundPressure, TellLost
from elastic_ext.rendezvous.protocol.state import RunState
from elastic_ext.rendezvous.protocol.straggler import StragglerRules
from elastic_ext.rendezvous.protocol.watcher import Doubt, Judgement, Sighting, Watcher
from elastic_ext.rendezvous.settings import Settings
from elastic_ext.rendezvous.stores.contract import StoreBackend

logger = logging.getLogger(__name__)


LATE_TICK_LOG_S = 60.0
"""At most one warning this often that a tick outlasted the interval (its beat was late)."""


class Keeper:
    """Runs ``tick`` every ``interval`` in its own thread once started; ``tick`` alone in tests."""

    def __init__(self, backend: StoreBackend, node: str, *, interval: float, timeout: float,
                 limits: Limits, control: AgentControl, events: EventLog,
                 clock: Clock = SYSTEM_CLOCK, hang_rules: HangRules | None = None,
                 straggler: StragglerRules | None = None) -> None:
        self._backend = backend
        self._node = node
        self._interval = interval
        self._control = control
        self._events = events
        self._clock = clock
        self._lock = threading.Lock()  # guards the deciders and the book below
        self._stop = threading.Event()
        self._wake = Wakeup()  # tick now: a state change, a notice, a death, or stop
        self._thread: threading.Thread | None = None
        self._watcher = Watcher(node, Liveness(timeout, clock.monotonic,
                                               expiring=backend.heartbeats_expire))
        self._rounds = RoundPressure(node, limits, clock, hang_rules)
        self._book = PresenceBook(node)
        self._also_watched: set[str] = set()
        self._peers: frozenset[str] = frozenset()  # the last state's members and waiting
        self._failing_since: float | None = None
        self._view = RunView(backend, node)  # the state's head, the whole state if judging
        self._presence = PresenceListener()
        self._probe = PresenceProbe()
        self._answers = AnswerProbe(on_silent=self._wake.set)  # a judge in doubt's
        self._held = PresenceWatch()  # used by the tick's thread only
        self._notices = NoticeRelay(backend, node, limits=limits, control=control,
                                    events=events, clock=clock, wake=self._wake.set)
        self._stragglers = StragglerWatch(backend, node, straggler or StragglerRules(),
                                          limits, events, clock)
        self.pace: Pace | None = None  # this node's workers' pace as the last tick read it
        self._beater = Beater(backend.clone, node, interval=interval, timeout=timeout, clock=clock,
                              presence_port=self._presence.port, pace=lambda: self.pace)
        self._doubting: Doubt | None = None  # the doubt of a spell in progress
        self._succession = Succession(clock.monotonic, timeout)  # who replaces a dead closer

    @classmethod
    def for_settings(cls, backend: StoreBackend, node: str, settings: Settings, *,
                     control: AgentControl, events: EventLog, clock: Clock = SYSTEM_CLOCK
                     ) -> Keeper:
        """The keeper of a node of the job ``settings`` describe: its heartbeat interval
        and timeout, and the job's ``Limits``."""
        return cls(backend, node, interval=settings.timeouts.heartbeat_interval,
                   timeout=settings.timeouts.heartbeat, limits=Limits.of(settings),
                   control=control, events=events, clock=clock, hang_rules=settings.hang,
                   straggler=settings.straggler)

    # -- what the handler reads ---------------------------------------------------------
    @property
    def pressure(self) -> Pressure:
        with self._lock:
            return self._rounds.pressure

    def dead_among(self, nodes: set[str]) -> frozenset[str]:
        """Of ``nodes``, those judged dead or gone at the last tick (by us, or by the node
        that watches everyone: ``liveness.Verdict``)."""
        with self._lock:
            return self._watcher.dead & (nodes - {self._node})

    def place(self, round_: tuple[str, int], position: int) -> None:
        """This node joined the open round ``round_`` at ``position`` (``HeadPath.join``)."""
        with self._lock:
            self._succession.place = (round_, position)

    def replaces(self, closer: str) -> bool:
        """Whether this node acts for ``closer`` of the open round now (``Succession``)."""
        with self._lock:
            return self._succession.replaces(closer, self._view.head)

    def watch_also(self, nodes: Iterable[str]) -> None:
        """Nodes to judge beyond the state's (an open round's joiners, which only the
        closer reads): they count when this agent is the one watching everyone."""
        with self._lock:
            self._also_watched = set(nodes) - {self._node}

    def ports_unknown(self, nodes: Iterable[str]) -> list[str]:
        """Of ``nodes``, those whose presence port this keeper has not read."""
        with self._lock:
            return self._book.unknown(nodes)

    def learn_ports(self, ports: Mapping[str, int], addrs: Mapping[str, str] | None = None
                    ) -> None:
        """Presence ports (and addresses) the caller read (the state names them; this
        keeper reads only the watcher's heartbeat unless it watches everyone)."""
        with self._lock:
            self._book.learn(ports, addrs)

    @property
    def presence_port(self) -> int:
        return self._presence.port

    def gone_among(self, nodes: Iterable[str], addrs: Mapping[str, str]) -> frozenset[str]:
        """Nodes whose agent is gone for sure: their presence port refuses connections.
        Called by the rendezvous for the nodes a round would otherwise wait for."""
        with self._lock:
            targets = self._book.targets(nodes, addrs)
        return self._probe.gone_among(targets)

    def peer_silence(self) -> dict[str, float]:
        """Seconds since each peer's heartbeat last moved, as this agent sees it, for the
        nodes of the current round and those waiting (for metrics)."""
        with self._lock:
            silence = self._watcher.liveness.silence()
            peers = self._peers
        return {node: age for node, age in silence.items() if node in peers}

    def unreachable_among(self, nodes: Iterable[str], addrs: Mapping[str, str]) -> frozenset[str]:
        """Of ``nodes``, those whose machine does not answer at all (``presence.answers``)."""
        with self._lock:
            targets = self._book.targets(nodes, addrs, others_only=True)
        return unreachable_among(targets)

    @property
    def workers_report_steps(self) -> bool:
        """Whether this agent's workers ever reported a training step: they speak the
        protocol (``control.report_progress``), so they also say when training is done."""
        with self._lock:
            return self._rounds.steps_reported

    def round_progressed(self) -> bool:
        """Whether the watched round's workers completed a training step."""
        with self._lock:
            return self._rounds.progressed

    def watch_round(self, round_: tuple[str, int] | None) -> None:
        with self._lock:
            self._view.member_of = round_ or self._view.member_of
            self._rounds.watch(round_)

    def stop_hung_workers(self) -> None:
        """Once torch's agent has read the pressure of a hung round (it stops the workers
        next, for free: ``handler.num_nodes_waiting``), kill this node's culprits, which
        would not leave on its SIGTERM (a stopped process keeps it pending; torch would
        wait 30 s); and when they cannot be killed, or were to blame twice in a row, take
        the node out of the job as a preemption notice would (``drain.py``)."""
        with self._lock:
            hung, self._rounds.hung = self._rounds.hung, None
            leave = self._rounds.hang.leave_the_job
        if hung is None:
            return
        stop_hung_workers(hung, leave_the_job=leave, events=self._events, control=self._control)

    def check_worker_report(self) -> None:
        """Act on a worker's peer-fault report now rather than at the next tick: the agent
        polls ``num_nodes_waiting`` every tenth of a second, the keeper ticks every second."""
        with self._lock:
            self._apply(self._rounds.worker_report(self._control))

    # -- the thread ---------------------------------------------------------------------
    def start(self) -> None:
        self._backend.on_state_change(self._wake.set)  # act on a change at once, not next tick
        self._beater.allow()
        self._thread = threading.Thread(target=self._run, name="etcd-ext-keeper", daemon=True)
        self._thread.start()
        self._notices.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._beater.stop()
        if self._thread is not None:
            self._thread.join(timeout=5 * self._interval + 5)
            if self._thread.is_alive():  # leaving revokes its heartbeat (etcd's backend.leave)
                logger.warning("etcd-ext: keeper still in a store call; leaving without it")
        self._notices.close()
        self._answers.close()
        if self._thread is None or not self._thread.is_alive():
            self._held.close()
            self._wake.close()
        self._presence.close()

    def _run(self) -> None:
        """A tick every ``interval``, and one whenever woken in between (not beating)."""
        due_at = self._clock.monotonic()
        told_late_at = -LATE_TICK_LOG_S
        while not self._stop.is_set():
            due = self._clock.monotonic() >= due_at
            if due:
                due_at = self._clock.monotonic() + self._interval
            began = self._clock.monotonic()
            self.tick(due)
            took = self._clock.monotonic() - began
            if took > self._interval and began - told_late_at >= LATE_TICK_LOG_S:
                told_late_at = began
                logger.warning("etcd-ext: a keeper tick took %.1fs (its interval: %.1fs; "
                               "%d node(s) judged): this node's heartbeat is that late",
                               took, self._interval, len(self._watcher.liveness.silence()))
            self._held.wait(max(0.0, due_at - self._clock.monotonic()), self._wake)
            self._wake.clear()

    def tick(self, due: bool = True) -> None:
        """Read the store, let the deciders judge and weigh it, then write what they
        decided: the verdict, the notice, the round's progress."""
        with self._lock:
            watched, also = self._rounds.round, self._also_watched
        self.pace = node_pace(self._control.beacons()) if watched is not None else None
        try:
            seen, token, fresh = self._read(also, due)
        except CorruptStateError as exc:
            logger.error("etcd-ext: %s", exc)
            return
        except Exception as exc:  # the store is down or slow: we see nothing, judge nothing
            self._store_lost(exc)
            return
        self._store_back()
        with self._lock:
            judgement = self._judge(seen, fresh)
            record_progress = self._weigh(seen, judgement.dead, watched)
        if judgement.publish is not None:
            self._publish(judgement.publish)
        view = self._view
        self._notices.act(seen.head, token, judgement.dead, lambda: view.read_state(None))
        self._stragglers.observe(seen, self.pace, view.state_token)
        if record_progress and seen.state is not None:
            self._record_progress(seen.state, view.state_token)
        if watched is not None:
            self.check_worker_report()

    def _read(self, also: set[str], due: bool) -> tuple[Sighting, object | None, bool]:
        """One read of the store (``keeper_read``): what the deciders judge, the head's
        token, and whether the head changed since the last read."""
        self._presence.drain()
        view = self._view
        watcher = view.head.closer if view.head else None
        with self._lock:
            replacing = self._succession.replaces(watcher, view.head)
        judging = view.judges(self._watcher.dead, replacing)
        self._beater.ticked(wanted=judging)  # the watcher's beat must not wait on its work
        nodes = self._watcher.nodes(view.state(read=False) if judging else None, also)
        observed = sorted(nodes) if judging else [watcher] if watcher else []
        read = self._backend.keeper_read(self._node, self._presence.port, observed, due,
                                         self.pace)
        fresh = view.refresh(read.state_version)
        token = view.token
        # The whole state only for a node that judges everyone (it names them), now or
        # from this tick on: the others follow the head, a few bytes (``head.py``).
        state = view.state(read=judging or view.judges(self._watcher.dead, replacing))
        seen = Sighting(view.head, watcher, judging, nodes, read.beats,
                        Verdict.from_bytes(read.verdict), state)
        return seen, token, fresh

    def _store_lost(self, exc: Exception) -> None:
        """A read failed: judge nobody on what we saw before (``Liveness.blind``), and let
        a worker's fault report take the workers into the rendezvous anyway."""
        with self._lock:
            self._watcher.liveness.blind()
            self._rounds.blind(self._control)
        if self._failing_since is None:
            self._failing_since = self._clock.monotonic()
            logger.warning("etcd-ext: store unreachable, heartbeats paused: %s", exc)
        self._notices.without_store()

    def _store_back(self) -> None:
        if self._failing_since is not None:
            logger.warning("etcd-ext: store reachable again after %.1fs",
                           self._clock.monotonic() - self._failing_since)
            self._failing_since = None

    def _judge(self, seen: Sighting, fresh: bool) -> Judgement:
        """Learn where the others listen, ask the watcher decider, report new deaths
        (under ``_lock``)."""
        self._book.learn_beats(seen.beats)
        if fresh:  # whom we report ages of, and where they listen
            peers, infos = self._view.peers()
            self._peers = frozenset(peers) - {self._node}
            self._book.learn_infos(infos)
        judgement = self._watcher.judge(
            seen, lambda nodes: self._held.gone_among(self._book.targets(nodes)),
            lambda nodes: self._answers.answering(self._book.targets(nodes)))
        self._tell_doubt(judgement.doubt)
        self._succession.judged(judgement.dead)
        for death in judgement.to_report:
            self._events.emit(EventKind.NODE_LEFT if death.left else EventKind.NODE_DEAD,
                              death.message, peer=death.node)
        return judgement

    def _tell_doubt(self, doubt: Doubt | None) -> None:
        """Log once when a spell of doubt begins (``watcher.Doubt``) and once when it ends."""
        if (doubt is None) == (self._doubting is None):
            return
        if doubt is not None:
            logger.warning("etcd-ext: %s", doubt.message)
        else:
            logger.warning("etcd-ext: judging again: the nodes spared beat or were judged")
        self._doubting = doubt

    def _weigh(self, seen: Sighting, dead: frozenset[str], watched: tuple[str, int] | None
               ) -> bool:
        """Ask the pressure decider about the round and act on it (under ``_lock``); True
        when the run's state should learn from us that the round trained."""
        actions, record_progress = self._rounds.after_read(
            watched, seen.head, dead,
            lambda round_: self._view.lost_of(round_, dead, seen.verdict), self._control)
        self._apply(actions)
        return record_progress

    def _apply(self, actions: list[Action]) -> None:
        """Tell the workers and the events what the pressure decider decided (under
        ``_lock``)."""
        for action in actions:
            if isinstance(action, TellLost):
                try:
                    self._control.publish_peer_lost(action.round, action.why)
                except Exception:
                    self._rounds.lost_not_told()  # the next tick tries again
                    raise
                continue
            pressure = action.pressure
            logger.info("etcd-ext: leaving round %d: %s", action.round, pressure.why)
            self._control.publish_leaving(action.round, pressure.reason.value)
            self._events.emit(EventKind.LEAVING_ROUND, f"leaving round {action.round}: "
                              f"{pressure.why}", round=action.round, why=pressure.why,
                              reason=pressure.reason.value)

    def _publish(self, verdict: Verdict) -> None:
        """Write our verdict for the others (only when it changed: one write per change)."""
        try:
            self._backend.write_verdict(verdict.to_bytes())
            with self._lock:
                self._watcher.published(verdict)
        except Exception as exc:  # the next tick tries again
            logger.debug("etcd-ext: could not publish the verdict: %s", exc)

    def _record_progress(self, state: RunState, token: object | None) -> None:
        """Tell the run that its round trained (one write per round, whoever is first), so
        that restarts after it are not counted as rounds without progress."""
        try:
            self._backend.set_state(replace(state, progress_round=state.round).to_bytes(), token)
        except Exception as exc:  # the next tick tries again
            logger.debug("etcd-ext: could not record the round's progress: %s", exc)
