"""The keeper acts on a state change when the store delivers it, not at its next tick."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

from elastic_ext.agent.control import AgentControl
from elastic_ext.local.processes import wait_until
from elastic_ext.rendezvous.agent.events import EventLog
from elastic_ext.rendezvous.agent.keeper import Keeper
from elastic_ext.rendezvous.protocol.pace import Pace
from elastic_ext.rendezvous.protocol.policy import Limits
from elastic_ext.rendezvous.protocol.state import NodeInfo, Phase, RunState
from elastic_ext.rendezvous.stores.contract import KeeperRead
from tests.support.memory_backend import MemoryBackend, MemoryStore

INTERVAL_S = 5.0  # a tick this far away would leave the change unseen for seconds


def test_a_newer_round_written_elsewhere_makes_the_keeper_leave_within_a_fraction_of_a_tick(
        tmp_path: Path) -> None:
    store = MemoryStore()
    other = MemoryBackend(store)
    members = {"me": NodeInfo("127.0.0.1", 1000), "n1": NodeInfo("127.0.0.1", 1001)}
    closed = RunState(generation="g", round=1, phase=Phase.CLOSED, members=members,
                      order=("me", "n1"))
    written = other.set_state(closed.to_bytes())
    assert written is not None
    other.beat("n1")
    keeper = Keeper(MemoryBackend(store), "me", interval=INTERVAL_S, timeout=30.0,
                    limits=Limits(2, 2, 1.0, None), control=AgentControl(tmp_path / "ctl"),
                    events=EventLog("run1", "me", "127.0.0.1", None))
    keeper.watch_round(("g", 1))
    keeper.start()
    try:
        # the first tick beats (its silence map needs two: the second is INTERVAL_S later,
        # a race with a 5 s wait that the margins of a loaded machine lost)
        wait_until(lambda: other.read_beats(["me"])["me"] is not None, 5.0, 0.01,
                   "the first tick")
        assert keeper.pressure.count == 0
        opened = RunState(generation="g", round=2, phase=Phase.OPEN, members={},
                          previous=("me", "n1"))
        other.set_state(opened.to_bytes(), written[1])
        wait_until(lambda: keeper.pressure.count, 1.0, 0.01, "the keeper to see round 2")
        assert "round 2" in keeper.pressure.why
    finally:
        keeper.stop()


class DueRecordingBackend(MemoryBackend):
    """Records whether each keeper tick was due or woken early."""

    def __init__(self, store: MemoryStore) -> None:
        super().__init__(store)
        self.ticks: list[tuple[float, bool]] = []

    def keeper_read(self, node: str, presence_port: int | None, watched: Sequence[str],
                    due: bool = True, pace: Pace | None = None) -> KeeperRead:
        self.ticks.append((time.monotonic(), due))
        return super().keeper_read(node, presence_port, watched, due, pace)


def test_a_woken_tick_is_not_due_and_does_not_move_the_next_beat(tmp_path: Path) -> None:
    """Every state write and verdict wakes every keeper: at 1,024 agents a request each was
    1,024 per write (issue 27). A woken tick tells the store it is not due (etcd then asks
    nothing), and the beats keep their period: a wake does not put off the next one."""
    store = MemoryStore()
    backend = DueRecordingBackend(store)
    interval = 3.0
    keeper = Keeper(backend, "me", interval=interval, timeout=30.0,
                    limits=Limits(1, 2, 1.0, None), control=AgentControl(tmp_path / "ctl"),
                    events=EventLog("run1", "me", "127.0.0.1", None))
    keeper.start()
    try:
        wait_until(lambda: len(backend.ticks) >= 1, 5.0, 0.01, "the first tick")
        first = backend.ticks[0][0]
        time.sleep(1.0)  # the point: a write a third of the way to the next beat
        MemoryBackend(store).set_state(
            RunState(generation="g", round=1, phase=Phase.OPEN, members={}).to_bytes())
        wait_until(lambda: len(backend.ticks) >= 3, 10.0, 0.01, "the woken tick and the next")
        (_, due1), (woken_at, due2), (next_at, due3) = backend.ticks[:3]
        assert (due1, due2, due3) == (True, False, True)
        # the next beat comes an interval after the first, not after the woken tick
        assert next_at - first >= interval - 0.05 and next_at - woken_at < interval - 0.4, \
            backend.ticks
    finally:
        keeper.stop()
