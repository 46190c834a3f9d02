"""Join keys and the closer (``joins.py``), and the watcher's verdict: pure logic, plus the
store work they save, counted on the in-memory backend with many in-process agents."""

from __future__ import annotations

import threading
import zlib
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path

import pytest

from elastic_ext.agent.control import AgentControl
from elastic_ext.rendezvous.agent.closer_joins import CloserJoins
from elastic_ext.rendezvous.agent.events import EventLog
from elastic_ext.rendezvous.agent.handler import EtcdExtRendezvousHandler
from elastic_ext.rendezvous.agent.keeper import Keeper
from elastic_ext.rendezvous.agent.run_view import RunView
from elastic_ext.rendezvous.errors import CorruptStateError
from elastic_ext.rendezvous.protocol.head import Head
from elastic_ext.rendezvous.protocol.joins import (
    JoinEntry,
    closer_of,
    is_own_join,
    removed_members,
    replacement_turn,
    with_joins,
)
from elastic_ext.rendezvous.protocol.liveness import Verdict
from elastic_ext.rendezvous.protocol.pace import Pace
from elastic_ext.rendezvous.protocol.policy import Limits
from elastic_ext.rendezvous.protocol.state import NodeInfo, Phase, RunState, Status
from elastic_ext.rendezvous.stores.contract import KeeperRead
from elastic_ext.rendezvous.stores.wire import unwrap_state, wrap_state
from tests.support.handler_lab import FakeClock
from tests.support.memory_backend import MemoryBackend, MemoryStore
from tests.support.stores import settings_for


def info(port: int) -> NodeInfo:
    # loopback: a watcher holds connections to everyone's presence port at this address
    # (nothing may leave the machine; some networks accept and close any connection)
    return NodeInfo("127.0.0.1", port)


def entry(port: int, unreachable: tuple[str, ...] = ()) -> bytes:
    return JoinEntry(info(port), unreachable).to_bytes()


OPEN = RunState(generation="g", round=2, phase=Phase.OPEN, members={"closer": info(1)},
                previous=("closer", "a", "b"))


# -- join entries and merging -----------------------------------------------------------
def test_a_join_entry_round_trips_and_anything_else_is_ignored() -> None:
    e = JoinEntry(info(7), ("x", "y"))
    assert JoinEntry.from_bytes(e.to_bytes()) == e
    for raw in (b"", b"{}", b"[1]", b'{"addr":1,"port":2,"unreachable":[]}',
                b'{"addr":"a","port":0,"unreachable":[]}',
                b'{"addr":"a","port":true,"unreachable":[]}',
                b'{"addr":"a","port":5,"unreachable":[3]}', b"\xff\xfe", b"[" * 100_000):
        assert JoinEntry.from_bytes(raw) is None


def test_joins_merge_in_join_order_up_to_max_and_the_rest_wait() -> None:
    joins = [("a", entry(2)), ("b", entry(3, ("c",))), ("c", entry(4))]
    merged = with_joins(OPEN, joins, max_nodes=3)
    assert list(merged.members) == ["closer", "a", "b"]
    assert list(merged.waiting) == ["c"]
    assert merged.unreachable == {"b": ("c",)}
    assert closer_of(merged) == "closer"


def test_merging_skips_garbage_nodes_left_out_and_nodes_already_in() -> None:
    state = replace(OPEN, excluded={"cut": "not reachable"})
    joins = [("closer", entry(9)), ("junk", b"not json"), ("cut", entry(5)), ("a", entry(2))]
    merged = with_joins(state, joins, max_nodes=8)
    assert merged.members == {"closer": info(1), "a": info(2)}  # the closer keeps its entry


@pytest.mark.parametrize("state", [
    replace(OPEN, phase=Phase.CLOSED, order=("closer",)),
    replace(OPEN, status=Status.FINISHED),
])
def test_only_an_active_open_round_takes_joins(state: RunState) -> None:
    assert with_joins(state, [("a", entry(2))], max_nodes=8) is state


def test_the_closer_is_the_open_rounds_first_member_and_rank_0_of_a_closed_one() -> None:
    assert closer_of(None) is None
    assert closer_of(replace(OPEN, members={})) is None
    closed = replace(OPEN, phase=Phase.CLOSED, members={"b": info(3), "a": info(2)},
                     order=("a", "b"))
    assert closer_of(closed) == "a"


def test_a_join_is_told_apart_from_other_writes() -> None:
    joined = replace(OPEN, members={**OPEN.members, "me": info(5)})
    assert is_own_join(OPEN, joined, "me")
    assert not is_own_join(OPEN, joined, "other")
    assert not is_own_join(OPEN, replace(joined, round=3), "me")
    assert not is_own_join(OPEN, replace(joined, status=Status.BUDGET_SPENT), "me")
    assert not is_own_join(OPEN, replace(joined, phase=Phase.CLOSED, order=("closer", "me")),
                           "me")
    dropped = replace(OPEN, members={"me": info(5)})  # the closer dropped while joining
    assert not is_own_join(OPEN, dropped, "me")


def test_members_dropped_from_the_open_round_lose_their_join_keys() -> None:
    merged = with_joins(OPEN, [("a", entry(2)), ("b", entry(3))], max_nodes=8)
    assert removed_members(merged, replace(merged, members={"a": info(2)})) == ["b", "closer"]
    closed = replace(merged, phase=Phase.CLOSED, order=tuple(merged.members))
    assert removed_members(merged, closed) == []  # closing keeps everyone
    assert removed_members(merged, replace(merged, round=3, members={})) == []


# -- the verdict ------------------------------------------------------------------------
def test_a_verdict_round_trips_and_anything_else_is_no_verdict() -> None:
    v = Verdict("w", "g", frozenset({"x", "y"}), frozenset({"y"}))
    assert Verdict.from_bytes(v.to_bytes()) == v
    for raw in (None, b"", b"[]", b'{"by":"w"}', b'{"by":1,"generation":"g","dead":[],"left":[]}',
                b'{"by":"w","generation":"g","dead":[1],"left":[]}'):
        assert Verdict.from_bytes(raw) is None


class CountingBackend(MemoryBackend):
    """Counts the heartbeat keys each keeper tick reads and every state write."""

    def __init__(self, store: MemoryStore, counts: Counter[str]) -> None:
        super().__init__(store)
        self.counts = counts

    def keeper_read(self, node: str, presence_port: int | None,
                    watched: Sequence[str], due: bool = True, pace: Pace | None = None
                    ) -> KeeperRead:
        self.counts["keeper_reads"] += 1
        self.counts["beats_read"] += len(watched)
        return super().keeper_read(node, presence_port, watched, due, pace)

    def get_state(self) -> tuple[bytes, object] | None:
        self.counts["state_reads"] += 1
        return super().get_state()

    def set_state(self, state: bytes, token: object | None = None
                  ) -> tuple[bytes, object, bool] | None:
        result = super().set_state(state, token)
        self.counts["cas_ok" if result is not None and result[2] else "cas_lost"] += 1
        return result

    def join(self, generation: str, round_: int, node: str, entry: bytes) -> int:
        self.counts["joins"] += 1
        return super().join(generation, round_, node, entry)

    def read_joins(self, generation: str, round_: int) -> list[tuple[str, bytes]]:
        self.counts["join_lists_read"] += 1
        self.counts[f"read_joins:{threading.current_thread().name}"] += 1
        return super().read_joins(generation, round_)

    def write_verdict(self, verdict: bytes) -> None:
        self.counts["verdicts"] += 1
        super().write_verdict(verdict)

    def drop_joins(self, generation: str, round_: int, nodes: Iterable[str]) -> None:
        super().drop_joins(generation, round_, nodes)

    def clone(self) -> CountingBackend:
        return CountingBackend(self.store, self.counts)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def keepers(store: MemoryStore, counts: Counter[str], nodes: list[str], clock: Clock,
            tmp_path: Path) -> list[Keeper]:
    limits = Limits(1, len(nodes), 1.0, None)
    return [Keeper(CountingBackend(store, counts), n, interval=0.5, timeout=3.0, limits=limits,
                   control=AgentControl(tmp_path / f"c-{n}"),
                   events=EventLog("run1", n, "127.0.0.1", None), clock=clock) for n in nodes]


def tick_all(ks: Sequence[Keeper], clock: Clock, ticks: int) -> None:
    """``ticks`` keeper intervals of half a second, every keeper ticking once in each."""
    for _ in range(ticks):
        clock.now += 0.5
        for k in ks:
            k.tick()


def closed_state(nodes: list[str]) -> RunState:
    return RunState(generation="g", round=1, phase=Phase.CLOSED,
                    members={n: info(1000 + i) for i, n in enumerate(nodes)}, order=tuple(nodes))


def test_liveness_reads_grow_linearly_with_the_job_not_quadratically(tmp_path: Path) -> None:
    # Issue 14: every keeper read every heartbeat (N^2 per interval). Now rank 0 reads
    # them all and the others read its heartbeat and its verdict.
    for n in (16, 64):
        store, counts, clock = MemoryStore(), Counter[str](), Clock()
        nodes = [f"n{i:03d}" for i in range(n)]
        MemoryBackend(store).set_state(closed_state(nodes).to_bytes())
        ks = keepers(store, counts, nodes, clock, tmp_path / str(n))
        for _ in range(2):  # the first tick reads the state: judges nobody yet
            for k in ks:
                k.tick()
        counts.clear()
        tick_all(ks, clock, 10)
        per_tick = counts["beats_read"] / 10
        assert per_tick == (n - 1) + (n - 1)  # rank 0: n-1; every other: 1
        assert counts["state_reads"] == 0  # the state did not change: nobody read it
        assert counts["verdicts"] == 0  # nor did the verdict


def test_a_keeper_tick_over_an_unchanged_state_does_no_work_per_node(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Every tick listed the state's nodes (members, waiting, previous) into fresh sets:
    # 0.25 ms a tick at 1,024 nodes, for every agent twice a second.
    listed = Counter[str]()
    known_nodes = RunState.known_nodes

    def counting(state: RunState) -> set[str]:
        listed["known_nodes"] += 1
        return known_nodes(state)
    monkeypatch.setattr(RunState, "known_nodes", counting)
    store, counts, clock = MemoryStore(), Counter[str](), Clock()
    nodes = [f"n{i:03d}" for i in range(64)]
    MemoryBackend(store).set_state(closed_state(nodes).to_bytes())
    ks = keepers(store, counts, nodes, clock, tmp_path)
    for k in ks:
        k.watch_round(("g", 1))
        k.tick()
        k.tick()
    listed.clear()
    tick_all(ks, clock, 4)
    assert listed["known_nodes"] == 0
    assert all(k.pressure.count == 0 for k in ks)


def test_a_death_reaches_everyone_through_the_verdict_in_about_the_timeout(
        tmp_path: Path) -> None:
    store, counts, clock = MemoryStore(), Counter[str](), Clock()
    nodes = ["w", "a", "b", "victim"]
    MemoryBackend(store).set_state(closed_state(nodes).to_bytes())
    ks = keepers(store, counts, nodes, clock, tmp_path)
    for k in ks:
        k.tick()
        k.watch_round(("g", 1))
    alive = ks[:3]
    for _ in range(1, 20):
        clock.now += 0.5
        for k in alive:  # the victim stopped beating at time 0
            k.tick()
        if all(k.pressure.count for k in alive):
            break
    assert clock.now <= 3.5 + 0.5  # the timeout, and one tick to read the verdict
    assert all("victim" in k.pressure.why for k in alive)
    assert ks[1].dead_among({"victim", "w", "b"}) == {"victim"}


def test_a_verdict_counts_only_from_the_watcher_of_this_generation(tmp_path: Path) -> None:
    store, counts, clock = MemoryStore(), Counter[str](), Clock()
    nodes = ["w", "a", "b"]
    MemoryBackend(store).set_state(closed_state(nodes).to_bytes())
    a = keepers(store, counts, nodes, clock, tmp_path)[1]
    peer = MemoryBackend(store)
    for forged in (Verdict("b", "g", frozenset({"w"})), Verdict("w", "old", frozenset({"b"}))):
        peer.write_verdict(forged.to_bytes())
        for _ in range(3):
            peer.beat("w")
            peer.beat("b")
            clock.now += 0.5
            a.tick()
        assert a.dead_among({"w", "b"}) == set()
    peer.write_verdict(Verdict("w", "g", frozenset({"b"})).to_bytes())
    a.tick()
    assert a.dead_among({"w", "b"}) == {"b"}


def test_the_members_of_a_round_whose_watcher_died_go_on_reading_its_heartbeat_alone(
        tmp_path: Path) -> None:
    # Every survivor of a dead rank 0 read every heartbeat at each tick until the next
    # round opened: N² (217 KB per agent per round change at 512 agents on etcd). Its
    # death ends their round anyway; a node outside the round still judges everyone.
    store, counts, clock = MemoryStore(), Counter[str](), Clock()
    nodes = [f"n{i:02d}" for i in range(16)]
    MemoryBackend(store).set_state(closed_state(nodes).to_bytes())
    judged = Counter[str]()
    *_, stranger = keepers(store, judged, [*nodes, "new"], clock, tmp_path / "s")
    members = keepers(store, counts, nodes, clock, tmp_path)[1:]  # n00, the watcher, is dead
    for k in members:
        k.tick()
        k.watch_round(("g", 1))
    stranger.tick()
    tick_all([*members, stranger], clock, 8)
    assert all("n00" in k.pressure.why for k in members)
    assert stranger.dead_among({"n00"}) == {"n00"}
    counts.clear()
    tick_all(members, clock, 1)
    assert counts["beats_read"] == len(members)  # the dead watcher's, one each
    judged.clear()
    stranger.tick()
    assert judged["beats_read"] == len(nodes)  # everyone of the round


def test_a_death_is_reported_once_not_again_at_every_round(tmp_path: Path) -> None:
    # Reported again at each round, one death counted in elastic_ext_nodes_lost_total
    # once per round by every agent.
    store, clock = MemoryStore(), Clock()
    MemoryBackend(store).set_state(closed_state(["w", "a", "victim"]).to_bytes())
    seen: list[str] = []
    watcher = Keeper(MemoryBackend(store), "w", interval=0.5, timeout=3.0,
                     limits=Limits(1, 3, 1.0, None), control=AgentControl(tmp_path / "c"),
                     events=EventLog("run1", "w", "127.0.0.1", None, listeners=[
                         lambda kind, fields: seen.append(fields["peer"])
                         if kind.value == "node_dead" else None]), clock=clock)
    peer = MemoryBackend(store)
    for round_ in (1, 2, 3):
        watcher.watch_round(("g", round_))
        for _ in range(8):
            peer.beat("a")
            clock.now += 0.5
            watcher.tick()
    assert seen == ["victim"]


def test_a_new_watcher_keeps_the_last_verdicts_dead_until_they_beat(tmp_path: Path) -> None:
    store, counts, clock = MemoryStore(), Counter[str](), Clock()
    peer = MemoryBackend(store)
    peer.set_state(closed_state(["w", "a", "dead", "back"]).to_bytes())
    a = keepers(store, counts, ["w", "a", "dead", "back"], clock, tmp_path)[1]
    peer.write_verdict(Verdict("w", "g", frozenset({"dead", "back"})).to_bytes())
    a.tick()
    a.tick()
    assert a.dead_among({"dead", "back"}) == {"dead", "back"}
    # "a" opens the next round: it closes it and now watches everyone itself
    current = peer.get_state()
    assert current is not None
    opened = RunState(generation="g", round=2, phase=Phase.OPEN, members={"a": info(1)},
                      previous=("w", "a", "dead", "back"))
    peer.set_state(opened.to_bytes(), current[1])
    a.tick()  # reads the new state
    peer.beat("back")
    clock.now += 0.5
    a.tick()
    peer.beat("back")
    clock.now += 0.5
    a.tick()
    assert a.dead_among({"dead", "back", "w"}) == {"dead"}  # "back" beats: alive again


# -- joining, counted -------------------------------------------------------------------
def test_many_agents_join_with_one_write_each_and_no_compare_and_swap_storm(
        tmp_path: Path) -> None:
    n = 48
    store, counts = MemoryStore(), Counter[str]()
    settings = settings_for("127.0.0.1:2379", "run1", (n, n), join_timeout="60")
    handlers = [EtcdExtRendezvousHandler(settings, CountingBackend(store, counts),
                                         backend_name="etcd-ext", node_id=f"n{i:02d}",
                                         control=AgentControl(tmp_path / f"c{i}"),
                                         keeper_thread=False) for i in range(n)]
    ranks: dict[int, int] = {}
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            ranks[i] = handlers[i].next_rendezvous().rank
        except BaseException as exc:  # reported below
            errors.append(exc)
    threads = [threading.Thread(target=run, args=(i,), name=f"agent-{i}") for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    for h in handlers:
        h.keeper.stop()
    assert not errors and sorted(ranks.values()) == list(range(n))
    assert counts["joins"] == n - 1  # everyone but the node that opened the round
    # the round's state was written to open and to close it; a few agents lose the race
    # to open it, nobody retries a join
    assert counts["cas_ok"] == 2, counts
    assert counts["cas_lost"] <= n, counts
    # only the closer and the node whose join filled the round read the joins
    assert len([k for k in counts if k.startswith("read_joins:")]) <= 2, counts


def test_the_closer_reads_the_joins_again_only_once_they_can_make_min_nodes(
        tmp_path: Path) -> None:
    # It read every join key again at each new join: at N joins one by one, O(N²).
    store, counts = MemoryStore(), Counter[str]()
    peer = MemoryBackend(store)
    joined: list[str] = []

    class JoiningClock(Clock):
        def sleep(self, seconds: float) -> None:  # a node joins while the closer waits
            super().sleep(seconds)
            current = peer.get_state()
            if current is not None and len(joined) < 5:
                state = RunState.from_bytes(current[0])
                joined.append(f"p{len(joined)}")
                peer.join(state.generation, state.round, joined[-1], entry(2000 + len(joined)))

    handler = EtcdExtRendezvousHandler(
        settings_for("127.0.0.1:2379", "run1", (6, 6), join_timeout="60"),
        CountingBackend(store, counts), backend_name="etcd-ext", node_id="closer",
        control=AgentControl(tmp_path / "c"), clock=JoiningClock(), keeper_thread=False)
    try:
        info = handler.next_rendezvous()
    finally:
        handler.keeper.stop()
    assert (info.rank, info.world_size) == (0, 6)
    # once alone in its round, once when the sixth node made MIN
    assert counts["join_lists_read"] == 2, counts


def test_the_closer_decides_again_below_min_only_once_a_second_or_when_min_is_reached(
        tmp_path: Path) -> None:
    # It decided on its whole round every 50 ms, or at each join once it waited on them:
    # at N joins below MIN, O(N) work each time, though nothing it decides waits on them.
    store, counts = MemoryStore(), Counter[str]()
    peer = MemoryBackend(store)
    joined: list[str] = []
    join_at = [1.0 * i for i in range(1, 6)]  # one join a simulated second

    class SlowJoins(Clock):
        def sleep(self, seconds: float) -> None:
            super().sleep(seconds)
            current = peer.get_state()
            if current is not None and join_at and self.now >= join_at[0]:
                join_at.pop(0)
                state = RunState.from_bytes(current[0])
                joined.append(f"p{len(joined)}")
                peer.join(state.generation, state.round, joined[-1], entry(2000 + len(joined)))

    clock = SlowJoins()
    handler = EtcdExtRendezvousHandler(
        settings_for("127.0.0.1:2379", "run1", (6, 6), join_timeout="60"),
        CountingBackend(store, counts), backend_name="etcd-ext", node_id="closer",
        control=AgentControl(tmp_path / "c"), clock=clock, keeper_thread=False)
    try:
        info = handler.next_rendezvous()
    finally:
        handler.keeper.stop()
    assert (info.rank, info.world_size) == (0, 6) and 5.0 <= clock.now < 6.0
    # a read of the state per decision: about one a second for the five seconds below MIN
    # and those of starting the generation (12 here; 107 when it decided every 50 ms)
    assert counts["state_reads"] <= 15, counts


def test_the_closer_probes_the_nodes_it_waits_for_only_once_its_round_could_close(
        tmp_path: Path) -> None:
    # It probed every node of the last round not yet read among the joins, every 0.2 s:
    # at 512 agents, hundreds of live nodes' ports while they joined one by one.
    store, counts = MemoryStore(), Counter[str]()
    peer = MemoryBackend(store)
    peers = [f"p{i}" for i in range(5)]
    peer.set_state(closed_state(["closer", *peers]).to_bytes())
    joined: list[str] = []

    class JoiningClock(Clock):
        def sleep(self, seconds: float) -> None:  # a node joins while the closer waits
            super().sleep(seconds)
            current = peer.get_state()
            state = RunState.from_bytes(current[0]) if current else None
            if state is not None and state.phase is Phase.OPEN and len(joined) < len(peers):
                joined.append(peers[len(joined)])
                peer.join(state.generation, state.round, joined[-1], entry(2000 + len(joined)))

    handler = EtcdExtRendezvousHandler(
        settings_for("127.0.0.1:2379", "run1", (6, 6), join_timeout="60"),
        CountingBackend(store, counts), backend_name="etcd-ext", node_id="closer",
        control=AgentControl(tmp_path / "c"), clock=JoiningClock(), keeper_thread=False)
    probed: list[set[str]] = []
    gone_among = handler.keeper.gone_among

    def counting(nodes: Iterable[str], addrs: Mapping[str, str]) -> frozenset[str]:
        probed.append(set(nodes))
        return gone_among(nodes, addrs)
    handler.keeper.gone_among = counting  # type: ignore[method-assign]
    try:
        assert handler.next_rendezvous().world_size == 6  # round 1, as a member
        info = handler.next_rendezvous()  # round 2, which it opens and closes
    finally:
        handler.keeper.stop()
    assert (info.world_size, len(joined)) == (6, 5)
    assert not [nodes for nodes in probed if nodes], probed


def test_a_node_names_its_presence_port_in_the_state_and_in_its_join() -> None:
    with_port = NodeInfo("10.0.0.1", 5, 6)
    state = replace(OPEN, members={"closer": with_port})
    assert RunState.from_bytes(state.to_bytes()).members["closer"] == with_port
    assert JoinEntry.from_bytes(JoinEntry(with_port).to_bytes()) == JoinEntry(with_port)
    raw = state.to_bytes().replace(b"[\"10.0.0.1\",5,6]", b"[\"10.0.0.1\",5,6,7]")
    with pytest.raises(CorruptStateError, match="presence port"):
        RunState.from_bytes(raw)


def test_a_keeper_read_from_before_the_round_closed_is_no_reason_to_restart(
        tmp_path: Path) -> None:
    # Issue 14, flaw 2: right after round 1 closed, agents whose keeper had read the still
    # open round 1 restarted their workers ("round 1 (open) replaced round 1").
    store, counts, clock = MemoryStore(), Counter[str](), Clock()
    peer = MemoryBackend(store)
    nodes = ["w", "a"]
    opened = replace(closed_state(nodes), phase=Phase.OPEN, order=())
    peer.set_state(opened.to_bytes())
    a = keepers(store, counts, nodes, clock, tmp_path)[1]
    a.tick()  # caches the open round

    class ClosesWhileRead(CountingBackend):
        def get_state(self) -> tuple[bytes, object] | None:
            read = super().get_state()  # the open round...
            current = peer.get_state()
            assert current is not None
            peer.set_state(closed_state(nodes).to_bytes(), current[1])  # ...then it closes
            a.watch_round(("g", 1))  # and the agent joins it meanwhile
            return read
    peer.beat("w")
    a._backend = ClosesWhileRead(store, counts)  # noqa: SLF001 - the race, played exactly
    a.watch_round(None)
    current = peer.get_state()
    assert current is not None
    peer.set_state(replace(opened, note="one more join").to_bytes(), current[1])
    a.tick()
    assert a.pressure.count == 0
    a._backend = CountingBackend(store, counts)  # noqa: SLF001
    for _ in range(3):
        peer.beat("w")
        clock.now += 0.5
        a.tick()
    assert a.pressure.count == 0, a.pressure.why  # the closed round 1 is ours


def test_a_large_state_is_stored_compressed_and_a_damaged_or_huge_one_refused() -> None:
    nodes = {f"node-{i:04d}.cluster.example.com": info(30000 + i) for i in range(400)}
    state = replace(OPEN, members=nodes, phase=Phase.CLOSED, order=tuple(nodes)).to_bytes()
    stored = wrap_state(state)
    assert stored.startswith(b"elastic-ext/1z\n") and len(stored) < len(state) / 2
    assert unwrap_state(stored) == state
    assert unwrap_state(wrap_state(b"{}")) == b"{}"  # small: as it is
    for raw in (stored[:-20], b"elastic-ext/1z\n" + b"junk",
                b"elastic-ext/1z\n" + zlib.compress(b" " * (2 << 20))):
        with pytest.raises(CorruptStateError):
            unwrap_state(raw)


def test_a_dead_closers_joiners_act_in_turns_that_double() -> None:
    """``replacement_turn``: the next joiner at once, then turns of 1, 2, 2, 4 x 3, ...
    joiners: at most 2^(k-1) act at turn k (1,024 joiners: 11 turns, not 1,023 at once);
    a place not known acts at once, as before."""
    turns = [replacement_turn(p) for p in range(0, 11)]
    assert turns == [0, 0, 0, 1, 2, 2, 3, 3, 3, 3, 4]
    assert replacement_turn(1024) == 10


def test_in_an_open_round_only_the_joiner_whose_turn_came_judges_everyone() -> None:
    """``RunView.judges``: the watcher of an open round judged dead makes only the joiner
    replacing it judge everyone; in a closed round, a node not in it judges everyone (a
    requeued job finding its old agents gone) and a member does not (its round ends)."""
    view = RunView(MemoryBackend(MemoryStore()), "me")
    members = {n: NodeInfo("127.0.0.1", 1000 + i) for i, n in enumerate(("w", "me"))}
    view.head = Head.of(RunState(generation="g", round=2, phase=Phase.OPEN, members=members))
    dead = frozenset({"w"})
    assert view.judges(dead, replacing=True) and not view.judges(dead, replacing=False)
    assert not view.judges(frozenset(), replacing=True)
    view.head = Head.of(RunState(generation="g", round=2, phase=Phase.CLOSED, members=members,
                                 order=("w", "me")))
    assert view.judges(dead, replacing=False)
    view.member_of = ("g", 2)
    assert not view.judges(dead, replacing=True)


# -- the closer's wait follows the load (``CloserJoins.wait``) ----------------------------
@pytest.mark.parametrize("max_nodes, spacing, returned_after",
                         [(10, 0.0, 0.1), (10, 0.5, 0.5), (3, 0.5, 0.1)],
                         ids=["fast closer", "slow closer", "slow closer, round filled"])
def test_a_slow_closer_waits_as_long_as_its_decision_took_for_the_joins_to_batch(
        max_nodes: int, spacing: float, returned_after: float) -> None:
    """With MIN reached the closer decided again at every join (each decision merges N
    joins): one that takes 0.5 s to decide now waits 0.5 s, so the joins of that time are
    decided on together; a closer that decides fast still wakes at the next join, and a
    join that fills the round (max 3) ends even a slow closer's wait at once."""
    backend, clock = MemoryBackend(MemoryStore()), FakeClock()
    state = replace(OPEN, members={"closer": info(1), "a": info(2)})  # MIN 2 reached
    joins = CloserJoins(backend, min_nodes=2, max_nodes=max_nodes)
    joins.merged(state)
    began = clock.now

    def a_join_after_a_tenth() -> None:
        if clock.now - began >= 0.1 and not backend.count_joins("g", 2):
            backend.join("g", 2, "b", entry(3))
    clock.on_sleep.append(a_join_after_a_tenth)
    joins.wait(state, 0.05, 1.0, clock, spacing=spacing)
    assert clock.now - began == pytest.approx(returned_after, abs=0.06)
