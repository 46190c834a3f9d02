"""Real torchrun agents rendezvous on etcd-ext and run an allreduce to completion.

On etcd that is the run with the etcd leader killed meanwhile: its three agents reach the
same allreduce, so a plain run of three on etcd would repeat it. On the embedded store,
three agents that rendezvous with distinct ranks (0, 1 and 2) and train together are
``tests/test_failures.py``'s store-host test, so the plain run of three agents there that
this module had (15 s) is gone."""

from __future__ import annotations

import re
import time

import pytest

from elastic_ext.local.processes import wait_until
from elastic_ext.net import free_port
from tests.support.agents import ALLREDUCE_JOB, torchrun

pytestmark = pytest.mark.slow


def allreduce_results(procs):
    found = []
    for p in procs:
        found += re.findall(r"ALLREDUCE rank=(\d+) world=(\d+) sum=([\d.]+) expected=([\d.]+)",
                            p.output())
    return found


@pytest.mark.timeout(240)
def test_rendezvous_completes_when_the_etcd_leader_is_killed_meanwhile(processes, etcd_cluster):
    first = [torchrun(processes, f"agent{i}", endpoint=etcd_cluster.endpoints, run_id="lead",
                      nnodes="3:3", script=[str(ALLREDUCE_JOB)]) for i in range(2)]
    # both are inside the rendezvous once their heartbeats exist
    from elastic_ext.rendezvous.stores.etcd.client import EtcdClient
    from tests.support.stores import settings_for
    client = EtcdClient(settings_for(etcd_cluster.endpoints))
    wait_until(lambda: len(client.get_prefix("/elastic-ext/lead/hb/")) == 2, 60, 0.1,
               "two agents heartbeating")
    etcd_cluster.stop_member(etcd_cluster.leader())
    third = torchrun(processes, "agent2", endpoint=etcd_cluster.endpoints, run_id="lead",
                     nnodes="3:3", script=[str(ALLREDUCE_JOB)])
    procs = first + [third]
    for p in procs:
        assert p.wait(timeout=150) == 0, p.output()[-4000:]
    results = allreduce_results(procs)
    assert sorted(int(r[0]) for r in results) == [0, 1, 2]
    assert all(int(w) == 3 and s == e for _, w, s, e in results)


@pytest.mark.timeout(60)
def test_unreachable_endpoint_fails_within_the_join_timeout_naming_it(processes):
    endpoint = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    p = torchrun(processes, "agent", endpoint=endpoint, run_id="x", nnodes="1:1",
                 script=[str(ALLREDUCE_JOB)], conf="join_timeout=20,connect_timeout=3")
    assert p.wait(timeout=40) != 0
    assert time.monotonic() - started < 20
    assert f"no etcd answered at http://{endpoint}" in p.output()


@pytest.mark.timeout(60)
def test_unknown_conf_key_is_named_with_the_accepted_keys(processes, etcd):
    p = torchrun(processes, "agent", endpoint=etcd.members[0].endpoint, run_id="x", nnodes="1:1",
                 script=[str(ALLREDUCE_JOB)], conf="hearbeat_timeout=2")
    assert p.wait(timeout=40) != 0
    out = p.output()
    assert "unknown --rdzv-conf key 'hearbeat_timeout'" in out and "heartbeat_timeout" in out


@pytest.mark.timeout(60)
def test_inverted_nnodes_range_is_refused_before_anything_waits(processes, etcd):
    # torchrun itself rejects MIN > MAX before it loads any rendezvous backend.
    p = torchrun(processes, "agent", endpoint=etcd.members[0].endpoint, run_id="x", nnodes="3:2",
                 script=[str(ALLREDUCE_JOB)])
    assert p.wait(timeout=40) != 0
    assert "min_nodes=3, max_nodes=2" in p.output()


@pytest.mark.timeout(90)
def test_a_node_below_the_minimum_gives_up_after_the_join_timeout_with_a_clear_message(
        processes, etcd):
    p = torchrun(processes, "agent", endpoint=etcd.members[0].endpoint, run_id="alone",
                 nnodes="2:2", script=[str(ALLREDUCE_JOB)], conf="join_timeout=4")
    assert p.wait(timeout=60) != 0
    assert "no round admitted this node within join_timeout=4s" in p.output()
