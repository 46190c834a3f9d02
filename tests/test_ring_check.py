"""A peer nobody can reach is found when its round closes, before the workers start (issue 41).

The pure parts (``protocol/reach.py``: who probes whom, who is cut off; the seat that names
a node's ring; ``policy.decide`` leaving the node out) and the agent's probe
(``agent/ring_check.py``) on a simulated network; the real one, in network namespaces with
etcd and torchrun agents, is ``tests/test_ring_check_netns.py``.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from elastic_ext import net
from elastic_ext.rendezvous.agent.events import EventLog
from elastic_ext.rendezvous.agent.ring_check import RingCheck
from elastic_ext.rendezvous.protocol.head import Seat, seat_of, seats_of
from elastic_ext.rendezvous.protocol.policy import (
    Excluded,
    Joined,
    Limits,
    View,
    Write,
    decide,
    open_next_round,
    unreachable_by_most,
)
from elastic_ext.rendezvous.protocol.reach import (
    RING_SPAN,
    cut_off_in_ring,
    judgeable,
    ring_of,
)
from elastic_ext.rendezvous.protocol.state import NodeInfo, Phase, Reason, RunState
from tests.support.handler_lab import ME, Lab, closed_round

NODES = tuple(f"n{i}" for i in range(8))


# -- who probes whom ---------------------------------------------------------------------------
def test_each_node_probes_its_nearest_ranks_on_both_sides() -> None:
    assert ring_of(NODES, "n0") == ("n1", "n7", "n2", "n6")
    assert ring_of(NODES, "n4") == ("n5", "n3", "n6", "n2")
    assert ring_of(("a", "b", "c"), "a") == ("b", "c")  # small rounds: everyone else once
    assert ring_of(("a", "b"), "a") == ("b",)
    assert ring_of(("a",), "a") == () and ring_of(NODES, "stranger") == ()


@pytest.mark.parametrize("size", [2, 3, 4, 5, 8, 1024])
def test_probing_is_symmetric_and_costs_the_job_o_of_n_probes(size: int) -> None:
    order = tuple(f"n{i}" for i in range(size))
    rings = {node: ring_of(order, node) for node in order}
    assert all(node in rings[other] for node in order for other in rings[node])
    assert sum(len(ring) for ring in rings.values()) <= 2 * RING_SPAN * size


def test_two_nodes_cannot_be_judged_three_can() -> None:
    assert not judgeable(("a", "b"), "a")
    assert judgeable(("a", "b", "c"), "a")


# -- who is cut off ----------------------------------------------------------------------------
def _reports_of_a_cut_off(node: str, order: tuple[str, ...] = NODES) -> dict[str, tuple[str, ...]]:
    """What every node reports when ``node`` reaches nobody: its probers name it, and it
    names all its own neighbours."""
    reports: dict[str, tuple[str, ...]] = {prober: (node,) for prober in ring_of(order, node)}
    reports[node] = ring_of(order, node)
    return reports


def test_a_node_its_ring_probers_cannot_reach_is_cut_off_and_its_own_reports_count_for_nothing(
        ) -> None:
    out = cut_off_in_ring(NODES, NODES, _reports_of_a_cut_off("n3"))
    assert out == {"n3": ["n1", "n2", "n4", "n5"]}


def test_one_bad_link_or_a_minority_of_probers_leaves_nobody_out() -> None:
    assert cut_off_in_ring(NODES, NODES, {"n2": ("n3",)}) == {}
    assert cut_off_in_ring(NODES, NODES, {"n2": ("n3",), "n4": ("n3",)}) == {}  # 2 of 4
    assert cut_off_in_ring(NODES, NODES, {"n1": ("n3",), "n2": ("n3",), "n4": ("n3",)}) \
        == {"n3": ["n1", "n2", "n4"]}  # 3 of 4


def test_only_reports_of_the_next_rounds_members_count_and_the_left_out_are_not_judged_again(
        ) -> None:
    reports = _reports_of_a_cut_off("n3")
    assert cut_off_in_ring(NODES, [n for n in NODES if n not in ("n1", "n2")], reports) == {}
    assert cut_off_in_ring(NODES, NODES, reports, skip=("n3",)) == {}


def test_two_nodes_cut_off_together_are_both_left_out() -> None:
    # n3 and n4 reach each other and nobody else
    reports: dict[str, tuple[str, ...]] = {}
    for island in ("n3", "n4"):
        for prober in ring_of(NODES, island):
            if prober not in ("n3", "n4"):
                reports[prober] = (*reports.get(prober, ()), island)
    assert set(cut_off_in_ring(NODES, NODES, reports)) == {"n3", "n4"}


def test_in_a_two_node_job_nobody_is_cut_off() -> None:
    assert cut_off_in_ring(("a", "b"), ("a", "b"), {"a": ("b",), "b": ("a",)}) == {}


# -- the decision on the next round ------------------------------------------------------------
LIMITS = Limits(min_nodes=2, max_nodes=8, last_call=1.0, max_restarts=3)


def _info(i: int) -> NodeInfo:
    return NodeInfo(f"10.9.0.{10 + i}", 30000 + i, 40000 + i)


def _closed(order: tuple[str, ...] = NODES) -> RunState:
    return RunState(generation="g", round=1, phase=Phase.CLOSED,
                    members={n: _info(i) for i, n in enumerate(order)}, order=order,
                    max_restarts=3)


def _view(me: str, unreachable: tuple[str, ...] = (), completed: int = 1) -> View:
    return View(me=me, my_info=_info(NODES.index(me)), dead=frozenset(),
                completed=("g", completed), min_reached_for=None,
                reenter_reason=Reason.FAILURE, fresh_generation="new",
                unreachable=frozenset(unreachable))


def test_the_next_round_leaves_out_a_node_its_ring_reported_and_closes_without_it_for_free(
        ) -> None:
    reports = _reports_of_a_cut_off("n3")
    state = open_next_round(_closed(), _view("n2", reports["n2"]), Reason.FAILURE)
    state = dataclasses.replace(state, members={n: _info(i) for i, n in enumerate(NODES)},
                                unreachable=reports)
    # the majority rule of all members alone would not: 4 of 7 others, at 1,024 nodes 4 of 1,023
    assert unreachable_by_most(state) == {"n3": ["n1", "n2", "n4", "n5"]}
    decision = decide(state, _view("n2"), LIMITS)
    assert isinstance(decision, Write) and "n3" in decision.state.excluded
    why = decision.state.excluded["n3"]
    assert why.startswith("not reachable from n1, n2, n4, n5, though the store was")
    assert "10.9.0.13" in why  # the address they tried
    assert isinstance(decide(decision.state, _view("n3"), LIMITS), Excluded)
    closing = decide(decision.state, _view("n2"), LIMITS)
    assert isinstance(closing, Write) and closing.state.phase is Phase.CLOSED
    assert "n3" not in closing.state.order and closing.state.restarts == 0
    assert isinstance(decide(closing.state, _view("n2"), LIMITS), Joined)


# -- the seat names the ring -------------------------------------------------------------------
def test_a_seat_names_its_ring_and_where_they_are_and_old_seats_still_parse() -> None:
    state = _closed()
    seat = seat_of(state, "n0")
    assert seat is not None
    assert [name for name, _ in seat.ring] == ["n1", "n7", "n2", "n6"]
    assert dict(seat.ring)["n7"] == _info(7)
    assert Seat.from_bytes(seat.to_bytes()) == seat == seats_of(state)["n0"]
    old = json.loads(seat.to_bytes())[:8]  # written before seats named a ring
    parsed = Seat.from_bytes(json.dumps(old).encode())
    assert parsed is not None and parsed.ring == () and parsed.rank == 0
    assert Seat.from_bytes(json.dumps([*old, [], []]).encode()) is None
    assert Seat.from_bytes(json.dumps([*old, [["x", "not a node"]]]).encode()) is None
    assert len(seat.to_bytes()) < 1024


# -- the probe ---------------------------------------------------------------------------------
class Network:
    """A simulated network: the addresses that do not answer, and every connect made."""

    def __init__(self, silent: set[str], fail_first: int = 0) -> None:
        self.silent = silent
        self.fail_first = fail_first
        self.calls: list[tuple[str, int, float]] = []

    def connect(self, addr: str, port: int, timeout: float) -> bool:
        self.calls.append((addr, port, timeout))
        if addr in self.silent:
            time.sleep(min(timeout, 0.05))
            return False
        if self.fail_first:
            self.fail_first -= 1
            return False
        return True


@pytest.fixture
def events(tmp_path: Path) -> Iterator[tuple[EventLog, Path]]:
    path = tmp_path / "events.jsonl"
    log = EventLog("run", "n0", "10.9.0.10", path)
    yield log, path
    log.close()


def _events(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _seat(order: tuple[str, ...], me: str = "n0") -> Seat:
    seat = seat_of(_closed(order), me)
    assert seat is not None
    return seat


def test_the_probe_reports_a_silent_neighbour_within_its_timeout_naming_address_and_interface(
        events: tuple[EventLog, Path]) -> None:
    log, path = events
    network = Network({"10.9.0.11"})
    check = RingCheck("n0", "127.0.0.1", 0.3, log, connect=network.connect)
    began = time.monotonic()
    assert check.unreachable(_seat(NODES)) == {"n1"}
    assert time.monotonic() - began < 0.3 + 0.2
    assert {(a, p) for a, p, _ in network.calls} == {
        (f"10.9.0.{10 + i}", 40000 + i) for i in (1, 2, 6, 7)}  # the ring, on presence ports
    assert all(timeout <= 0.25 for _, _, timeout in network.calls)
    assert sum(a == "10.9.0.11" for a, _, _ in network.calls) >= 2  # tried again meanwhile
    told = [e for e in _events(path) if e["event"] == "unreachable"]
    assert len(told) == 1 and told[0]["peers"] == ["n1"] and told[0]["before_start"]
    message = str(told[0]["message"])
    assert "n1 at 10.9.0.11:40001" in message and "127.0.0.1 on interface lo" in message


def test_a_neighbour_that_answers_on_a_second_try_is_reached(
        events: tuple[EventLog, Path]) -> None:
    network = Network(set(), fail_first=1)
    check = RingCheck("n0", "127.0.0.1", 0.5, events[0], connect=network.connect)
    assert check.unreachable(_seat(NODES)) == frozenset()
    assert len(network.calls) == 5


def test_with_two_nodes_the_probe_says_so_and_the_workers_start(
        events: tuple[EventLog, Path], caplog: pytest.LogCaptureFixture) -> None:
    network = Network({"10.9.0.11"})
    check = RingCheck("n0", "127.0.0.1", 0.1, events[0], connect=network.connect)
    assert check.unreachable(_seat(("n0", "n1"))) == frozenset()
    assert "nobody can tell which side is cut off" in caplog.text
    assert "reached none of its 1 ring neighbours" in caplog.text


def test_no_probe_when_the_check_is_off_or_the_neighbours_published_no_port(
        events: tuple[EventLog, Path]) -> None:
    network = Network({"10.9.0.11"})
    assert RingCheck("n0", "h", 0, events[0], connect=network.connect) \
        .unreachable(_seat(NODES)) == frozenset()
    portless = dataclasses.replace(_closed(), members={n: NodeInfo("h", 1) for n in NODES})
    seat = seat_of(portless, "n0")
    assert seat is not None
    assert RingCheck("n0", "h", 1, events[0], connect=network.connect) \
        .unreachable(seat) == frozenset()
    assert network.calls == []


# -- the agent: a node that cannot reach a neighbour does not start its workers ------------------
def test_a_node_that_cannot_reach_a_neighbour_reports_it_in_the_next_round_instead_of_starting(
        make_lab, monkeypatch: pytest.MonkeyPatch) -> None:
    lab: Lab = make_lab(nnodes=(1, 3), reach_timeout="0.2")
    nodes = ("peer", ME, "other")
    first = dataclasses.replace(closed_round(nodes), members={
        n: NodeInfo(f"10.9.0.{i}", 30000 + i, 40000 + i) for i, n in enumerate(nodes)})
    for node in nodes:
        lab.peer.beat(node)
    lab.put_state(first)
    network = Network({"10.9.0.2"})
    monkeypatch.setattr("elastic_ext.rendezvous.agent.ring_check.connects", network.connect)
    info = lab.handler.next_rendezvous()  # the others never come back: round 2, alone
    assert info.world_size == 1
    state = lab.state()
    assert state.round == 2 and state.opened_because is Reason.FAILURE
    assert state.unreachable[ME] == ("other",)
    restart = lab.events("restart")
    assert restart and "could not reach other before the workers started" in str(
        restart[0]["why"])
    assert [e["round"] for e in lab.events("joined")] == [1, 2]


# -- the address and the interface --------------------------------------------------------------
def test_the_workers_address_and_interface_come_from_the_flags_or_the_ifname_variables() -> None:
    addresses = {"lo": "127.0.0.1", "eth0": "10.1.0.5", "ib0": "10.2.0.5"}
    assert net.chosen_interface({"NCCL_SOCKET_IFNAME": "ib"}, addresses) \
        == ("NCCL_SOCKET_IFNAME", "ib0", "10.2.0.5")  # NCCL reads a prefix
    assert net.chosen_interface({"GLOO_SOCKET_IFNAME": "ib"}, addresses) is None  # gloo does not
    assert net.chosen_interface({"ELASTIC_EXT_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "ib0"},
                                addresses) == ("ELASTIC_EXT_IFNAME", "eth0", "10.1.0.5")
    assert net.chosen_interface({"NCCL_SOCKET_IFNAME": "^lo,=eth0"}, addresses) \
        == ("NCCL_SOCKET_IFNAME", "eth0", "10.1.0.5")
    assert net.workers_address("10.3.0.1", {"ELASTIC_EXT_IFNAME": "lo"}) == "10.3.0.1"
    assert net.workers_address(None, {"ELASTIC_EXT_IFNAME": "lo"}) == "127.0.0.1"
    assert net.describe_interface("10.2.0.5", {"GLOO_SOCKET_IFNAME": "ib0"}, addresses) \
        == "interface ib0 (GLOO_SOCKET_IFNAME=ib0)"
    assert "no interface of this host holds it" in net.describe_interface(
        "10.7.0.1", {}, addresses)
