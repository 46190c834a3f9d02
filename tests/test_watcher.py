"""The keeper's watcher decider (``protocol/watcher.py``): who is dead or left, which deaths
are reported, and when a verdict is published. Pure: a fake clock and fake presence probes,
no store, no thread."""

from __future__ import annotations

from collections.abc import Iterable

from elastic_ext.rendezvous.protocol.head import Head
from elastic_ext.rendezvous.protocol.liveness import LEFT, Liveness, Verdict
from elastic_ext.rendezvous.protocol.state import NodeInfo, Phase, RunState
from elastic_ext.rendezvous.protocol.watcher import (
    WATCHER_PATIENCE,
    Judgement,
    Sighting,
    Watcher,
    held_nodes,
)

TIMEOUT_S = 3.0


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Connections:
    """The presence connections as the decider sees them: whom it asked, who is gone."""

    def __init__(self, gone: Iterable[str] = ()) -> None:
        self.gone = frozenset(gone)
        self.asked: list[list[str]] = []

    def __call__(self, nodes: Iterable[str]) -> frozenset[str]:
        asked = sorted(nodes)
        self.asked.append(asked)
        return self.gone & set(asked)


def closed(me: str = "me", *others: str) -> RunState:
    nodes = (me, *others)
    return RunState(generation="g", round=1, phase=Phase.CLOSED,
                    members={n: NodeInfo("127.0.0.1", 1000 + i) for i, n in enumerate(nodes)},
                    order=nodes)


def judging(state: RunState, beats: dict[str, bytes | None]) -> Sighting:
    """A tick of the keeper that watches everyone (``me``, rank 0 of ``state``)."""
    return Sighting(Head.of(state), "me", True, frozenset(state.known_nodes()) - {"me"},
                    beats, None, state)


def following(watcher: str, beats: dict[str, bytes | None], verdict: Verdict | None,
              generation: str = "g") -> Sighting:
    """A tick of a keeper that judges only ``watcher`` and reads its verdict."""
    head = Head.of(RunState(generation=generation, round=1, phase=Phase.CLOSED,
                            members={watcher: NodeInfo("127.0.0.1", 1000),
                                     "me": NodeInfo("127.0.0.1", 1001)},
                            order=(watcher, "me")))
    return Sighting(head, watcher, False, frozenset(), beats, verdict, None)


def reported(judgement: Judgement) -> list[tuple[str, bool]]:
    return [(death.node, death.left) for death in judgement.to_report]


def make() -> tuple[Watcher, Clock]:
    clock = Clock()
    return Watcher("me", Liveness(TIMEOUT_S, clock)), clock


def test_a_still_heartbeat_is_dead_after_the_timeout_and_reported_once() -> None:
    watcher, clock = make()
    state = closed("me", "a", "b")
    reports: list[list[tuple[str, bool]]] = []
    for step in range(8):
        beats: dict[str, bytes | None] = {"a": f"{step}".encode(), "b": b"1"}
        judgement = watcher.judge(judging(state, beats), Connections())
        reports.append(reported(judgement))
        clock.now += 1.0
    assert judgement.dead == {"b"} and judgement.left == frozenset()
    assert judgement.to_report == () and watcher.dead == {"b"}
    assert [r for r in reports if r] == [[("b", False)]]
    assert not watcher.judge(judging(state, {"a": b"9", "b": b"2"}), Connections()).dead
    for _ in range(int(TIMEOUT_S)):
        clock.now += 1.0
        again = watcher.judge(judging(state, {"a": b"9", "b": b"2"}), Connections())
    assert [d.message for d in again.to_report] == [
        "node a declared dead (no heartbeat change)", "node b declared dead (no heartbeat change)"]
    assert watcher.dead == {"a", "b"}


def test_a_death_is_reported_again_after_the_node_beat_in_between() -> None:
    watcher, clock = make()
    state = closed("me", "a")
    for _ in range(4):
        judgement = watcher.judge(judging(state, {"a": b"1"}), Connections())
        clock.now += 1.0
    assert reported(judgement) == [("a", False)]
    assert not watcher.judge(judging(state, {"a": b"2"}), Connections()).dead
    for _ in range(4):
        clock.now += 1.0
        judgement = watcher.judge(judging(state, {"a": b"2"}), Connections())
        if judgement.dead:
            break
    assert reported(judgement) == [("a", False)]


def test_a_node_that_wrote_left_is_dead_and_left_at_once() -> None:
    watcher, _ = make()
    judgement = watcher.judge(judging(closed("me", "a"), {"a": LEFT}), Connections())
    assert judgement.dead == {"a"} and judgement.left == {"a"}
    assert reported(judgement) == [("a", True)]
    assert judgement.to_report[0].message == "node a left"


def test_an_ended_presence_connection_is_dead_without_waiting_for_the_timeout() -> None:
    watcher, _ = make()
    judgement = watcher.judge(judging(closed("me", "a", "b"), {"a": b"1", "b": b"1"}),
                              Connections(gone={"b"}))
    assert judgement.dead == {"b"} and judgement.left == frozenset()


def test_only_the_watcher_holds_connections_to_everyone() -> None:
    assert sorted(held_nodes("me", "me", {"a": b"", "b": b""})) == ["a", "b"]
    assert sorted(held_nodes("me", None, {"a": b"", "b": b""})) == ["a", "b"]
    assert list(held_nodes("me", "w", {"w": b"", "a": b""})) == ["w"]
    watcher, _ = make()
    probes = Connections()
    watcher.judge(following("w", {"w": b"1"}, None), probes)
    assert probes.asked == [["w"]]


def test_a_follower_goes_by_the_watchers_verdict_of_its_generation_only() -> None:
    watcher, _ = make()
    verdict = Verdict("w", "g", frozenset({"x", "y"}), frozenset({"y"}))
    judgement = watcher.judge(following("w", {"w": b"1"}, verdict), Connections())
    assert judgement.dead == {"x", "y"} and judgement.left == {"y"}
    assert reported(judgement) == [("x", False), ("y", True)]
    assert [d.message for d in judgement.to_report] == [
        "node x declared dead (no heartbeat change, judged by w)", "node y left"]
    for stale in (Verdict("other", "g", frozenset({"x"})), Verdict("w", "old", frozenset({"x"}))):
        fresh, _ = make()
        assert not fresh.judge(following("w", {"w": b"1"}, stale), Connections()).dead


def test_a_new_watcher_keeps_the_last_verdicts_dead_until_they_beat() -> None:
    watcher, _ = make()
    verdict = Verdict("w", "g", frozenset({"x"}), frozenset({"x"}))
    watcher.judge(following("w", {"w": b"1"}, verdict), Connections())
    state = closed("me", "x")
    judgement = watcher.judge(judging(state, {"x": b"1"}), Connections())
    assert judgement.dead == {"x"} and judgement.left == {"x"}
    judgement = watcher.judge(judging(state, {"x": b"2"}), Connections())
    assert judgement.dead == frozenset()


def test_only_the_watcher_judging_everyone_publishes_and_only_a_change() -> None:
    watcher, _ = make()
    state = closed("me", "a")
    first = watcher.judge(judging(state, {"a": LEFT}), Connections()).publish
    assert first == Verdict("me", "g", frozenset({"a"}), frozenset({"a"}), 1, frozenset({"a"}))
    assert watcher.judge(judging(state, {"a": LEFT}), Connections()).publish == first  # unwritten
    watcher.published(first)
    assert watcher.judge(judging(state, {"a": LEFT}), Connections()).publish is None
    not_closer, _ = make()
    assert not_closer.judge(judging(closed("a", "me"), {"a": b"1"}), Connections()).publish is None
    assert not_closer.judge(following("w", {"w": b"1"}, None), Connections()).publish is None


def test_whom_a_judging_keeper_judges_is_the_states_nodes_and_the_joiners_never_itself() -> None:
    watcher, _ = make()
    state = closed("me", "a")
    assert watcher.nodes(state, {"j"}) == {"a", "j"}
    assert watcher.nodes(None, {"j", "me"}) == {"j"}


def many_still(watcher: Watcher, clock: Clock, others: list[str], still: set[str],
               answering: Connections, left: Iterable[str] = ()) -> Judgement:
    """Ticks over ``2 * TIMEOUT_S`` in which ``still`` stop beating (``left`` leave) and
    the others beat; the last tick's judgement."""
    state = closed("me", *others)
    judgement = None
    for step in range(int(2 * TIMEOUT_S) + 1):
        beats: dict[str, bytes | None] = {
            n: b"0" if n in still else LEFT if n in left and step else f"{step}".encode()
            for n in others}
        judgement = watcher.judge(judging(state, beats), Connections(), answering)
        clock.now += 1.0
    assert judgement is not None
    return judgement


def test_many_nodes_still_at_once_whose_machines_answer_are_spared_as_the_judges_doubt(
        ) -> None:
    """Issue 43: six of ten still at once, their presence connections open (their machines
    are up): the likelier cause is a starved judge or store. Nobody is dead, and the doubt
    says by how much; a node that left is dead all the same."""
    watcher, clock = make()
    others = [f"n{i}" for i in range(10)]
    still = set(others[:6])
    judgement = many_still(watcher, clock, others, still, Connections(gone=still),
                           left=["n9"])
    assert judgement.dead == {"n9"} and judgement.left == {"n9"}
    assert judgement.doubt is not None
    assert (judgement.doubt.stale, judgement.doubt.watched, judgement.doubt.spared) == (6, 10, 6)


def test_many_nodes_still_at_once_whose_machines_do_not_answer_are_dead_on_time() -> None:
    """A real mass failure (machines off the network: no connection held) is found as
    before, and so is each still node whose connection is not open among spared ones."""
    watcher, clock = make()
    others = [f"n{i}" for i in range(10)]
    still = set(others[:6])
    assert many_still(watcher, clock, others, still, Connections()).dead == still
    watcher, clock = make()
    judgement = many_still(watcher, clock, others, still, Connections(gone={"n0", "n1", "n2",
                                                                          "n3", "n4"}))
    assert judgement.dead == {"n5"}
    assert judgement.doubt is not None and judgement.doubt.spared == 5


def test_half_still_or_a_small_job_is_judged_on_the_counters_alone() -> None:
    """Five of ten (not more than half), or three of four (fewer than eight watched): as
    likely dead as not; judged on time although their machines answer."""
    for others, still in (([f"n{i}" for i in range(10)], {f"n{i}" for i in range(5)}),
                          (["a", "b", "c", "d"], {"a", "b", "c"})):
        watcher, clock = make()
        judgement = many_still(watcher, clock, others, still, Connections(gone=still))
        assert judgement.dead == still and judgement.doubt is None, others


def test_a_follower_spares_a_still_watcher_whose_machine_answers_for_two_timeouts() -> None:
    """Issue 43: at 1,024 agents one follower whose clock saw the starved watcher's beat
    3 s late ended the round for everyone. A still watcher whose machine answers a fresh
    dial is spared until it has been still ``WATCHER_PATIENCE`` timeouts; one that does
    not answer, one whose presence connection ended, or one that left, is dead on time."""
    for answering, gone, beat, dead_after in (
            (Connections(gone={"w"}), Connections(), b"1", WATCHER_PATIENCE * TIMEOUT_S),
            (Connections(), Connections(), b"1", TIMEOUT_S),
            (Connections(gone={"w"}), Connections(gone={"w"}), b"1", 0.0),
            (Connections(gone={"w"}), Connections(), LEFT, 0.0)):
        watcher, clock = make()
        watcher.judge(following("w", {"w": b"1"}, None), Connections(), answering)
        judged_at, doubts = None, set()
        for _ in range(14):
            clock.now += 0.5
            judgement = watcher.judge(following("w", {"w": beat}, None), gone, answering)
            doubts.add(judgement.doubt.watcher if judgement.doubt else None)
            if judgement.dead:
                judged_at = clock.now - 100.0
                break
        assert judged_at is not None and judged_at == max(0.5, dead_after), \
            (answering.gone, gone.gone, beat, judged_at)
        assert ("w" in doubts) == (dead_after > TIMEOUT_S)  # the keeper logs the spell
