"""The embedded c10d store has one host, and a list of hosts is refused pointing at etcd.

The store lives inside one agent and dies with it (``tests/test_failures.py`` shows the
survivors' clear exit); a store that survives a node is a 3-member etcd. A list of hosts
on ``c10d://`` is refused before anything waits or listens, by the settings parser and so
by the handler torch's registry builds.
"""

from __future__ import annotations

import socket

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters, rendezvous_handler_registry

from elastic_ext.net import free_ports
from elastic_ext.rendezvous.errors import ConfigError
from elastic_ext.rendezvous.settings import Settings, parse_settings
from elastic_ext.rendezvous.stores.c10d.backend import C10dBackend


def settings(endpoint: str, local_addr: str | None = None, **conf: str) -> Settings:
    return parse_settings(endpoint=endpoint, run_id="run1", min_nodes=1, max_nodes=4,
                          conf=conf, local_addr=local_addr)


def listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


def test_one_endpoint_is_the_stores_one_host() -> None:
    s = settings("c10d://node1:29400")
    assert (s.store, [str(e) for e in s.endpoints]) == ("c10d", ["node1:29400"])
    assert settings("c10d://node1:29400", is_host="true").is_host is True
    assert settings("c10d://node1", is_host="false").is_host is False
    assert [str(e) for e in settings("").endpoints] == ["127.0.0.1:29400"]


def test_the_one_host_serves_and_its_loss_is_not_waited_out() -> None:
    """The handler waits out only outages that can end; this store dies with its host."""
    port = free_ports(1)[0]
    host = C10dBackend.connect(settings(f"c10d://127.0.0.1:{port}", "127.0.0.1"))
    client = C10dBackend.connect(settings(f"c10d://127.0.0.1:{port}", "127.0.0.1",
                                          is_host="false"))
    assert host.hosts_store and not client.hosts_store
    assert not host.outages_are_transient and not client.outages_are_transient


@pytest.mark.parametrize("endpoint,conf,count", [
    ("c10d://a:29400,b:29400,c:29400", {}, 3),
    ("a:1,b:2", {"store": "c10d"}, 2),
    ("c10d://a:1,a:1", {}, 2),
    ("c10d://node1:29400,node2", {"is_host": "true"}, 2),
])
def test_a_list_of_hosts_is_refused_in_one_line_that_names_etcd(endpoint: str,
                                                                 conf: dict[str, str],
                                                                 count: int) -> None:
    with pytest.raises(ConfigError) as caught:
        settings(endpoint, **conf)
    message = str(caught.value)
    assert "\n" not in message
    assert f"names {count} hosts, but the embedded c10d store has one host" in message
    assert "for a store that survives a node use etcd: a 3-member cluster" in message
    for where in ("deploy/local/etcd-cluster.sh", "deploy/slurm/", "deploy/k8s/",
                  "--rdzv-endpoint=host1:2379,host2:2379,host3:2379"):
        assert where in message


def test_the_handler_refuses_a_list_before_it_hosts_or_waits_for_anything() -> None:
    ports = free_ports(2)
    endpoint = "c10d://" + ",".join(f"127.0.0.1:{p}" for p in ports)
    params = RendezvousParameters(backend="etcd-ext", endpoint=endpoint, run_id="job7",
                                  min_nodes=1, max_nodes=2, local_addr="127.0.0.1")
    with pytest.raises(ConfigError, match="embedded c10d store has one host.*use etcd"):
        rendezvous_handler_registry.create_handler(params)
    assert not any(listening(p) for p in ports)
