"""The ``etcd-ext`` rendezvous handler torch's elastic agent drives: torch's adapter.

It holds what lives as long as the agent (the keeper thread, the events, the store) and
delegates: each ``next_rendezvous`` call runs a ``join_session.JoinSession`` over the
pure ``policy.decide``; closing, finishing and leaving the run are ``lifecycle.py``. The
keeper thread (``keeper.py``) tells torch's agent, through ``num_nodes_waiting``, when to
leave its round. The store is reached only through the ``StoreBackend`` contract, and time
only through the injected ``Clock``, so the whole handler runs in-process against an
in-memory backend in the fast tests.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import uuid
from pathlib import Path
from typing import Protocol

from torch.distributed.elastic.rendezvous.api import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousStoreInfo,
)

from elastic_ext.agent.control import AgentControl
from elastic_ext.net import workers_address
from elastic_ext.rendezvous.agent.events import EventKind, EventLog
from elastic_ext.rendezvous.agent.keeper import Keeper
from elastic_ext.rendezvous.agent.lifecycle import Lifecycle, read_state
from elastic_ext.rendezvous.agent.probes import Probes
from elastic_ext.rendezvous.agent.prometheus import AgentMetrics
from elastic_ext.rendezvous.agent.ring_check import take_seat
from elastic_ext.rendezvous.agent.session_context import (
    Memory,
    RunAccess,
    SessionParts,
    wait_out_outage,
)
from elastic_ext.rendezvous.errors import StoreUnavailableError
from elastic_ext.rendezvous.protocol.clock import SYSTEM_CLOCK, Clock
from elastic_ext.rendezvous.protocol.state import Phase, Status
from elastic_ext.rendezvous.settings import Settings
from elastic_ext.rendezvous.stores.contract import StoreBackend
from elastic_ext.torch_compat import agent_gave_up, workers_succeeded

logger = logging.getLogger(__name__)


def make_node_id() -> str:
    """A name unique to this agent in the run: its host, its pid and a random suffix."""
    host = "".join(c if c.isalnum() or c in "-_." else "-" for c in socket.gethostname())[:40]
    return f"{host}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


STARTER_READY_TIMEOUT_S = 60.0
"""The longest a node joining a running job waits for its warm-start server."""


class WorkerStarter(Protocol):
    """What the agent owns to start its workers (the warm-start server)."""

    def wait_ready(self, timeout: float) -> bool:
        """Block until workers can start fast, at most ``timeout`` seconds; False if not."""

    def close(self) -> None:
        """Stop it; the agent is leaving."""


class EtcdExtRendezvousHandler(RendezvousHandler):
    """torch's ``RendezvousHandler`` over a :class:`StoreBackend`.

    ``node_id``, ``control``, ``clock`` and ``keeper_thread=False`` are for tests: a
    fixed name, a control directory of their own, simulated time, and a keeper they
    tick themselves. ``starter`` is what starts the workers fast (the warm-start
    server): a node joining a running job waits for it before it makes the job restart,
    and it is closed when the handler shuts down.
    """

    def __init__(self, settings: Settings, backend: StoreBackend, *, backend_name: str,
                 events_file: Path | None = None, node_id: str | None = None,
                 control: AgentControl | None = None, clock: Clock = SYSTEM_CLOCK,
                 keeper_thread: bool = True, metrics: AgentMetrics | None = None,
                 starter: WorkerStarter | None = None) -> None:
        self._settings = settings
        self._backend = backend
        self._backend_name = backend_name
        self._node = node_id or make_node_id()
        addr = workers_address(settings.local_addr)  # --local-addr, ELASTIC_EXT_IFNAME, ...
        self._clock = clock
        self._control = control or AgentControl()
        self._metrics = metrics
        self._starter = starter
        self._events = EventLog(settings.run_id, self._node, addr, events_file,
                                listeners=[metrics.on_event] if metrics else [])
        self.keeper = Keeper.for_settings(backend.clone(), self._node, settings,
                                          control=self._control, events=self._events,
                                          clock=clock)
        if metrics is not None:
            metrics.watch_peers(self.keeper.peer_silence)
        self._keeper_thread = keeper_thread
        self._keeper_started = False
        self._lifecycle = Lifecycle(self._node, settings, backend, self.keeper, self._events,
                                    addr=addr)
        self._access = RunAccess(node=self._node, settings=settings, backend=backend, clock=clock)
        self._parts = SessionParts(
            addr=addr, keeper=self.keeper, events=self._events, control=self._control,
            probes=Probes(self._node, backend, self.keeper, self._events),
            lifecycle=self._lifecycle, reach_timeout=settings.reach_timeout)
        self._memory = Memory()  # what one next_rendezvous call leaves to the next
        self._events.emit(EventKind.STARTED,
                          f"node {self._node} on the {backend.name} store"
                          + (", which it hosts" if backend.hosts_store else ""),
                          store=backend.name, hosts_store=backend.hosts_store,
                          metrics_port=metrics.port if metrics else None)

    def get_backend(self) -> str:
        """The name torchrun was given as ``--rdzv-backend`` (``etcd-ext``), which its
        agent reports back."""
        return self._backend_name

    @property
    def use_agent_store(self) -> bool:
        """False: workers build their own store at the round's rank-0 node on a fresh
        port, so a dead rank-0 node or a joining node never leaves them pointing at a
        stale store."""
        return False

    def get_run_id(self) -> str:
        """The job's ``--rdzv-id``: every node of one job names the same."""
        return self._settings.run_id

    @property
    def node_id(self) -> str:
        """This agent's name in the run's state (host, pid and a random suffix)."""
        return self._node

    def next_rendezvous(self) -> RendezvousInfo:
        """This node's rank, the world size and where the workers' store is, once it is in
        a closed round (``join_session.py``).

        Raises:
            RendezvousTimeoutError: no round admitted this node within ``join_timeout``.
            RendezvousClosedError: this node's part is over, so torch's agent stops: the run
                was closed, or a subclass says why (budget spent, job finished, node left
                out; see ``JoinSession.run``).
            StoreUnavailableError: the store is unreachable at the first call, or was lost
                for good during one.
        """
        self._start_keeper()
        if self._memory.completed is None:
            self._wait_for_starter_before_joining_a_running_job()
        seat = take_seat(self._access, self._parts, self._memory)  # its ring reached first
        return RendezvousInfo(
            store=self._backend.round_store(seat.generation, seat.round),
            rank=seat.rank, world_size=seat.world_size,
            bootstrap_store_info=RendezvousStoreInfo(seat.master_addr, seat.master_port))

    def is_closed(self) -> bool:
        """Whether the run was closed for good (``set_closed``): torch's agent then does
        not start a rendezvous.

        Raises:
            StoreUnavailableError: the store could not be reached.
        """
        return self._lifecycle.is_closed()

    def set_closed(self) -> None:
        """Close the run for good: every agent's next rendezvous raises
        ``RendezvousClosedError``.

        Raises:
            StoreUnavailableError: the store stayed unreachable for ``close_timeout``.
        """
        self._lifecycle.close()

    def num_nodes_waiting(self) -> int:
        """How many reasons the keeper has for this node to leave its round (a dead peer,
        a node waiting to join, a newer round, a worker's fault report): torch's agent
        restarts the workers, without spending a local restart, when it is positive."""
        self.keeper.check_worker_report()
        count = self.keeper.pressure.count
        if count:  # torch stops the workers next, for free: a hung round's culprits too
            self.keeper.stop_hung_workers()
        return count

    def shutdown(self) -> bool:
        """Leave the run (``lifecycle.py``): True if the others were told, False if the
        store could not be (never raises). If our workers failed for good, the whole job's
        budget is spent; if they completed the training, the run is finished."""
        gave_up = agent_gave_up()
        try:
            return self._lifecycle.leave(self._memory.completed, gave_up=gave_up,
                                         succeeded=self._training_completed)
        finally:
            self._control.close()
            self._events.close()
            self._backend.close()
            if self._metrics is not None:
                self._metrics.close()
            if self._starter is not None:
                self._starter.close()

    def leave_after_signal(self, signum: int) -> str | None:
        """A signal stopped torch's agent, which stopped the workers and skips ``shutdown``:
        leave the run (``Lifecycle.leave_on_signal``); the line to exit 0 with when the
        others train on without this node, else None."""
        return self._lifecycle.leave_on_signal(self._memory.completed,
                                               signal.Signals(signum).name)

    def _training_completed(self) -> bool:
        """Whether this node's workers completed the training: they exited 0 without a
        preemption notice to this node, and, if they speak the protocol (they reported
        steps), said so (``control.report_done``). A script that speaks none is judged by
        its exit status, as torch judges it."""
        if not workers_succeeded() or self._control.notice() is not None:
            return False
        completed = self._memory.completed
        spoke = self.keeper.workers_report_steps or (
            completed is not None and self._control.progress_reported(completed[1]))
        return self._control.done_reported() or not spoke

    def _start_keeper(self) -> None:
        """Heartbeat once and start the keeper, on the first rendezvous only. The store
        answered when the handler was made (``connect``); one slow now (a busy etcd as a
        large job starts) is waited for until ``join_timeout``, as inside a rendezvous.

        Raises:
            StoreUnavailableError: the embedded store is gone, or etcd stayed unreachable
                for ``join_timeout``.
        """
        if self._keeper_started:
            return
        deadline = self._clock.monotonic() + self._settings.timeouts.join
        while True:
            try:
                self._backend.beat(self._node, self.keeper.presence_port)
                break
            except StoreUnavailableError as exc:
                wait_out_outage(self._backend, self._clock, exc, deadline)
        self.keeper.tick()
        if self._keeper_thread:
            self.keeper.start()
        self._keeper_started = True

    def _wait_for_starter_before_joining_a_running_job(self) -> None:
        """A newcomer to a job that trains makes every node restart its workers the moment
        it asks to join; it asks once its own workers can start fast, so the others train
        on meanwhile instead of waiting for its imports. (At a job's start everyone waits
        for everyone anyway, so nobody waits for this.)"""
        if self._starter is None:
            return
        try:
            state, _ = read_state(self._backend)
        except StoreUnavailableError:
            return
        if state is None or state.phase is not Phase.CLOSED or state.status is not Status.ACTIVE \
                or self._node in state.members:
            return
        began = self._clock.monotonic()
        ready = self._starter.wait_ready(STARTER_READY_TIMEOUT_S)
        logger.info("etcd-ext: joining the running job %s after %.1fs for its workers' warm start"
                    "%s", self._settings.run_id, self._clock.monotonic() - began,
                    "" if ready else " (not ready; joining anyway)")
