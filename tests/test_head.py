"""The state's head and the seats of a closed round (``head.py``): pure, strict, and what
the keeper decides on them (``policy.head_pressure``, ``run_view``)."""

from __future__ import annotations

import dataclasses

import pytest

from elastic_ext.rendezvous.errors import CorruptStateError
from elastic_ext.rendezvous.protocol.head import (
    Head,
    Seat,
    head_bytes_of,
    seal_of,
    seat_of,
    seats_of,
)
from elastic_ext.rendezvous.protocol.policy import Limits, head_pressure, restart_pressure
from elastic_ext.rendezvous.protocol.state import NodeInfo, Phase, Reason, RunState, Status
from elastic_ext.rendezvous.protocol.watcher import watcher_verdict

LIMITS = Limits(min_nodes=1, max_nodes=4, last_call=1.0, max_restarts=3)


def closed(*nodes: str, round_: int = 1) -> RunState:
    return RunState(generation="g", round=round_, phase=Phase.CLOSED,
                    members={n: NodeInfo(f"10.0.0.{i}", 29500 + i, 40000 + i)
                             for i, n in enumerate(nodes)}, order=nodes)


def test_a_head_says_everything_but_the_lists_of_every_node_and_parses_back() -> None:
    state = dataclasses.replace(closed(*(f"n{i}" for i in range(1000))),
                                waiting={"w": NodeInfo("h", 1)}, leaving={"n3": "SIGUSR2"},
                                excluded={"x": "cut off"}, restarts=2, max_restarts=5)
    head = Head.of(state)
    assert (head.closer, head.size, head.waiting, head.leaving_members) == ("n0", 1000, ("w",),
                                                                           ("n3",))
    assert head.closer_info == NodeInfo("10.0.0.0", 29500, 40000) and head.excluded == ("x",)
    raw = head.to_bytes()
    assert Head.from_bytes(raw) == head and head_bytes_of(state.to_bytes()) == raw
    assert len(raw) < 600 < len(state.to_bytes()) // 50  # a few hundred bytes, not O(N)
    opened = RunState(generation="g", round=2, phase=Phase.OPEN,
                      members={"a": NodeInfo("h", 1)}, previous=state.order)
    assert Head.of(opened).closer == "a" and Head.of(opened).size == 1
    assert Head.of(opened).seal == ""


@pytest.mark.parametrize("raw", [b"", b"[]", b"{}", b'{"generation": 1}', b"\xff" * 10,
                                 b"[" * 100_000])
def test_a_head_that_etcd_ext_did_not_write_is_a_state_error(raw: bytes) -> None:
    with pytest.raises(CorruptStateError, match="does not hold an etcd-ext head|over the limit"):
        Head.from_bytes(raw)


def test_the_seal_is_the_rounds_ranks_and_master_and_nothing_else() -> None:
    state = closed("a", "b", "c")
    assert seal_of(state) == seal_of(dataclasses.replace(state, progress_round=1, note="x"))
    assert seal_of(state) != seal_of(closed("a", "c", "b"))  # other ranks
    assert seal_of(state) != seal_of(closed("a", "b"))  # another roster
    moved = dict(state.members, a=NodeInfo("10.0.0.0", 29999, 40000))
    assert seal_of(state) != seal_of(dataclasses.replace(state, members=moved))  # master
    assert seal_of(state) != seal_of(closed("a", "b", "c", round_=2))


def test_each_node_of_a_closed_round_has_a_seat_that_fits_only_its_head() -> None:
    state = closed("a", "b", "c")
    seats = seats_of(state)
    assert [seats[n].rank for n in state.order] == [0, 1, 2]
    assert seats["b"] == seat_of(state, "b") and seat_of(state, "z") is None
    seat = Seat.from_bytes(seats["c"].to_bytes())
    assert seat == seats["c"] and seat is not None
    assert (seat.world_size, seat.master_addr, seat.master_port) == (3, "10.0.0.0", 29500)
    assert seat.node == NodeInfo("10.0.0.2", 29502, 40002)
    assert seat.fits(Head.of(state)) and not seat.fits(Head.of(closed("a", "b")))
    assert not seat.fits(None) and not seat.fits(Head.of(closed("a", "b", "c", round_=2)))
    assert seats_of(dataclasses.replace(state, phase=Phase.OPEN, order=())) == {}
    for raw in (None, b"", b"[1]", b'["g", 1, 5, 3, "h", 1, "s", ["h", 1]]', b"\xff"):
        assert Seat.from_bytes(raw) is None  # rank 5 of 3 included


def test_the_pressure_on_the_head_is_the_pressure_on_the_state() -> None:
    """``restart_pressure`` over the whole state is ``head_pressure`` over its head and the
    dead of the round: the same answers for every reason to leave."""
    ours = ("g", 1)
    base = closed("a", "b", "c")
    cases = [
        (base, frozenset()), (base, frozenset({"c"})), (base, frozenset({"z"})),
        (dataclasses.replace(base, leaving={"b": "SIGUSR2"}), frozenset()),
        (dataclasses.replace(base, waiting={"w": NodeInfo("h", 1)}), frozenset()),
        (dataclasses.replace(base, status=Status.FINISHED), frozenset()),
        (dataclasses.replace(base, round=2, phase=Phase.OPEN, order=(), previous=base.order,
                             opened_because=Reason.MEMBERSHIP), frozenset({"c"})),
        (dataclasses.replace(base, phase=Phase.OPEN, order=()), frozenset()),
    ]
    for state, dead in cases:
        lost = watcher_verdict("a", state, dead, frozenset()).lost \
            if (state.generation, state.round) == ours and state.phase is Phase.CLOSED \
            else frozenset()
        for fault in (False, True):
            assert head_pressure(Head.of(state), "a", dead, lost, LIMITS, ours, fault) == \
                restart_pressure(state, "a", dead, LIMITS, ours, fault), (state, dead)


def test_the_watchers_verdict_names_the_dead_of_the_last_closed_round() -> None:
    state = closed("a", "b", "c")
    verdict = watcher_verdict("a", state, frozenset({"c", "w"}), frozenset())
    assert (verdict.round, verdict.lost) == (1, frozenset({"c"}))
    opened = dataclasses.replace(state, round=2, phase=Phase.OPEN, order=(),
                                 members={"b": state.members["b"]}, previous=state.order)
    verdict = watcher_verdict("b", opened, frozenset({"c", "w"}), frozenset())
    assert (verdict.round, verdict.lost) == (1, frozenset({"c"}))
