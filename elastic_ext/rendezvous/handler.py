"""The ``etcd-ext`` rendezvous handler torch's elastic agent drives."""

from __future__ import annotations

import logging
import os
import socket
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import replace

from torch.distributed.elastic.events import NodeState, construct_and_record_rdzv_event
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)
from tenacity import Retrying, retry_if_exception_type, stop_after_delay, wait_fixed

from elastic_ext.control import AgentControl
from elastic_ext.plugin import BACKEND_NAME
from elastic_ext.rendezvous.backend import StoreBackend
from elastic_ext.rendezvous.errors import RestartBudgetExhaustedError, StoreUnavailableError
from elastic_ext.rendezvous.keeper import Keeper
from elastic_ext.rendezvous.liveness import LEFT
from elastic_ext.rendezvous.settings import Settings
from elastic_ext.rendezvous.state import (
    Decision,
    Limits,
    NodeInfo,
    Outcome,
    Phase,
    Reason,
    RunState,
    Status,
    View,
    decide,
)

logger = logging.getLogger(__name__)

_POLL = 0.05


def make_node_id() -> str:
    host = "".join(c if c.isalnum() or c in "-_." else "-" for c in socket.gethostname())[:40]
    return f"{host}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def free_port(addr: str) -> int:
    """A port the rank-0 worker can bind for the workers' store of this round."""
    with socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


class EtcdExtRendezvousHandler(RendezvousHandler):
    def __init__(self, settings: Settings, backend: StoreBackend,
                 keeper_backend_factory: Callable[[], StoreBackend] | None = None,
                 node_id: str | None = None) -> None:
        self._settings = settings
        self._backend = backend
        self._node = node_id or make_node_id()
        self._addr = settings.local_addr or socket.getfqdn()
        self._limits = Limits(settings.min_nodes, settings.max_nodes,
                              settings.timeouts.last_call, settings.max_restarts)
        self._control = AgentControl()
        self._keeper = Keeper((keeper_backend_factory or backend.clone)(), self._node,
                              settings.timeouts.heartbeat_interval, settings.timeouts.heartbeat,
                              self._limits, self._control, on_event=self._record)
        self._keeper_started = False
        self._completed: tuple[str, int] | None = None
        self._min_reached_at: dict[tuple[str, int], float] = {}
        self._last_written_note = ""

    # -- torch's contract ------------------------------------------------------------------
    def get_backend(self) -> str:
        return BACKEND_NAME

    @property
    def use_agent_store(self) -> bool:
        # Workers build their own store at the round's rank-0 node on a fresh port, so a
        # dead rank-0 node or a joining node never leaves them pointing at a stale store.
        return False

    def get_run_id(self) -> str:
        return self._settings.run_id

    @property
    def node_id(self) -> str:
        return self._node

    def next_rendezvous(self) -> RendezvousInfo:
        self._start_keeper()
        reenter = self._keeper.pressure.reason if self._completed else Reason.START
        if self._completed:
            why = self._keeper.pressure.why or "this node's workers failed"
            self._record(f"restart after round {self._completed[1]}: {why}")
        self._keeper.watch_round(None)
        my_info = NodeInfo(self._addr, free_port(self._addr))
        fresh_generation = uuid.uuid4().hex[:12]
        deadline = time.monotonic() + self._settings.timeouts.join
        last_note = ""
        while True:
            try:
                state, token = self._read()
            except StoreUnavailableError as exc:
                if not self._backend.outages_are_transient or time.monotonic() > deadline:
                    raise
                logger.warning("etcd-ext: store unreachable, still trying until the join "
                               "timeout: %s", exc)
                continue
            view = View(me=self._node, my_info=my_info,
                        dead=self._keeper.dead_among(state.known_nodes()) if state else frozenset(),
                        completed=self._completed, min_reached_for=self._min_reached_for(state),
                        reenter_reason=reenter, fresh_generation=fresh_generation)
            decision = decide(state, view, self._limits)
            if decision.outcome is Outcome.WRITE:
                try:
                    self._write(decision, token)
                except StoreUnavailableError:
                    if not self._backend.outages_are_transient or time.monotonic() > deadline:
                        raise
                continue
            if decision.outcome is Outcome.JOINED:
                return self._joined(decision.state)  # type: ignore[arg-type]
            if decision.outcome is Outcome.BUDGET_SPENT:
                message = (f"etcd-ext run {self._settings.run_id}: {decision.state.note}; "  # type: ignore[union-attr]
                           "every agent stops. Fix the failing workers, then start the job again "
                           "(a new job resets the budget)")
                logger.error(message)
                self._record(message, NodeState.FAILED)
                raise RestartBudgetExhaustedError(message)
            if decision.outcome is Outcome.CLOSED:
                raise RendezvousClosedError(f"etcd-ext run {self._settings.run_id} was closed")
            if state is not None and state.note not in (last_note, self._last_written_note):
                last_note = state.note
                logger.info("etcd-ext: %s", state.note)
            if time.monotonic() > deadline:
                raise RendezvousTimeoutError(self._timeout_message(state))
            time.sleep(_POLL)

    def is_closed(self) -> bool:
        state, _ = self._read()
        return state is not None and state.status is Status.CLOSED

    def set_closed(self) -> None:
        self._update_status(Status.CLOSED, f"closed by {self._node}")

    def num_nodes_waiting(self) -> int:
        return self._keeper.pressure.count

    def shutdown(self) -> bool:
        """Leave the run. If our workers failed for good, the whole job's budget is spent."""
        failure = sys.exc_info()[1]
        try:
            if isinstance(failure, ChildFailedError) and self._settings.max_restarts is not None:
                self._update_status(Status.BUDGET_SPENT,
                                    f"restart budget spent: node {self._node} used up "
                                    f"--max-restarts={self._settings.max_restarts} and left")
            self._keeper.stop()
            self._backend.leave(self._node)
            self._record(f"node {self._node} left", NodeState.SUCCEEDED)
            self._remove_run_if_everyone_left()
            return True
        except Exception as exc:  # leaving is best effort: the heartbeat expires anyway
            logger.warning("etcd-ext: could not announce our exit: %s", exc)
            return False
        finally:
            self._control.close()
            self._backend.close()

    # -- internals ---------------------------------------------------------------------------
    def _remove_run_if_everyone_left(self) -> None:
        """The last agent to leave removes the run's keys, so a finished job leaves nothing.

        Each agent marks itself left before it looks, so of agents leaving together the
        last one sees all the others gone. A crashed job's keys stay until a new job
        with the same run id finds every node dead and starts a new generation.
        """
        state, _ = self._read()
        if state is None:
            return
        others = sorted(state.known_nodes() - {self._node})
        beats = self._backend.read_beats(others)
        if all(value is None or value == LEFT for value in beats.values()):
            self._backend.remove_run()
            logger.info("etcd-ext: last node out; removed the keys of run %s", self._settings.run_id)

    def _start_keeper(self) -> None:
        if self._keeper_started:
            return
        self._backend.beat(self._node)  # fail fast and clearly if the store is unreachable
        self._keeper.tick()
        self._keeper.start()
        self._keeper_started = True

    def _read(self) -> tuple[RunState | None, object]:
        current = self._backend.get_state()
        if current is None:
            return None, None
        raw, token = current
        return RunState.from_bytes(raw), token

    def _write(self, decision: Decision, token: object) -> None:
        new = decision.state
        assert new is not None
        result = self._backend.set_state(new.to_bytes(), token)
        if result is not None and result[2] and new.note != self._last_written_note:
            self._last_written_note = new.note
            self._record(new.note)

    def _min_reached_for(self, state: RunState | None) -> float | None:
        if state is None or state.phase is not Phase.OPEN:
            return None
        key = (state.generation, state.round)
        if len(state.members) < self._settings.min_nodes:
            self._min_reached_at.pop(key, None)
            return None
        started = self._min_reached_at.setdefault(key, time.monotonic())
        return time.monotonic() - started

    def _joined(self, state: RunState) -> RendezvousInfo:
        self._completed = (state.generation, state.round)
        self._keeper.watch_round(self._completed)
        self._control.publish_round(state.round)
        rank = state.rank_of(self._node)
        master = state.master()
        self._record(f"joined round {state.round} as rank {rank} of {len(state.order)}",
                     NodeState.RUNNING, rank)
        logger.info("etcd-ext: round %d of run %s: rank %d of %d, workers' store at %s:%d",
                    state.round, self._settings.run_id, rank, len(state.order), master.addr,
                    master.port)
        self._forget_old_rounds(state)
        return RendezvousInfo(
            store=self._backend.round_store(state.generation, state.round),
            rank=rank, world_size=len(state.order),
            bootstrap_store_info=RendezvousStoreInfo(master.addr, master.port))

    def _forget_old_rounds(self, state: RunState) -> None:
        drop = getattr(self._backend, "drop_round_stores", None)
        if drop is not None and state.rank_of(self._node) == 0:
            try:
                drop(state.generation, state.round - 1)
            except Exception as exc:
                logger.debug("etcd-ext: could not drop old round stores: %s", exc)
        self._min_reached_at = {k: v for k, v in self._min_reached_at.items()
                                if k == (state.generation, state.round)}

    def _update_status(self, status: Status, note: str) -> None:
        retrying = Retrying(stop=stop_after_delay(self._settings.timeouts.close), wait=wait_fixed(0.1),
                            retry=retry_if_exception_type(StoreUnavailableError), reraise=True)
        for attempt in retrying:
            with attempt:
                while True:
                    state, token = self._read()
                    if state is None or state.status is status:
                        return
                    result = self._backend.set_state(
                        replace(state, status=status, note=note).to_bytes(), token)
                    if result is not None and result[2]:
                        self._record(note)
                        return

    def _timeout_message(self, state: RunState | None) -> str:
        joined = len(state.members) if state and state.phase is Phase.OPEN else 0
        return (f"etcd-ext run {self._settings.run_id}: no round admitted this node within "
                f"join_timeout={self._settings.timeouts.join:g}s ({joined} node(s) joined, "
                f"--nnodes needs at least {self._settings.min_nodes}). Start more nodes, lower "
                "--nnodes MIN, or raise --rdzv-conf join_timeout")

    def _record(self, message: str, node_state: NodeState = NodeState.RUNNING,
                rank: int | None = None) -> None:
        logger.info("etcd-ext event: %s", message)
        try:
            construct_and_record_rdzv_event(
                run_id=self._settings.run_id, message=message, node_state=node_state,
                name=f"etcd-ext.{self._node}", hostname=self._addr, pid=os.getpid(), rank=rank)
        except Exception:  # events are best effort; never fail a rendezvous over them
            logger.debug("could not record rendezvous event", exc_info=True)
