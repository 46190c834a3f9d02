"""The agent under test in-process: its handler on the in-memory store, the simulated
peers writing through another connection, and simulated time (``test_handler_inprocess``,
``test_head_path``). ``make_lab`` is a fixture (``tests/conftest.py``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from elastic_ext.agent.control import AgentControl
from elastic_ext.jsonlines import read_json_lines
from elastic_ext.rendezvous.agent.handler import EtcdExtRendezvousHandler
from elastic_ext.rendezvous.agent.keeper import Keeper
from elastic_ext.rendezvous.protocol.liveness import Verdict
from elastic_ext.rendezvous.protocol.state import NodeInfo, Phase, RunState
from elastic_ext.rendezvous.protocol.watcher import watcher_verdict
from tests.support.memory_backend import MemoryBackend, MemoryStore
from tests.support.stores import settings_for

ME = "me"


class FakeClock:
    """Time that moves only when someone sleeps or the test advances it."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.on_sleep: list[Callable[[], None]] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        for hook in list(self.on_sleep):
            hook()


class FakeStarter:
    """The warm-start server as the handler sees it: how long it takes to be ready."""

    def __init__(self, ready_after: float) -> None:
        self.clock = FakeClock()  # the lab's, once it exists
        self.ready_after = ready_after
        self.waits: list[float] = []
        self.closed = False

    def wait_ready(self, timeout: float) -> bool:
        self.waits.append(timeout)
        self.clock.now += min(self.ready_after, timeout)
        return self.ready_after <= timeout

    def close(self) -> None:
        self.closed = True


@dataclasses.dataclass
class Lab:
    """One agent under test, the store it shares with simulated peers, and its clock."""

    store: MemoryStore
    backend: MemoryBackend
    peer: MemoryBackend  # the connection simulated peers write through
    clock: FakeClock
    handler: EtcdExtRendezvousHandler
    events_file: Path
    control: AgentControl

    @property
    def keeper(self) -> Keeper:
        return self.handler.keeper

    def events(self, kind: str | None = None) -> list[dict[str, object]]:
        return [e for e in read_json_lines(self.events_file) if kind is None or e["event"] == kind]

    def state(self) -> RunState:
        current = self.peer.get_state()
        assert current is not None
        return RunState.from_bytes(current[0])

    def put_state(self, state: RunState) -> None:
        current = self.peer.get_state()
        result = self.peer.set_state(state.to_bytes(), current[1] if current else None)
        assert result is not None and result[2]

    def publish_verdict(self, by: str, dead: set[str], generation: str = "gen0") -> None:
        """Play the node that watches everyone (``joins.closer_of``) judging ``dead`` (of
        the state as it is, when it is of ``generation``)."""
        current = self.peer.get_state()
        state = RunState.from_bytes(current[0]) if current else None
        verdict = watcher_verdict(by, state, frozenset(dead), frozenset()) \
            if state is not None and state.generation == generation \
            else Verdict(by, generation, frozenset(dead))
        self.peer.write_verdict(verdict.to_bytes())

    def advance(self, seconds: float, beating: tuple[str, ...] = ()) -> None:
        """Let ``seconds`` pass in keeper ticks of half a second, ``beating`` peers alive."""
        for _ in range(round(seconds / 0.5)):
            for peer in beating:
                self.peer.beat(peer)
            self.clock.now += 0.5
            self.keeper.tick()


@pytest.fixture
def make_lab(tmp_path: Path) -> Iterator[Callable[..., Lab]]:
    labs: list[Lab] = []

    def make(nnodes: tuple[int, int] = (1, 1), transient: bool = True,
             starter: FakeStarter | None = None, **conf: str) -> Lab:
        conf.setdefault("join_timeout", "30")
        # the simulated peers listen nowhere: the ring check is tested on its own
        # (tests/test_ring_check.py, with a simulated network)
        conf.setdefault("reach_timeout", "0")
        settings = settings_for("127.0.0.1:2379", "run1", nnodes, **conf)
        store = MemoryStore()
        clock = FakeClock()
        control = AgentControl(tmp_path / f"control-{len(labs)}")  # makes the directory
        events_file = tmp_path / f"events-{len(labs)}.jsonl"
        handler = EtcdExtRendezvousHandler(
            settings, MemoryBackend(store, transient=transient), backend_name="etcd-ext",
            events_file=events_file, node_id=ME, control=control, clock=clock,
            keeper_thread=False, starter=starter)
        lab = Lab(store, MemoryBackend(store), MemoryBackend(store), clock, handler, events_file,
                  control)
        labs.append(lab)
        return lab
    yield make
    for lab in labs:
        lab.handler.keeper.stop()


def closed_round(nodes: tuple[str, ...], round_: int = 1, generation: str = "gen0",
                 restarts: int = 0, max_restarts: int | None = 3) -> RunState:
    return RunState(generation=generation, round=round_, phase=Phase.CLOSED,
                    members={n: NodeInfo("127.0.0.1", 30000 + i) for i, n in enumerate(nodes)},
                    order=nodes, restarts=restarts, max_restarts=max_restarts)


def join_with_peer(lab: Lab, peer: str = "peer") -> None:
    """``me`` joins round 1 together with ``peer`` (a simulated node at rank 0)."""
    lab.peer.beat(peer)
    lab.put_state(dataclasses.replace(
        closed_round((peer,)), phase=Phase.OPEN, order=()))
    info = lab.handler.next_rendezvous()
    assert (info.rank, info.world_size) == (1, 2)
