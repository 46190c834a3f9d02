"""Preemption notices to some nodes (``rendezvous/drain.py``) and what the rendezvous does
with the nodes that leave: pure logic, no store."""

from dataclasses import replace

import pytest

from elastic_ext.rendezvous.errors import CorruptStateError
from elastic_ext.rendezvous.protocol.drain import settled, with_notice
from elastic_ext.rendezvous.protocol.policy import (
    Joined,
    Left,
    Limits,
    Wait,
    decide,
    restart_pressure,
)
from elastic_ext.rendezvous.protocol.state import Phase, Reason, RunState
from tests.test_state import LIMITS, closed_round, run, view


def noticed(state: RunState, *nodes: str) -> RunState:
    for node in nodes:
        recorded = with_notice(state, node, f"SIGUSR2 to {node}")
        assert recorded is not None
        state = recorded
    return state


def test_a_notice_is_recorded_once_and_not_after_a_decision() -> None:
    s = noticed(closed_round(), "b")
    assert s.notices == {"b": "SIGUSR2 to b"} and "preemption notice to b" in s.note
    assert with_notice(s, "b", "again") is None
    assert with_notice(replace(s, leaving={"c": "x"}), "c", "x") is None
    assert with_notice(replace(s, stop="stopping"), "a", "x") is None


def test_one_node_of_three_leaves_when_the_other_two_make_min() -> None:
    s = settled(noticed(closed_round(), "b"), set(), LIMITS)
    assert s is not None and s.leaving == {"b": "SIGUSR2 to b"} and not s.notices
    assert not s.stop and "2 node(s) train on" in s.note
    assert settled(s, set(), LIMITS) is None  # nothing pending


@pytest.mark.parametrize("also", ["c", None], ids=["two-notices", "one-notice-one-dead"])
def test_fewer_than_min_left_stops_the_whole_job(also: str | None) -> None:
    s = noticed(closed_round(), "b", *([also] if also else []))
    s2 = settled(s, set() if also else {"c"}, LIMITS)
    assert s2 is not None and not s2.leaving and not s2.notices
    assert "fewer than --nnodes MIN=2" in s2.stop and "durable snapshot" in s2.stop


def test_notices_to_every_node_are_one_stop_not_a_leave_then_a_stop() -> None:
    s = settled(noticed(closed_round(), "a", "b", "c"), set(), LIMITS)
    assert s is not None and s.stop and not s.leaving
    assert with_notice(s, "a", "late") is None  # the job stops anyway


def test_a_notice_after_an_earlier_leave_counts_the_nodes_left() -> None:
    s = settled(noticed(closed_round(), "b"), set(), LIMITS)
    assert s is not None
    s = settled(noticed(s, "c"), set(), Limits(1, 3, 1.0, None))
    assert s is not None and set(s.leaving) == {"b", "c"}
    s = settled(noticed(settled(noticed(closed_round(), "b"), set(), LIMITS) or s, "c"),
                set(), LIMITS)
    assert s is not None and s.stop  # only a would be left, MIN is 2


def test_the_leaving_node_is_told_and_the_others_restart_for_free() -> None:
    s = settled(noticed(closed_round(), "b"), set(), LIMITS)
    assert s is not None
    assert isinstance(decide(s, view("b", completed=(s.generation, 1)), LIMITS), Left)
    count, why, reason = restart_pressure(s, "a", frozenset(), LIMITS, (s.generation, 1), False)
    assert (count, reason) == (1, Reason.MEMBERSHIP) and "left out): b" in why


def test_the_next_round_closes_without_waiting_for_the_leaving_node() -> None:
    s = settled(noticed(closed_round(), "b"), set(), LIMITS)
    assert s is not None
    generation = s.generation
    s, d = run(s, view("a", completed=(generation, 1), reason=Reason.MEMBERSHIP))
    assert isinstance(d, Wait) and s.phase is Phase.OPEN
    s, d = run(s, view("c", completed=(generation, 1), reason=Reason.MEMBERSHIP))
    assert s.phase is Phase.CLOSED and set(s.order) == {"a", "c"} and s.restarts == 0
    assert isinstance(d, Joined)


def test_a_leaving_node_that_joined_an_open_round_is_dropped_from_it() -> None:
    s = closed_round()
    s, _ = run(s, view("a", completed=(s.generation, 1), reason=Reason.MEMBERSHIP))
    s, _ = run(s, view("b", completed=(s.generation, 1), reason=Reason.MEMBERSHIP))
    assert s.phase is Phase.OPEN and set(s.members) == {"a", "b"}
    s = settled(noticed(s, "b"), set(), LIMITS)
    assert s is not None and "b" in s.leaving
    s, d = run(s, view("c", completed=(s.generation, 1), reason=Reason.MEMBERSHIP))
    assert "b" not in s.members and isinstance(d, Joined) and set(s.order) == {"a", "c"}


def test_notices_leaving_and_stop_round_trip_and_are_absent_when_empty() -> None:
    s = replace(closed_round(), notices={"a": "x"}, leaving={"b": "y"}, stop="why")
    assert RunState.from_bytes(s.to_bytes()) == s
    plain = closed_round()
    assert b"notices" not in plain.to_bytes() and RunState.from_bytes(plain.to_bytes()) == plain
    for bad in (b'"notices":[1]', b'"leaving":{"b":2}', b'"stop":3'):
        raw = plain.to_bytes()[:-1] + b"," + bad + b"}"
        with pytest.raises(CorruptStateError):
            RunState.from_bytes(raw)
