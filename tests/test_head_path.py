"""A round change followed on the state's head and the node's seat (``head_path.py``),
in-process on the in-memory store (which keeps heads and seats as etcd does): a node
that neither closes nor watches the round reads no whole state, and what it decides is
what ``policy.decide`` decides on the state. The bytes on a real etcd are in
``test_backend_contract.py``; the rounds with real agents in the end-to-end tests.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError

from elastic_ext.control_channel import CONTROL_DIR_ENV
from elastic_ext.rendezvous.protocol.head import seats_of
from elastic_ext.rendezvous.protocol.joins import JoinEntry
from elastic_ext.rendezvous.protocol.state import NodeInfo, Phase, Reason, RunState
from elastic_ext.rendezvous.stores.wire import SEAT_DIR
from elastic_ext.worker.control import report_peer_failure, report_progress
from tests.support.handler_lab import ME, Lab, closed_round
from tests.support.memory_backend import MemoryBackend

ENTRY = JoinEntry(NodeInfo("127.0.0.1", 29400)).to_bytes()


def count_whole_state_reads(lab: Lab, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every read of the whole state by the agent under test (not by the simulated peers)."""
    reads: list[str] = []
    for name in ("get_state", "state_after"):
        original = getattr(MemoryBackend, name)

        def counted(self: MemoryBackend, *args: object, _original: Callable[..., object] = original,
                    _name: str = name) -> object:
            if self is not lab.peer:
                reads.append(_name)
            return _original(self, *args)
        monkeypatch.setattr(MemoryBackend, name, counted)
    return reads


def in_round_one(lab: Lab, monkeypatch: pytest.MonkeyPatch, nodes: tuple[str, ...]) -> None:
    """``me`` joins the closed round 1 of ``nodes`` (the first one its rank 0, the watcher)
    and its workers train."""
    for node in nodes:
        if node != ME:
            lab.peer.beat(node)
    lab.put_state(closed_round(nodes))
    info = lab.handler.next_rendezvous()
    assert (info.rank, info.world_size) == (nodes.index(ME), len(nodes))
    monkeypatch.setenv(CONTROL_DIR_ENV, str(lab.control.path))
    report_progress()
    lab.advance(0.5, beating=nodes)


def play(lab: Lab, *steps: Callable[[], bool]) -> None:
    """The simulated peers: at each sleep of the agent, the first step left runs, and is
    done once it returns True."""
    left = list(steps)

    def on_sleep() -> None:
        lab.peer.beat("peer")
        if left and left[0]():
            left.pop(0)
    lab.clock.on_sleep.append(on_sleep)


def joined(lab: Lab, round_: int) -> bool:
    return ME in [n for n, _ in lab.peer.read_joins("gen0", round_)]


def test_a_node_joins_a_round_another_opened_and_takes_its_seat_reading_no_state(
        make_lab, monkeypatch: pytest.MonkeyPatch) -> None:
    lab = make_lab(nnodes=(1, 3))
    in_round_one(lab, monkeypatch, ("peer", ME, "other"))
    reads = count_whole_state_reads(lab, monkeypatch)
    first = lab.state()
    lab.put_state(dataclasses.replace(  # "peer" opens round 2 without "other"
        first, round=2, phase=Phase.OPEN, order=(), previous=first.order,
        members={"peer": first.members["peer"]}, opened_because=Reason.MEMBERSHIP))
    lab.advance(0.5, beating=("peer",))
    assert "replaced round 1" in lab.keeper.pressure.why

    def close() -> bool:
        if not joined(lab, 2):
            return False
        lab.put_state(dataclasses.replace(closed_round(("peer", ME), round_=2)))
        return True
    play(lab, close)
    info = lab.handler.next_rendezvous()
    assert (info.rank, info.world_size) == (1, 2)
    assert reads == []  # the keeper's tick and the rendezvous: head and seat only
    assert lab.events("joined")[-1]["round"] == 2


def test_nodes_whose_round_ended_join_the_next_by_key_and_only_the_first_opens_it(
        make_lab, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each node back from a round read the closed state and raced to open the next round:
    N compare-and-swaps of the whole state, the losers reading it back (issue 27). Now they
    join the next round by key, and the first to join opens it."""
    lab = make_lab(nnodes=(1, 3))
    in_round_one(lab, monkeypatch, ("peer", ME, "other"))
    lab.publish_verdict("peer", {"other"})  # the watcher finds "other" dead
    lab.advance(0.5, beating=("peer",))
    assert "dead or hung: other" in lab.keeper.pressure.why
    reads = count_whole_state_reads(lab, monkeypatch)
    lab.peer.join("gen0", 2, "peer", ENTRY)  # "peer" came back first: it opens round 2
    state = lab.state()

    def peer_opens() -> bool:
        if not joined(lab, 2):
            return False
        lab.put_state(dataclasses.replace(
            state, round=2, phase=Phase.OPEN, order=(), previous=state.order,
            members={"peer": state.members["peer"]}, opened_because=Reason.MEMBERSHIP))
        return True

    def peer_closes() -> bool:
        lab.put_state(closed_round(("peer", ME), round_=2))
        return True
    play(lab, peer_opens, peer_closes)
    info = lab.handler.next_rendezvous()
    assert (info.rank, info.world_size) == (1, 2) and reads == []
    assert lab.state().note != "round 2 opened by me (membership)"


def test_the_first_node_back_from_a_round_opens_the_next_one(
        make_lab, monkeypatch: pytest.MonkeyPatch) -> None:
    lab = make_lab(nnodes=(1, 3))
    in_round_one(lab, monkeypatch, ("peer", ME, "other"))
    lab.publish_verdict("peer", {"other"})
    lab.advance(0.5, beating=("peer",))
    opened: list[RunState] = []

    def peer_joins_and_me_closes() -> bool:
        state = lab.state()
        if state.round == 2 and state.phase is Phase.OPEN:
            opened.append(state)
            lab.peer.join("gen0", 2, "peer", ENTRY)
            return True
        return False
    play(lab, peer_joins_and_me_closes)
    info = lab.handler.next_rendezvous()  # me is the closer: the round closes with both
    assert opened and next(iter(opened[0].members)) == ME  # me opened it, as its closer
    assert opened[0].opened_because is Reason.MEMBERSHIP
    assert (info.rank, info.world_size) == (1, 2)  # the ranks of round 1 are kept
    assert lab.state().order == ("peer", ME) and lab.state().round == 2


def test_a_seat_of_a_close_that_lost_is_not_taken(make_lab) -> None:
    """The closer of round 1 wrote seats for ("peer", me, "other"), then lost its closing
    write; the round closed without this node. The seat left behind carries another seal:
    this node decides on the whole state instead, and waits to join."""
    lab = make_lab(nnodes=(1, 3), join_timeout="5")
    lost = closed_round(("peer", ME, "other"))
    for name, seat in seats_of(lost).items():
        lab.store.plant(f"/elastic-ext/run1/{SEAT_DIR}gen0/1/{name}", seat.to_bytes())
    lab.put_state(closed_round(("peer", "other")))
    lab.clock.on_sleep.append(lambda: [lab.peer.beat(n) for n in ("peer", "other")])
    with pytest.raises(RendezvousTimeoutError, match="no round admitted"):
        lab.handler.next_rendezvous()
    assert set(lab.state().waiting) == {ME} and not lab.events("joined")


def test_after_a_failed_round_a_seated_node_probes_the_rounds_nodes_found_in_its_seats(
        make_lab, monkeypatch: pytest.MonkeyPatch) -> None:
    """A node that took its seat never read who else was in the round; after a round that
    failed it probes them all (``probes.py``), so it reads them, and where they are, from
    the round's seats (the state may already be the next round's, naming no addresses)."""
    lab = make_lab(nnodes=(1, 3))
    nodes = ("peer", ME, "other")
    for node in nodes:
        lab.peer.beat(node)
    first = closed_round(nodes)
    first = dataclasses.replace(first, members={
        n: NodeInfo(f"10.9.0.{i}", 30000 + i, 40000 + i) for i, n in enumerate(nodes)})
    lab.put_state(first)
    lab.handler.next_rendezvous()
    asked: list[dict[str, str]] = []

    def unreachable_among(peers: set[str], addrs: dict[str, str]) -> frozenset[str]:
        asked.append({n: addrs[n] for n in peers})
        return frozenset()
    monkeypatch.setattr(lab.keeper, "unreachable_among", unreachable_among)
    monkeypatch.setenv(CONTROL_DIR_ENV, str(lab.control.path))
    assert report_peer_failure("rank 1: RuntimeError: Connection reset by peer")
    lab.advance(0.5, beating=("peer", "other"))
    lab.clock.on_sleep.append(lambda: [lab.peer.beat(n) for n in ("peer", "other")])
    lab.handler.next_rendezvous()  # nobody else comes back: round 2 closes at the last call
    assert asked[0] == {"peer": "10.9.0.0", "other": "10.9.0.2"}
