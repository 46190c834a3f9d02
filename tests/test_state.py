"""The rendezvous decision logic, run without any store."""

from dataclasses import replace

import pytest

from elastic_ext.rendezvous.errors import CorruptStateError
from elastic_ext.rendezvous.protocol.policy import (
    BudgetSpent,
    Closed,
    Excluded,
    Finished,
    Joined,
    Limits,
    View,
    Wait,
    Write,
    decide,
    restart_pressure,
    stalled_rounds,
    unreachable_by_most,
)
from elastic_ext.rendezvous.protocol.state import NodeInfo, Phase, Reason, RunState, Status

LIMITS = Limits(min_nodes=2, max_nodes=3, last_call=1.0, max_restarts=1)


def view(me, *, dead=(), completed=None, min_reached_for=None, reason=Reason.FAILURE,
         unreachable=()):
    return View(me=me, my_info=NodeInfo("127.0.0.1", 1000 + ord(me[-1])), dead=frozenset(dead),
                completed=completed, min_reached_for=min_reached_for, reenter_reason=reason,
                fresh_generation=f"gen-{me}", unreachable=frozenset(unreachable))


def run(state, v, limits=LIMITS, max_steps=10):
    """Apply WRITE decisions (as a store would) until the node waits or is done."""
    for _ in range(max_steps):
        d = decide(state, v, limits)
        if not isinstance(d, Write):
            return state, d
        state = d.state
    raise AssertionError("no progress")


def closed_round(nodes=("a", "b", "c"), round_=1, restarts=0):
    s = None
    for i, n in enumerate(nodes):
        s, _ = run(s, view(n, min_reached_for=5.0 if i == len(nodes) - 1 else None))
    assert s is not None and s.phase is Phase.CLOSED and s.round == round_
    return replace(s, restarts=restarts)


def test_first_node_starts_a_generation_with_round_one_open():
    s, d = run(None, view("a"))
    assert (s.round, s.phase, list(s.members)) == (1, Phase.OPEN, ["a"])
    assert isinstance(d, Wait)


def test_fresh_job_waits_the_last_call_before_closing_below_max():
    s, _ = run(None, view("a"))
    s, d = run(s, view("b", min_reached_for=0.2))
    assert s.phase is Phase.OPEN and isinstance(d, Wait)
    s, d = run(s, view("b", min_reached_for=1.0))
    assert s.phase is Phase.CLOSED and s.order == ("a", "b")


def test_round_closes_at_once_when_max_nodes_joined():
    s = closed_round(("a", "b", "c"))
    assert s.order == ("a", "b", "c")


def test_joined_node_gets_its_rank_and_the_master_is_rank_zero():
    s = closed_round()
    d = decide(s, view("b"), LIMITS)
    assert isinstance(d, Joined) and s.rank_of("b") == 1
    assert s.master() == s.members["a"]


def test_reentering_node_opens_the_next_round_remembering_the_previous_order():
    s = closed_round()
    s2, _ = run(s, view("b", completed=(s.generation, 1)))
    assert ((s2.round, s2.phase, s2.previous, list(s2.members))
            == (2, Phase.OPEN, ("a", "b", "c"), ["b"]))


def test_round_after_a_death_closes_as_soon_as_every_live_member_rejoined():
    s = closed_round()
    s, _ = run(s, view("a", completed=(s.generation, 1), dead={"c"}, reason=Reason.MEMBERSHIP))
    s, d = run(s, view("b", completed=(s.generation, 1), dead={"c"}, min_reached_for=0.0))
    assert s.phase is Phase.CLOSED and s.order == ("a", "b")
    assert s.restarts == 0


def test_round_waits_for_a_live_member_until_the_last_call():
    s = closed_round()
    s, _ = run(s, view("a", completed=(s.generation, 1)))
    s, d = run(s, view("b", completed=(s.generation, 1), min_reached_for=0.5))
    assert s.phase is Phase.OPEN and isinstance(d, Wait)  # c is alive but not back yet
    s, _ = run(s, view("b", completed=(s.generation, 1), min_reached_for=1.0))
    assert s.phase is Phase.CLOSED and s.order == ("a", "b")


def test_previous_ranks_are_kept_so_rank_zero_stays_put_when_it_survives():
    s = closed_round()
    for n in ("c", "a"):
        s, _ = run(s, view(n, completed=(s.generation, 1), dead={"b"}, min_reached_for=0.0))
    assert s.order == ("a", "c")


def test_worker_failure_with_unchanged_membership_charges_one_restart():
    s = closed_round()
    for n in ("c", "a", "b"):
        s, _ = run(s, view(n, completed=(s.generation, 1)))
    assert s.phase is Phase.CLOSED and s.restarts == 1 and "restart 1 charged" in s.note


def test_membership_change_is_free_even_if_the_opener_thought_it_was_a_failure():
    s = closed_round()
    for n in ("a", "b"):
        s, _ = run(s, view(n, completed=(s.generation, 1), dead={"c"}, min_reached_for=0.0))
    assert s.restarts == 0


def test_spending_more_than_the_budget_stops_the_run():
    s = closed_round(restarts=1)
    for n in ("c", "a", "b"):
        s, d = run(s, view(n, completed=(s.generation, 1)))
    assert s.status is Status.BUDGET_SPENT and isinstance(d, BudgetSpent)
    assert "--max-restarts=1" in s.note


def test_newcomer_waits_while_a_round_runs_and_creates_pressure_when_there_is_room():
    s = closed_round(("a", "b"))
    s, d = run(s, view("c"))
    assert "c" in s.waiting and isinstance(d, Wait)
    count, why, reason = restart_pressure(s, "a", frozenset(), LIMITS, (s.generation, 1), False)
    assert count == 1 and "c" in why and reason is Reason.MEMBERSHIP


def test_newcomer_creates_no_pressure_when_the_round_is_full():
    s = closed_round(("a", "b", "c"))
    s, _ = run(s, view("d"))
    assert restart_pressure(s, "a", frozenset(), LIMITS, (s.generation, 1), False)[0] == 0


def test_dead_participant_newer_round_and_fault_report_each_create_pressure():
    s = closed_round()
    key = (s.generation, 1)
    assert restart_pressure(s, "a", frozenset({"c"}), LIMITS, key, False)[:1] == (1,)
    assert restart_pressure(s, "a", frozenset(), LIMITS, key, True)[2] is Reason.FAILURE
    s2, _ = run(s, view("b", completed=key))
    assert restart_pressure(s2, "a", frozenset(), LIMITS, key, False)[0] == 1
    assert restart_pressure(s, "a", frozenset(), LIMITS, key, False)[0] == 0


def test_a_state_read_before_our_round_closed_is_no_reason_to_restart():
    # Issue 14: a keeper check that read the open round just before it closed was taken
    # for a newer round replacing ours, and the agent restarted a round that had just begun.
    opened, _ = run(None, view("a"))
    opened, _ = run(opened, view("b"))
    assert opened.phase is Phase.OPEN
    ours = (opened.generation, opened.round)  # what the agent runs in once it closed
    assert restart_pressure(opened, "a", frozenset(), LIMITS, ours, False)[0] == 0
    older = replace(opened, round=opened.round - 1, phase=Phase.CLOSED)
    assert restart_pressure(older, "a", frozenset(), LIMITS, ours, False)[0] == 0
    newer = replace(opened, round=opened.round + 1)
    assert restart_pressure(newer, "a", frozenset(), LIMITS, ours, False)[0] == 1
    other_generation = replace(opened, generation="another")
    assert restart_pressure(other_generation, "a", frozenset(), LIMITS, ours, False)[0] == 1


def test_open_round_drops_members_that_died_while_it_was_open():
    s, _ = run(None, view("a"))
    s, _ = run(s, view("b"))
    s, _ = run(s, view("c", dead={"a"}))
    assert list(s.members) == ["b", "c"]


def test_a_stranger_finding_only_dead_nodes_starts_a_new_generation():
    s = closed_round(restarts=1)
    s2, d = run(s, view("z", dead={"a", "b", "c"}))
    assert s2.generation == "gen-z" and s2.round == s.round + 1 and s2.restarts == 0
    assert list(s2.members) == ["z"]


def test_a_survivor_keeps_the_generation_when_its_peers_die():
    s = closed_round()
    s2, _ = run(s, view("a", completed=(s.generation, 1), dead={"b", "c"}))
    assert s2.generation == s.generation and s2.phase is Phase.OPEN


def test_a_full_open_round_puts_extra_nodes_in_waiting():
    s = closed_round(("a", "b", "c"))
    s, _ = run(s, view("a", completed=(s.generation, 1)))
    for n in ("b", "c"):
        s, _ = run(s, view(n, completed=(s.generation, 1)))
    s = replace(s, phase=Phase.OPEN, order=(), members={k: s.members[k] for k in ("a", "b", "c")})
    s, d = run(s, view("d"))
    assert "d" in s.waiting and "d" not in s.members


def test_closed_and_budget_spent_runs_end_the_rendezvous():
    s = closed_round()
    assert isinstance(decide(replace(s, status=Status.CLOSED), view("a"), LIMITS), Closed)
    assert isinstance(decide(replace(s, status=Status.BUDGET_SPENT), view("a"), LIMITS),
                      BudgetSpent)


def test_state_round_trips_through_json():
    s = closed_round()
    assert RunState.from_bytes(s.to_bytes()) == s


@pytest.mark.parametrize("raw", [
    b"garbage", b"{}", b'{"v": 1}', b"\x80\x04\x95", b'{"v": 99, "generation": "g"}',
    b"[" * 100000,
], ids=["garbage", "empty", "partial", "pickle", "future-version", "deep-nesting"])
def test_anything_but_a_valid_state_is_corrupt_never_executed(raw):
    with pytest.raises(CorruptStateError):
        RunState.from_bytes(raw)


def test_oversized_state_is_refused():
    with pytest.raises(CorruptStateError, match="limit"):
        RunState.from_bytes(b" " * (2 << 20))


def test_a_lone_node_of_a_one_node_minimum_joins_the_round_it_closed():
    limits = Limits(min_nodes=1, max_nodes=2, last_call=1.0, max_restarts=None)
    s, d = run(None, view("a"), limits)
    s, d = run(s, view("a", min_reached_for=1.0), limits)
    assert s.phase is Phase.CLOSED and isinstance(d, Joined) and s.generation == "gen-a"


# -- a job that finished ------------------------------------------------------------------
def test_a_member_of_a_finished_job_is_told_so_and_a_new_job_starts_over():
    s = replace(closed_round(), status=Status.FINISHED, note="finished: ...")
    gen = s.generation
    assert isinstance(decide(s, view("c", completed=(gen, 1)), LIMITS), Finished)
    waiting = replace(s, waiting={"d": NodeInfo("127.0.0.1", 9)})
    assert isinstance(decide(waiting, view("d"), LIMITS), Finished)  # it never got to join
    d = decide(s, view("x"), LIMITS)  # a new job under the same run id
    assert isinstance(d, Write) and d.state.generation == "gen-x" and d.state.round == 2
    assert d.state.status is Status.ACTIVE and d.state.restarts == 0


# -- rounds that make no progress ------------------------------------------------------------
def reopened(s, limits, by="a", reason=Reason.MEMBERSHIP):
    """``s`` (closed) ended; every member rejoins at once, the round closes again."""
    gen, round_ = s.generation, s.round
    for n in s.order:
        s, _ = run(s, view(n, completed=(gen, round_), reason=reason), limits)
    return s


def test_free_restarts_without_a_training_step_are_charged_after_the_stall_count():
    limits = replace(LIMITS, stalled_rounds=2)
    s = replace(closed_round(), max_restarts=5)
    assert s.progress_round == 0 and stalled_rounds(s) == 0
    notes = []
    for _ in range(4):
        s = reopened(s, limits)
        assert s.phase is Phase.CLOSED, s
        notes.append((s.round, s.restarts, s.note))
    # rounds 1, 2 and 3 ended before a step: closing round 4 (3 stalled > 2) is charged
    assert [r for _, r, _ in notes] == [0, 0, 1, 2], notes
    assert "3 rounds in a row ended before a training step" in notes[2][2]
    # a round that trained resets the count
    s = reopened(replace(s, progress_round=s.round), limits)
    assert s.restarts == 2 and "membership changed" in s.note


def test_a_stall_that_spends_the_budget_says_so_and_names_unreachable_reports():
    limits = replace(LIMITS, stalled_rounds=1)
    s = replace(closed_round(), max_restarts=0, progress_round=1)  # round 1 trained
    gen = s.generation
    for round_ in (1, 2, 3):
        s, _ = run(s, view("a", completed=(gen, round_), reason=Reason.MEMBERSHIP,
                           unreachable=("b",)), limits)
        s, _ = run(s, view("b", completed=(gen, round_), unreachable=("a",)), limits)
        s, d = run(s, view("c", completed=(gen, round_)), limits)
        if round_ < 3:  # rounds 2 and 3 close free: 0, then 1 round in a row without a step
            assert s.status is Status.ACTIVE and s.restarts == 0, s.note
    # rounds 2 and 3 ended before a step: closing round 4 is the 2nd in a row, over 1
    assert s.status is Status.BUDGET_SPENT and isinstance(decide(s, view("a"), limits),
                                                          BudgetSpent)
    assert "2 rounds in a row ended before a training step (more than 1" in s.note
    assert "a could not reach b" in s.note and "b could not reach a" in s.note


# -- a node its peers cannot reach ------------------------------------------------------------
def test_a_node_most_others_cannot_reach_is_left_out_with_the_reason():
    s = closed_round()
    gen = s.generation
    s, _ = run(s, view("a", completed=(gen, 1), unreachable=("c",)))
    s, d = run(s, view("b", completed=(gen, 0), unreachable=("c",)))
    # c (its workers still hang) has not rejoined: it is left out, the round closes without it
    assert "c" in s.excluded and "not reachable from a, b" in s.excluded["c"]
    assert s.phase is Phase.CLOSED and s.order == ("a", "b") and isinstance(d, Joined)
    assert s.restarts == 0 and "membership changed" in s.note  # leaving it out is free
    assert isinstance(decide(s, view("c", completed=(gen, 1)), LIMITS), Excluded)


def test_reports_of_the_cut_off_node_and_of_two_nodes_alone_exclude_nobody():
    base = RunState(generation="g", round=2, phase=Phase.OPEN,
                    members={n: NodeInfo("h", 1) for n in "abc"}, previous=("a", "b", "c"))
    # c cannot reach anyone: its own reports do not count against a and b
    assert unreachable_by_most(replace(base, unreachable={"c": ("a", "b"), "a": ("c",),
                                                          "b": ("c",)})) == {"c": ["a", "b"]}
    # one report is not a majority of a's two peers
    assert unreachable_by_most(replace(base, unreachable={"c": ("a",)})) == {}
    two = replace(base, members={n: NodeInfo("h", 1) for n in "ab"}, previous=("a", "b"),
                  unreachable={"a": ("b",), "b": ("a",)})
    assert unreachable_by_most(two) == {}  # nobody can tell which side is cut off


def test_new_fields_round_trip_and_states_without_them_still_parse():
    s = replace(closed_round(), progress_round=1, unreachable={"a": ("b",)},
                excluded={"c": "not reachable from a, b"})
    assert RunState.from_bytes(s.to_bytes()) == s
    import json
    doc = json.loads(s.to_bytes())
    for key in ("progress_round", "unreachable", "excluded"):
        del doc[key]
    old = RunState.from_bytes(json.dumps(doc).encode())
    assert (old.progress_round, dict(old.unreachable), dict(old.excluded)) == (0, {}, {})


def test_a_dead_node_nobody_can_reach_is_not_left_out_it_may_come_back():
    s = closed_round()
    gen = s.generation
    s, _ = run(s, view("a", completed=(gen, 1), unreachable=("c",), dead=("c",)))
    s, d = run(s, view("b", completed=(gen, 0), unreachable=("c",), dead=("c",)))
    assert not s.excluded and s.phase is Phase.CLOSED and s.order == ("a", "b")


def test_a_round_opened_for_a_membership_change_passes_that_reason_on() -> None:
    # Issue 14: agents that learn of a new round from the state re-entered as after a
    # failure and probed every peer (O(N^2) connections at scale) for a plain death.
    opened, _ = run(None, view("a"))
    opened, _ = run(opened, view("b"))
    ours = (opened.generation, opened.round)
    for because, expected in ((Reason.MEMBERSHIP, Reason.MEMBERSHIP),
                              (Reason.FAILURE, Reason.FAILURE), (Reason.START, Reason.FAILURE)):
        newer = replace(opened, round=opened.round + 1, opened_because=because)
        count, _, reason = restart_pressure(newer, "a", frozenset(), LIMITS, ours, False)
        assert (count, reason) == (1, expected), because
    closed_newer = replace(opened, round=opened.round + 1, phase=Phase.CLOSED,
                           order=tuple(opened.members), opened_because=Reason.MEMBERSHIP)
    assert restart_pressure(closed_newer, "a", frozenset(), LIMITS, ours, False)[2] \
        is Reason.FAILURE  # a round we are not in ran without us: not ours to call free
