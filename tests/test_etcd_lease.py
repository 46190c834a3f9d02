"""The agent's lease without etcd: its TTL, and how a write that found it gone is retried."""

from __future__ import annotations

import pytest

from elastic_ext.rendezvous.errors import StoreUnavailableError
from elastic_ext.rendezvous.stores.etcd.lease import AgentLease, lease_ttl


def test_the_ttl_finds_a_frozen_node_within_the_timeout_or_only_tidies_up() -> None:
    assert lease_ttl(3.0, is_heartbeat=True) == 2  # expired by 2.5 s at the latest
    assert lease_ttl(5.0, is_heartbeat=True) == 4
    assert lease_ttl(1.0, is_heartbeat=True) == 2  # etcd's minimum
    assert lease_ttl(3.0, is_heartbeat=False) == 30
    assert lease_ttl(6.0, is_heartbeat=False) == 60


def failing(times: int, message: str, calls: list[int | None], lease: AgentLease):
    def write() -> str:
        calls.append(lease.id)
        if len(calls) <= times:
            raise StoreUnavailableError(message)
        return "written"
    return write


def test_a_write_that_found_the_lease_gone_is_tried_three_times_with_a_new_lease() -> None:
    lease = AgentLease(client=None, hb_prefix="/p/hb/", ttl=2,  # type: ignore[arg-type]
                       heartbeat_timeout=3.0)
    lease.id = 7
    calls: list[int | None] = []
    assert lease.retry(failing(2, "etcdserver: requested lease not found", calls, lease)) \
        == "written"
    assert calls == [7, None, None]  # forgotten after the first failure: granted anew
    calls.clear()
    with pytest.raises(StoreUnavailableError, match="lease not found"):
        lease.retry(failing(3, "etcdserver: requested lease not found", calls, lease))
    assert len(calls) == 3
    calls.clear()
    with pytest.raises(StoreUnavailableError, match="no etcd endpoint"):
        lease.retry(failing(1, "no etcd endpoint answered", calls, lease))
    assert len(calls) == 1  # anything else is not retried here
