"""Where the other agents listen (``agent/presence_book.py``): a plain record, no sockets."""

from __future__ import annotations

from elastic_ext.rendezvous.agent.presence_book import PresenceBook
from elastic_ext.rendezvous.protocol.state import NodeInfo
from elastic_ext.rendezvous.stores.wire import heartbeat_value


def test_a_node_is_dialled_only_with_both_its_port_and_its_address() -> None:
    book = PresenceBook("me")
    book.learn({"a": 1001, "b": 1002}, {"a": "10.0.0.1", "c": "10.0.0.3"})
    assert book.targets(["a", "b", "c"]) == {"a": ("10.0.0.1", 1001)}
    assert book.targets(["a", "b"], {"b": "10.0.0.2"}) == {"b": ("10.0.0.2", 1002)}
    assert book.unknown(["a", "b", "c", "me"]) == ["c"]


def test_its_own_port_is_never_learnt_from_a_state_nor_dialled() -> None:
    book = PresenceBook("me")
    book.learn({"me": 1000, "a": 1001}, {"me": "10.0.0.9", "a": "10.0.0.1"})
    assert book.targets(["me", "a"]) == {"a": ("10.0.0.1", 1001)}
    book.learn_beats({"me": heartbeat_value(1, 1000)})
    assert book.targets(["me", "a"], others_only=True) == {"a": ("10.0.0.1", 1001)}
    assert "me" in book.targets(["me"])  # a heartbeat named it: only others_only leaves it out


def test_a_heartbeats_port_wins_over_the_one_a_state_names() -> None:
    book = PresenceBook("me")
    book.learn_beats({"a": heartbeat_value(3, 2001), "b": b"1:2.0", "c": None})
    book.learn_infos({"a": NodeInfo("10.0.0.1", 1, 1001), "b": NodeInfo("10.0.0.2", 2, 1002),
                      "c": NodeInfo("10.0.0.3", 3)})
    assert book.targets(["a", "b", "c"]) == {"a": ("10.0.0.1", 2001), "b": ("10.0.0.2", 1002)}
    assert book.unknown(["a", "b", "c"]) == ["c"]
