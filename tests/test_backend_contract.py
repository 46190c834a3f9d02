"""The store contracts (``StoreBackend`` and the four it is made of) on a real etcd, on
the embedded TCPStore, and on the in-memory test double that the fast handler tests use
(so the double is held to it too).

Modelled on torch's own ``RendezvousBackendTestMixin``: current, stale, absent and
unknown tokens, and corrupt state; then heartbeats, round stores and run listing.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import pytest
from torch.distributed import PrefixStore, TCPStore
from torch.distributed.elastic.rendezvous import RendezvousStateError

from elastic_ext.local.etcd import sent_bytes
from elastic_ext.local.processes import wait_until
from elastic_ext.net import free_port
from elastic_ext.rendezvous.protocol.clock import SystemClock
from elastic_ext.rendezvous.protocol.head import Head, Seat
from elastic_ext.rendezvous.protocol.liveness import LEFT
from elastic_ext.rendezvous.protocol.pace import Pace
from elastic_ext.rendezvous.protocol.state import NodeInfo, Phase, RunState
from elastic_ext.rendezvous.settings import Settings
from elastic_ext.rendezvous.stores.c10d.backend import C10dBackend
from elastic_ext.rendezvous.stores.contract import (
    Heartbeats,
    JoinBook,
    RoundStores,
    StateDocument,
    StoreBackend,
)
from elastic_ext.rendezvous.stores.etcd.backend import EtcdBackend
from elastic_ext.rendezvous.stores.wire import STATE_KEY, pace_of, presence_port_of
from tests.support.memory_backend import MemoryBackend, MemoryStore
from tests.support.stores import plant_etcd_state, settings_for


@dataclass
class Store:
    """One store for the contract tests: backends on it, and raw writes to its keys."""

    make: Callable[..., StoreBackend]
    plant: Callable[[str, bytes], None]  # (run id, raw value of its state key)


@pytest.fixture(params=[pytest.param("etcd", marks=pytest.mark.etcd),
                        pytest.param("etcd-lease", marks=pytest.mark.etcd), "c10d", "memory"])
def store(request: pytest.FixtureRequest) -> Iterator[Store]:
    """The parametrized store: a real etcd (heartbeats written, or leased: issue 27), a real
    embedded TCPStore, or the test double."""
    if request.param.startswith("etcd"):
        endpoint = request.getfixturevalue("etcd").members[0].endpoint
        heartbeat = "lease" if request.param == "etcd-lease" else "write"

        def make_etcd(run_id: str = "run1", key_prefix: str = "/elastic-ext") -> StoreBackend:
            return EtcdBackend(settings_for(endpoint, run_id, key_prefix=key_prefix,
                                            heartbeat_mode=heartbeat))

        def plant_etcd(run_id: str, raw: bytes) -> None:
            plant_etcd_state(settings_for(endpoint, run_id), raw)
        yield Store(make_etcd, plant_etcd)
    elif request.param == "c10d":
        port = free_port()
        server = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          multi_tenant=True, timeout=timedelta(seconds=5))

        def settings(run_id: str, key_prefix: str = "/elastic-ext") -> Settings:
            return settings_for(f"c10d://127.0.0.1:{port}", run_id, key_prefix=key_prefix)

        def make_c10d(run_id: str = "run1", key_prefix: str = "/elastic-ext") -> StoreBackend:
            return C10dBackend(settings(run_id, key_prefix), server)

        def plant_c10d(run_id: str, raw: bytes) -> None:
            store: Any = PrefixStore(settings(run_id).run_prefix, server)  # stubs say str values
            store.set(STATE_KEY, raw)
        yield Store(make_c10d, plant_c10d)
    else:
        memory = MemoryStore()

        def make_memory(run_id: str = "run1", key_prefix: str = "/elastic-ext") -> StoreBackend:
            return MemoryBackend(memory, f"{key_prefix}/{run_id}/")

        def plant_memory(run_id: str, raw: bytes) -> None:
            memory.plant(f"/elastic-ext/{run_id}/{STATE_KEY}", raw)
        yield Store(make_memory, plant_memory)


@pytest.fixture
def make_backend(store: Store) -> Callable[..., StoreBackend]:
    return store.make


@pytest.fixture
def backend(make_backend):
    return make_backend()


def state_of(backend: StoreBackend) -> bytes:
    current = backend.get_state()
    assert current is not None
    return current[0]


def set_state(backend, state, token=None):
    result = backend.set_state(state, token)
    assert result is not None
    return result


def test_get_state_returns_what_was_set_with_a_token(backend):
    backend.set_state(b"x")
    state, token = backend.get_state()
    assert state == b"x" and token is not None


def test_get_state_returns_none_when_there_is_no_state(backend):
    assert backend.get_state() is None


def test_set_state_creates_the_state_when_absent(backend):
    state, token, has_set = set_state(backend, b"x")
    assert (state, has_set) == (b"x", True) and token is not None


def test_set_state_with_the_current_token_succeeds_and_changes_the_token(backend):
    _, token1, _ = set_state(backend, b"x")
    state2, token2, has_set = set_state(backend, b"y", token1)
    assert (state2, has_set) == (b"y", True) and token2 != token1


def test_set_state_with_a_stale_token_returns_the_current_state(backend):
    _, token1, _ = set_state(backend, b"x")
    state2, token2, _ = set_state(backend, b"y", token1)
    state3, token3, has_set = set_state(backend, b"z", token1)
    assert (state3, token3, has_set) == (state2, token2, False)


def test_set_state_without_a_token_does_not_overwrite_existing_state(backend):
    state1, token1, _ = set_state(backend, b"x")
    state2, token2, has_set = set_state(backend, b"y")
    assert (state2, token2, has_set) == (state1, token1, False)


def test_set_state_with_an_unknown_token_returns_the_current_state(backend):
    state1, token1, _ = set_state(backend, b"x")
    state2, token2, has_set = set_state(backend, b"y", token="invalid")
    assert (state2, token2, has_set) == (state1, token1, False)


def test_garbage_in_the_state_key_is_a_state_error_not_a_crash(store: Store) -> None:
    backend = store.make()
    store.plant("run1", b"\x80\x04garbage")
    with pytest.raises(RendezvousStateError, match="did not write"):
        backend.get_state()


def test_two_run_ids_do_not_see_each_other(make_backend):
    a, b = make_backend("job-a"), make_backend("job-b")
    set_state(a, b"a-state")
    assert b.get_state() is None
    set_state(b, b"b-state")
    assert state_of(a) == b"a-state" and state_of(b) == b"b-state"
    a.beat("n1")
    assert b.read_beats(["n1"]) == {"n1": None}


def test_heartbeats_advance_and_leaving_is_visible(backend):
    set_state(backend, RunState("gen", 1, Phase.OPEN, {"n1": NodeInfo("h", 1)}).to_bytes())
    backend.beat("n1")
    first = backend.read_beats(["n1", "n2"])
    backend.beat("n1")
    second = backend.read_beats(["n1", "n2"])
    assert first["n2"] is None and first["n1"] != second["n1"]
    backend.leave("n1")
    assert backend.read_beats(["n1"])["n1"] == LEFT


def test_a_heartbeat_after_leaving_does_not_overwrite_left(make_backend) -> None:
    """A keeper thread that outlived its stop beats through a clone after the agent left:
    the node must still read LEFT, or the last node out keeps the run's keys. A new agent
    of the same name (a requeued job) beats again."""
    agent = make_backend()
    set_state(agent, RunState("gen", 1, Phase.OPEN, {"n1": NodeInfo("h", 1)}).to_bytes())
    keeper = agent.clone()
    keeper.beat("n1")
    agent.leave("n1")
    keeper.beat("n1")
    keeper.keeper_read("n1", 1234, ["n1"])
    assert agent.read_beats(["n1"])["n1"] == LEFT
    agent.close()
    keeper.close()
    requeued = make_backend()
    requeued.beat("n1")
    assert requeued.read_beats(["n1"])["n1"] not in (None, LEFT)
    requeued.close()


def test_round_store_supports_what_torchs_agent_does_with_it(backend):
    store = backend.round_store("gen1", 3)
    store.set("torchelastic/role_info/0", b"r0")
    store.multi_set(["a", "b"], ["1", "2"])
    assert store.multi_get(["a", "b"]) == [b"1", b"2"]
    assert store.get("torchelastic/role_info/0") == b"r0"
    assert store.add("counter", 2) == 2 and store.add("counter", 3) == 5
    assert store.check(["a"]) and not store.check(["missing"])
    # etcd: TimeoutError; TCPStore: DistStoreError
    with pytest.raises((TimeoutError, RuntimeError)):
        store.wait(["missing"], timedelta(milliseconds=200))
    other_round = backend.round_store("gen1", 4)
    assert not other_round.check(["a"])


def test_a_clone_sees_the_same_keys(backend: StoreBackend) -> None:
    clone = backend.clone()
    set_state(backend, b"x")
    backend.beat("n1")
    assert state_of(clone) == b"x" and clone.read_beats(["n1"])["n1"] is not None
    clone.close()


def test_beats_through_a_backend_and_its_clone_always_move_the_heartbeat(
        backend: StoreBackend) -> None:
    """The watcher beats through a clone (``beater.py``) beside its keeper's own beats:
    every beat, through either, must read as a change to its judges, or a watcher
    that beats on time could look still (issue 43)."""
    set_state(backend, RunState("gen", 1, Phase.OPEN, {"n1": NodeInfo("h", 1)}).to_bytes())
    clone = backend.clone()
    seen = []
    for beating in [backend, clone, clone, backend, clone, backend]:
        beating.beat("n1", 1234)
        seen.append(backend.read_beats(["n1"])["n1"])
    assert all(a != b for a, b in itertools.pairwise(seen)), seen
    clone.close()


def test_remove_run_deletes_the_state_and_the_heartbeats(make_backend) -> None:
    mine, other = make_backend("mine"), make_backend("other")
    set_state(mine, RunState("gen", 1, Phase.OPEN, {"n1": NodeInfo("h", 1)}).to_bytes())
    mine.beat("n1")
    set_state(other, b"other-state")
    mine.remove_run()
    assert mine.get_state() is None and mine.read_beats(["n1"]) == {"n1": None}
    assert state_of(other) == b"other-state"


def test_a_leave_after_the_last_node_out_removed_the_run_brings_back_no_key(
        make_backend) -> None:
    """A leaving agent's heartbeat key is gone while it leaves (etcd: its lease was
    revoked), so the last other node out may remove the run before this one writes LEFT:
    that write must not bring back a key of a removed run."""
    leaving, last = make_backend("run"), make_backend("run")
    set_state(last, RunState("gen", 1, Phase.OPEN, {"n1": NodeInfo("h", 1),
                                                   "n2": NodeInfo("h", 2)}).to_bytes())
    leaving.beat("n1")
    last.beat("n2")
    last.leave("n2")
    last.remove_run()
    leaving.leave("n1")
    assert leaving.get_state() is None
    assert leaving.read_beats(["n1", "n2"]) == {"n1": None, "n2": None}
    assert "run" not in leaving.list_runs()


def test_dropped_round_stores_and_their_joins_are_gone(make_backend) -> None:
    backend, other_run = make_backend(), make_backend("other")
    for store in (backend, other_run):
        store.round_store("gen1", 1).set("k", "old")
        store.round_store("gen1", 2).set("k", "new")
        store.join("gen1", 1, "n1", b"old-entry")
        store.join("gen1", 2, "n1", b"new-entry")
    backend.round_store("gen0", 5).set("k", "another generation")
    backend.drop_round_stores("gen1", 2)
    assert backend.round_store("gen1", 2).get("k") == b"new"
    assert backend.read_joins("gen1", 2) == [("n1", b"new-entry")]
    assert not backend.round_store("gen1", 1).check(["k"])
    assert not backend.round_store("gen0", 5).check(["k"])
    assert backend.read_joins("gen1", 1) == []
    # another run's keys are not this run's to drop
    assert other_run.round_store("gen1", 1).get("k") == b"old"
    assert other_run.read_joins("gen1", 1) == [("n1", b"old-entry")]


def test_list_runs_names_every_run_under_the_prefix(make_backend) -> None:
    a, b = make_backend("job-a"), make_backend("job-b")
    set_state(a, b"a")
    b.beat("n1")
    assert a.list_runs() == ["job-a", "job-b"] == b.list_runs()
    assert make_backend("job-a", key_prefix="/elsewhere").list_runs() == []


# -- join keys, the verdict, waiting on the state (issue 14) ----------------------------
def test_joins_count_up_in_join_order_and_can_be_dropped(make_backend) -> None:
    a, b = make_backend(), make_backend()
    assert a.count_joins("g", 1) == 0 and a.read_joins("g", 1) == []
    assert a.join("g", 1, "n1", b"e1") == 1
    assert b.join("g", 1, "n2", b"e2") == 2
    assert a.join("g", 2, "n3", b"e3") == 1  # another round: its own keys
    assert b.read_joins("g", 1) == [("n1", b"e1"), ("n2", b"e2")]
    assert b.count_joins("g", 1) >= 2
    a.drop_joins("g", 1, ["n1"])
    assert b.read_joins("g", 1) == [("n2", b"e2")]
    assert a.read_joins("g", 2) == [("n3", b"e3")]


def test_a_join_wakes_a_wait_for_joins_and_what_is_read_after_it_has_it(make_backend) -> None:
    """The closer's wait (issue 27: a watch on etcd, no poll) and its reads after it."""
    a, b = make_backend(), make_backend()
    clock = SystemClock()
    assert a.join("g", 1, "n1", b"e1") == 1
    count = a.count_joins("g", 1)
    began = clock.monotonic()
    assert a.wait_for_joins("g", 1, count, 0.3, clock)  # there are that many already
    assert not a.wait_for_joins("g", 1, count + 1, 0.3, clock)  # nobody joins: waited out
    assert clock.monotonic() - began >= 0.25
    timer = threading.Timer(0.2, lambda: b.join("g", 1, "n2", b"e2"))
    timer.start()
    began = clock.monotonic()
    assert a.wait_for_joins("g", 1, count + 1, 10.0, clock)
    timer.join()
    assert clock.monotonic() - began < 5.0
    assert a.read_joins("g", 1) == [("n1", b"e1"), ("n2", b"e2")]
    assert a.count_joins("g", 1) >= 2
    a.drop_joins("g", 1, ["n1"])
    assert a.read_joins("g", 1) == [("n2", b"e2")]  # at once, from a watch or not
    b.join("g", 1, "n1", b"again")
    assert a.wait_for_joins("g", 1, 2, 10.0, clock)
    assert a.read_joins("g", 1) == [("n2", b"e2"), ("n1", b"again")]
    b.join("g", 2, "n3", b"e3")  # another round's joins, read while the wait watches round 1
    assert a.read_joins("g", 2) == [("n3", b"e3")] and a.count_joins("g", 2) == 1
    a.close()


def test_the_verdict_is_the_last_one_written(make_backend) -> None:
    a, b = make_backend(), make_backend()
    assert a.read_verdict() is None
    a.write_verdict(b"v1")
    b.write_verdict(b"v2")
    assert a.read_verdict() == b"v2"


def test_the_state_version_changes_with_every_write_and_a_write_wakes_a_waiter(
        make_backend) -> None:
    a, b = make_backend(), make_backend()
    _, token, _ = set_state(a, b"x")
    version = a.state_version()
    assert a.state_version() == version
    _, token = a.get_state()
    clock = SystemClock()
    began = clock.monotonic()
    assert not a.wait_for_state(token, 0.3, clock)  # nothing changes: it waits it out
    assert clock.monotonic() - began >= 0.25
    timer = threading.Timer(0.2, lambda: set_state(b, b"y", token))
    timer.start()
    began = clock.monotonic()
    assert a.wait_for_state(token, 10.0, clock)
    timer.join()
    assert clock.monotonic() - began < 5.0 and a.state_version() != version
    set_state(b, b"z", a.get_state()[1])
    assert a.wait_for_state(token, 10.0, clock)  # changed before the wait began: at once


def test_a_state_write_elsewhere_calls_the_change_callback_of_a_backend_and_its_clone(
        make_backend) -> None:
    """What wakes the keeper at a state change instead of at its next tick."""
    a, b = make_backend(), make_backend()
    _, token, _ = set_state(a, b"x")
    calls = [0, 0]

    def count(i: int) -> Callable[[], None]:
        return lambda: calls.__setitem__(i, calls[i] + 1)
    a.on_state_change(count(0))
    a.clone().on_state_change(count(1))
    _, token, _ = set_state(b, b"y", token)
    # Quiet first: a store that notifies may also call as it starts watching.
    deadline, seen, quiet_since = time.monotonic() + 5.0, list(calls), time.monotonic()
    while time.monotonic() < deadline and time.monotonic() - quiet_since < 0.5:
        time.sleep(0.02)
        if calls != seen:
            seen, quiet_since = list(calls), time.monotonic()
    assert all(calls), f"a write by another connection called no callback: {calls}"
    before = list(calls)
    set_state(b, b"z", token)
    wait_until(lambda: all(n > m for n, m in zip(calls, before, strict=True)), 5.0, 0.01,
               "a callback of each backend after the write")
    a.close()


def test_a_keeper_read_beats_and_reads_what_a_keeper_needs(make_backend) -> None:
    a, b = make_backend(), make_backend()
    b.beat("other", 4242)
    set_state(a, b"x")
    b.write_verdict(b"v")
    read = a.keeper_read("me", 4343, ["other", "nobody"])
    assert read.state_version == a.state_version() and read.verdict == b"v"
    assert read.beats["nobody"] is None and read.beats["other"] is not None
    assert b.read_beats(["me"])["me"] is not None
    many = [f"n{i}" for i in range(12)]  # past the few-keys path
    for n in many[:6]:
        b.beat(n)
    # etcd delivers heartbeats by a watch: a write shows within the delivery, so poll
    deadline = time.monotonic() + 5.0
    while True:
        beats = a.keeper_read("me", None, many).beats
        if [n for n in many if beats[n] is not None] == many[:6] or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    assert [n for n in many if beats[n] is not None] == many[:6]


def test_a_keepers_beat_carries_its_pace_to_whoever_reads_its_heartbeat(make_backend) -> None:
    """Stragglers are judged from the paces in the heartbeats (``protocol/straggler.py``);
    the presence port travels beside the pace, and a beat without one carries none."""
    agent, watcher = make_backend(), make_backend()
    agent.keeper_read("me", 4343, [], pace=Pace(0.08, 0.05))
    beat = watcher.read_beats(["me"])["me"]
    assert pace_of(beat) == Pace(0.08, 0.05) and presence_port_of(beat) == 4343
    agent.beat("me", None, Pace(0.2))
    beat = watcher.read_beats(["me"])["me"]
    assert pace_of(beat) == Pace(0.2, None) and presence_port_of(beat) is None
    agent.beat("me", 4343)
    assert pace_of(watcher.read_beats(["me"])["me"]) is None


def test_the_state_after_a_version_is_that_version_or_a_newer_one(make_backend) -> None:
    writer, reader = make_backend(), make_backend()
    keeper = reader.clone()  # as the keeper reads, beside the handler's connection
    assert keeper.state_after(keeper.state_version()) is None
    set_state(writer, b"x")
    first = keeper.state_version()
    state = keeper.state_after(first)
    assert state is not None and state[0] == b"x"
    set_state(writer, b"y", writer.get_state()[1])
    state = keeper.state_after(keeper.state_version())
    assert state is not None and state[0] == b"y"
    state = keeper.state_after(first)  # an older version: this one or newer
    assert state is not None and state[0] in (b"x", b"y")
    keeper.close()


def closed_round(nodes: int, round_: int = 1) -> RunState:
    """A closed round of ``nodes`` nodes, as a closer writes it."""
    members = {f"node-{i:04}.cluster.example:{i}": NodeInfo(f"10.1.{i // 250}.{i % 250}",
                                                            29500 + i % 1000, 40000 + i)
               for i in range(nodes)}
    return RunState(generation="g1", round=round_, phase=Phase.CLOSED, members=members,
                    order=tuple(members), note="closed")


def test_the_head_moves_with_the_state_and_a_closed_round_has_a_seat_for_each_node(
        make_backend) -> None:
    writer, reader = make_backend(), make_backend()
    opened = RunState(generation="g1", round=1, phase=Phase.OPEN,
                      members={"a": NodeInfo("10.0.0.1", 1, 2)}, waiting={"w": NodeInfo("h", 3)})
    _, token, _ = set_state(writer, opened.to_bytes())
    head = reader.head_after(reader.state_version())
    assert head is not None and head[1] == token and Head.from_bytes(head[0]) == Head.of(opened)
    assert reader.read_seat("g1", 1, "a") is None  # open: no seats
    closed = closed_round(3)
    _, token, _ = set_state(writer, closed.to_bytes(), token)
    head = reader.head_after(reader.state_version())
    assert head is not None and head[1] == token and Head.from_bytes(head[0]) == Head.of(closed)
    for rank, node in enumerate(closed.order):
        seat = Seat.from_bytes(reader.read_seat("g1", 1, node))
        assert seat is not None and seat.fits(Head.of(closed)) and seat.rank == rank
        assert (seat.world_size, seat.master_addr, seat.master_port) == (3, "10.1.0.0", 29500)
    assert reader.read_seat("g1", 1, "stranger") is None
    assert reader.read_seat("g1", 2, closed.order[0]) is None


def test_a_close_that_lost_leaves_no_seat_that_fits_the_round_that_won(make_backend) -> None:
    """The closer writes the seats before its closing compare-and-swap: if that loses, and
    the round closes later with other nodes, the seats left of the first try do not fit."""
    a, b = make_backend(), make_backend()
    opened = RunState(generation="g1", round=1, phase=Phase.OPEN,
                      members={"a": NodeInfo("h", 1)})
    _, token, _ = set_state(a, opened.to_bytes())
    _, newer, _ = set_state(b, replace(opened, note="a notice").to_bytes(), token)
    three = closed_round(3)
    assert not set_state(a, three.to_bytes(), token)[2]  # lost: its seats stay behind
    two = replace(three, members=dict(list(three.members.items())[:2]), order=three.order[:2])
    assert set_state(b, two.to_bytes(), newer)[2]
    head = Head.from_bytes(b.head_after(None)[0])
    left_behind = Seat.from_bytes(a.read_seat("g1", 1, three.order[2]))
    assert left_behind is None or not left_behind.fits(head)
    seats = [Seat.from_bytes(a.read_seat("g1", 1, n)) for n in two.order]
    assert all(seat is not None and seat.fits(head) for seat in seats)


@pytest.mark.etcd
def test_a_keepers_head_reads_come_from_the_handlers_watch_on_etcd(etcd, monkeypatch) -> None:
    """At 1,024 agents each version of the state read again by every keeper was a second
    copy of every round change (issue 27): the keeper's clone shares the head's watch, and
    reads nothing of the state."""
    endpoint = etcd.members[0].endpoint
    writer = EtcdBackend(settings_for(endpoint))
    handler_side = EtcdBackend(settings_for(endpoint))
    keeper = handler_side.clone()
    reads: list[str] = []
    monkeypatch.setattr(keeper, "read_whole_state", lambda: reads.append("read_whole_state"))
    _, token, _ = set_state(writer, closed_round(2).to_bytes())
    assert handler_side.wait_for_state(None, 5.0, SystemClock())  # the handler's watch runs
    for round_ in (2, 3):
        state = closed_round(2, round_)
        _, token, _ = set_state(writer, state.to_bytes(), token)
        head = keeper.head_after(keeper.state_version())
        assert head is not None and Head.from_bytes(head[0]) == Head.of(state)
    assert reads == []
    handler_side.close()


@pytest.mark.etcd
def test_a_round_change_reaches_a_node_in_a_few_bytes_however_large_the_round_on_etcd(
        etcd) -> None:
    """At a round change every agent read the whole state (29 KB at 1,024 nodes: O(N²) for
    the job, issue 27); now its head by the watch, and its seat: a few hundred bytes."""
    endpoint, url = etcd.members[0].endpoint, etcd.members[0].client_url
    writer, reader = EtcdBackend(settings_for(endpoint)), EtcdBackend(settings_for(endpoint))
    first, second = closed_round(1024, 1), closed_round(1024, 2)
    _, token, _ = set_state(writer, first.to_bytes())
    assert reader.wait_for_state(None, 5.0, SystemClock())  # the watch runs
    before = sent_bytes(url)
    assert state_of(reader) == first.to_bytes()
    whole = sent_bytes(url) - before
    _, token, _ = set_state(writer, second.to_bytes(), token)  # the seats, then the state
    before = sent_bytes(url)
    assert reader.wait_for_state(token - 1, 5.0, SystemClock())
    current = reader.head_after(reader.state_version())
    assert current is not None
    head = Head.from_bytes(current[0])
    seat = Seat.from_bytes(reader.read_seat("g1", 2, second.order[700]))
    moved = sent_bytes(url) - before
    assert seat is not None and seat.fits(head) and seat.rank == 700
    assert head == Head.of(second) and head.size == 1024
    assert whole > 20_000 and moved < 2_000, (whole, moved)
    reader.close()


def test_dropping_more_joins_than_one_transaction_holds(backend: StoreBackend) -> None:
    nodes = [f"n{i:03}" for i in range(300)]
    for node in nodes:
        backend.join("g", 1, node, b"entry")
    backend.drop_joins("g", 1, nodes[1:])
    assert backend.read_joins("g", 1) == [("n000", b"entry")]


CONTRACT_LIMIT = 12
"""The most members one store contract may have (issue 39: torch's ``RendezvousBackend``
has 3; etcd's ``concurrency`` builds on narrow interfaces)."""


def members(contract: type) -> set[str]:
    """The public members ``contract`` itself defines (not those it inherits)."""
    return {name for name in vars(contract) if not name.startswith("_")}


@pytest.mark.parametrize("contract", [StateDocument, JoinBook, Heartbeats, RoundStores,
                                      StoreBackend], ids=lambda c: c.__name__)
def test_a_store_contract_stays_narrow(contract: type) -> None:
    assert 0 < len(members(contract)) <= CONTRACT_LIMIT, sorted(members(contract))


def test_the_store_backend_is_its_four_contracts_and_a_connection() -> None:
    """Every public member of a store is in exactly one contract, so that a collaborator
    typed against one contract sees all it may use of a store, and nothing else."""
    contracts = [StateDocument, JoinBook, Heartbeats, RoundStores, StoreBackend]
    every = [name for contract in contracts for name in members(contract)]
    assert len(every) == len(set(every)), "a member is in two contracts"
    public = {name for name in dir(StoreBackend) if not name.startswith("_")}
    assert public == set(every)
    assert set(StoreBackend.__mro__[1:5]) == set(contracts[:4])
