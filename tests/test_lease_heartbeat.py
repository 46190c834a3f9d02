"""``heartbeat_mode=lease`` on a real etcd (issue 27): the lease is the heartbeat.

A frozen agent's key is gone within ``heartbeat_timeout`` (its lease expired) and comes
back when it thaws; an etcd leader change expires nobody (the new leader extends every
lease). The agents are processes that only beat (``tests/support/beating_node.py``); the
watcher reads as a keeper does (``keeper_read``), from its watch of the key.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from elastic_ext.local.etcd import received_requests
from elastic_ext.local.processes import ProcessSet, wait_until
from elastic_ext.rendezvous.protocol.pace import Pace
from elastic_ext.rendezvous.stores.etcd import lease as lease_module
from elastic_ext.rendezvous.stores.etcd.backend import EtcdBackend
from elastic_ext.rendezvous.stores.etcd.client import EtcdClient
from elastic_ext.rendezvous.stores.wire import pace_of, presence_port_of
from tests.support.stores import settings_for
from tests.support.trainer_runs import env

pytestmark = [pytest.mark.etcd, pytest.mark.timeout(120)]

BEATING_NODE = Path(__file__).parent / "support" / "beating_node.py"
REPO = Path(__file__).parent.parent
TIMEOUT_S = 3.0  # the default heartbeat_timeout: a lease TTL of 2 s


def watched(watcher: EtcdBackend, node: str) -> bytes | None:
    return watcher.keeper_read("watcher", None, [node]).beats[node]


def test_a_frozen_agents_lease_expires_within_the_heartbeat_timeout_and_it_comes_back(
        processes: ProcessSet, etcd) -> None:
    endpoint = etcd.members[0].endpoint
    node = processes.spawn("n1", [sys.executable, str(BEATING_NODE), "n1", endpoint, "run1",
                                  "lease"], env=env(), cwd=REPO)
    watcher = EtcdBackend(settings_for(endpoint, heartbeat_mode="lease"))
    try:
        first = wait_until(lambda: watched(watcher, "n1"), 30, what="n1's leased heartbeat")
        time.sleep(2.5)  # longer than the TTL: the lease is renewed, not just granted
        assert watched(watcher, "n1") == first  # present, and its value never moved
        os.killpg(node.popen.pid, signal.SIGSTOP)
        frozen_at = time.monotonic()
        wait_until(lambda: watched(watcher, "n1") is None, 10, 0.02, "n1's key gone")
        found = time.monotonic() - frozen_at
        assert found <= TIMEOUT_S, f"a frozen node's key went after {found:.2f}s"
        os.killpg(node.popen.pid, signal.SIGCONT)
        back = wait_until(lambda: watched(watcher, "n1"), 10, what="n1 back")
        assert back != first  # announced anew on a new lease
    finally:
        with_continue(node.popen.pid)
        watcher.close()


def with_continue(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


@pytest.mark.timeout(180)
def test_an_etcd_leader_change_expires_no_lease(etcd_cluster, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="elastic_ext.rendezvous.stores.etcd.lease")
    settings = settings_for(etcd_cluster.endpoints, heartbeat_mode="lease", connect_timeout="15")
    agent = EtcdBackend(settings)
    agent.beat("n1", 4242)
    client = EtcdClient(settings)
    key = settings.run_prefix + "hb/n1"
    before = client.get(key)
    assert before is not None
    etcd_cluster.stop_member(etcd_cluster.leader())
    # the new leader is in office within a few election timeouts; give the lease three TTLs
    # of keep-alives through it (each renews from the leader's own clock)
    time.sleep(6.0)
    after = client.get(key)
    assert after is not None and after.create_revision == before.create_revision, \
        "the heartbeat key was deleted and put again: the lease expired"
    assert "lease expired" not in caplog.text
    agent.close()


def test_an_idle_leased_keeper_asks_etcd_for_nothing_but_keep_alives(etcd) -> None:
    """Issue 27's load target (1.2 requests per agent per second idle; written heartbeats
    cost 2): a keeper's tick reads from watches, and only the lease's own thread asks."""
    endpoint = etcd.members[0].endpoint
    other = EtcdBackend(settings_for(endpoint, heartbeat_mode="lease"))
    agent = EtcdBackend(settings_for(endpoint, heartbeat_mode="lease"))
    try:
        other.beat("n1", 4242)
        agent.beat("me", 4343)
        metrics = etcd.members[0].client_url
        agent.keeper_read("me", 4343, ["n1"])  # opens its watches, on their own threads:
        # the first read returns once the keys are read, before etcd has both watches
        wait_until(lambda: received_requests(metrics)["Watch"] >= 3, 10, 0.05,
                   "the agent's three watches (the head's, the verdict's, the heartbeat's)")
        before, began = received_requests(metrics), time.monotonic()
        for _ in range(10):  # five seconds of keeper ticks
            assert agent.keeper_read("me", 4343, ["n1"]).beats["n1"] is not None
            time.sleep(0.5)
        used, elapsed = received_requests(metrics) - before, time.monotonic() - began
        assert set(used) <= {"LeaseKeepAlive"}, used
        per_agent = used["LeaseKeepAlive"] / 2 / elapsed  # two agents renew their leases
        assert per_agent <= 1.0 / (2 / 3) + 0.1, used  # one per third of a 2 s TTL
    finally:
        agent.close()
        other.close()


@pytest.mark.etcd
def test_an_idle_keeper_with_written_heartbeats_asks_etcd_one_transaction_a_beat(etcd) -> None:
    """Issue 27's load target, 1.2 requests per agent per second idle: a written heartbeat
    was a transaction every 0.5 s that also read the state's version and the verdict, and a
    lease tidying the key renewed every 4 s (2.25 a second). The version and the verdict
    now come by watches, an etcd agent beats once a second, and the lease lives 30 s; a
    verdict written elsewhere still reaches the keeper at once (it wakes on it)."""
    endpoint = etcd.members[0].endpoint
    agent, other = EtcdBackend(settings_for(endpoint)), EtcdBackend(settings_for(endpoint))
    interval = settings_for(endpoint).timeouts.heartbeat_interval
    woken: list[float] = []
    try:
        assert interval == 1.0
        other.beat("n1", 4242)
        metrics = etcd.members[0].client_url
        agent.on_state_change(lambda: woken.append(time.monotonic()))
        agent.keeper_read("me", 4343, ["n1"])
        wait_until(lambda: received_requests(metrics)["Watch"] >= 2, 10, 0.05,
                   "the agent's two watches (the head's, the verdict's) at etcd")
        before, began = received_requests(metrics), time.monotonic()
        for _ in range(5):  # five seconds of keeper ticks
            assert agent.keeper_read("me", 4343, ["n1"]).beats["n1"] is not None
            time.sleep(interval)
        used, elapsed = received_requests(metrics) - before, time.monotonic() - began
        assert set(used) <= {"Txn", "LeaseKeepAlive"} and used["Txn"] == 5, used
        assert used["Txn"] / elapsed <= 1.0, used  # one beat a second, nothing else
        # the tidying leases (30 s) renew every 10 s: at most once each in these seconds
        assert used["LeaseKeepAlive"] <= 2, used
        before = received_requests(metrics)
        for _ in range(3):  # ticks woken by state writes and verdicts: no request
            assert agent.keeper_read("me", 4343, ["n1"], due=False).beats["n1"] is not None
        assert not received_requests(metrics) - before
        woken.clear()
        written = time.monotonic()
        other.write_verdict(b"v")
        wait_until(lambda: bool(woken), 5, 0.01, "the keeper woken by the verdict")
        assert woken[0] - written < 1.0 and agent.keeper_read("me", 4343, []).verdict == b"v"
    finally:
        agent.close()
        other.close()


def test_a_leased_heartbeat_is_put_anew_only_when_its_pace_moved(
        etcd, monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``heartbeat_mode=lease`` the value is not rewritten at every tick: the pace
    (``protocol/pace.py``) goes out when it moved by more than 15 %, at most one put per
    ``PACE_PUT_S``, or every watcher would read every node's every tick."""
    settings = settings_for(etcd.members[0].endpoint, heartbeat_mode="lease")
    agent, client = EtcdBackend(settings), EtcdClient(settings)
    key = settings.run_prefix + "hb/me"
    monkeypatch.setattr(lease_module, "PACE_PUT_S", 0.0)
    try:
        agent.keeper_read("me", 4343, [], pace=Pace(0.08, 0.05))  # granted, put with it
        first = client.get(key)
        assert first is not None and pace_of(first.value) == Pace(0.08, 0.05)
        agent.keeper_read("me", 4343, [], pace=Pace(0.085, 0.052))  # within 15 %: no put
        same = client.get(key)
        assert same is not None and same.mod_revision == first.mod_revision
        agent.keeper_read("me", 4343, [], pace=Pace(0.08, 0.15))  # a straggler now
        moved = client.get(key)
        assert moved is not None and pace_of(moved.value) == Pace(0.08, 0.15)
        assert presence_port_of(moved.value) == 4343
        monkeypatch.setattr(lease_module, "PACE_PUT_S", 60.0)
        agent.keeper_read("me", 4343, [], pace=Pace(0.08, 0.5))  # moved, but too soon
        later = client.get(key)
        assert later is not None and later.mod_revision == moved.mod_revision
    finally:
        agent.close()
