"""The closer of an open round on a real etcd (issue 27: no polling where a watch exists).

It waited for joins by asking etcd for the join count and the state's revision every
50 ms (40 requests a second, for as long as its round stayed open); now a watch of the
round's join keys wakes it at each join and answers its reads of them, and the state comes
from the watch the agent already holds, read anew once a second.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from elastic_ext.agent.control import AgentControl
from elastic_ext.local.etcd import received_requests
from elastic_ext.local.processes import wait_until
from elastic_ext.rendezvous.agent.handler import EtcdExtRendezvousHandler
from elastic_ext.rendezvous.agent.lifecycle import read_state
from elastic_ext.rendezvous.protocol.joins import JoinEntry
from elastic_ext.rendezvous.protocol.state import NodeInfo, Phase
from elastic_ext.rendezvous.stores.etcd.backend import EtcdBackend
from tests.support.stores import settings_for

pytestmark = [pytest.mark.etcd, pytest.mark.timeout(120)]

WINDOW_S = 3.0
ASKING = ("Range", "Txn", "Put", "DeleteRange")


def asked(counts) -> int:
    return sum(counts[method] for method in ASKING)


def test_the_closer_of_an_open_round_waits_on_a_watch_and_closes_at_the_join(
        etcd, tmp_path: Path) -> None:
    endpoint, url = etcd.members[0].endpoint, etcd.members[0].client_url
    settings = settings_for(endpoint, "run1", (2, 2), join_timeout="60")
    handler = EtcdExtRendezvousHandler(
        settings, EtcdBackend(settings), backend_name="etcd-ext", node_id="closer",
        control=AgentControl(tmp_path / "c"), keeper_thread=False)
    peer = EtcdBackend(settings)
    got: list[object] = []
    closer = threading.Thread(target=lambda: got.append(handler.next_rendezvous()),
                              daemon=True)
    try:
        closer.start()

        def open_round() -> bool:
            state, _ = read_state(peer)
            return state is not None and state.phase is Phase.OPEN
        wait_until(open_round, 20, 0.05, "the closer's open round")
        state, _ = read_state(peer)
        assert state is not None and list(state.members) == ["closer"]
        # its watch of the round's joins in place (the state's, and the joins')
        wait_until(lambda: received_requests(url)["Watch"] >= 2, 10, 0.05,
                   "the closer's two watches at etcd")
        before = received_requests(url)
        # A measurement window, not a wait for something: polling, the closer would ask
        # etcd about 120 times in it.
        assert not threading.Event().wait(WINDOW_S)
        during = asked(received_requests(url)) - asked(before)
        assert during <= WINDOW_S * 2, (during, received_requests(url) - before)
        assert not got and closer.is_alive()

        peer.join(state.generation, state.round, "peer",
                  JoinEntry(NodeInfo("127.0.0.1", 29555)).to_bytes())
        closer.join(timeout=20)
        assert not closer.is_alive(), "the closer did not close the round at the join"
        info = got[0]
        assert (info.rank, info.world_size) == (0, 2)  # type: ignore[attr-defined]
        closed, _ = read_state(peer)
        assert closed is not None and closed.phase is Phase.CLOSED
        assert closed.order == ("closer", "peer")
    finally:
        handler.keeper.stop()
        peer.close()
