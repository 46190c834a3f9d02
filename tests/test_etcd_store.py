"""The round's store on a real etcd: every agent of a round waits on it at once (for rank
0's rank assignment, at the exit barrier), so a wait must be a watch, not a read every
20 ms (at 1,024 agents that was 50,000 requests a second; issue 27)."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import Counter
from datetime import timedelta

import pytest

from elastic_ext.local.etcd import received_requests
from elastic_ext.local.processes import wait_until
from elastic_ext.rendezvous.stores.etcd.client import EtcdClient
from elastic_ext.rendezvous.stores.etcd.round_store import EtcdV3Store
from tests.support.stores import settings_for

pytestmark = pytest.mark.etcd

OLD_POLL_S = 0.02  # the wait this replaced read the keys this often
WINDOW_S = 0.5  # long enough for 25 reads of that poll


def _reads(counts: Counter[str]) -> int:
    return counts["Range"] + counts["Txn"]


def _store(etcd) -> EtcdV3Store:
    return EtcdV3Store(EtcdClient(settings_for(etcd.members[0].endpoint)), "/t/store/g/1/")


def _waiting(store: EtcdV3Store, keys: list[str], got: list[list[bytes]]) -> threading.Thread:
    waiter = threading.Thread(target=lambda: got.append(store.multi_get(keys)), daemon=True)
    waiter.start()
    return waiter


def test_a_wait_watches_until_the_key_is_written_and_does_not_read_meanwhile(etcd) -> None:
    url = etcd.members[0].client_url
    key = "torchelastic/assigned_ranks/3"
    before = received_requests(url)
    got: list[list[bytes]] = []
    waiter = _waiting(_store(etcd), [key], got)
    wait_until(lambda: received_requests(url)["Watch"] > before["Watch"], 10.0, 0.01,
               "the waiter's watch")
    watching = received_requests(url)
    assert not got
    # A measurement window, not a wait for something: a poll would read in it 25 times.
    assert not threading.Event().wait(WINDOW_S)
    # at most the one read that follows the watch's creation (it may come after `watching`)
    assert _reads(received_requests(url)) - _reads(watching) <= 1, "the waiter read while waiting"

    _store(etcd).set(key, b"[3, 8, 3, 8]")
    waiter.join(timeout=10.0)
    assert got == [[b"[3, 8, 3, 8]"]]


def test_rank_0_waits_for_every_agents_key_as_they_come(etcd) -> None:
    keys = [f"torchelastic/role_info/{i}" for i in range(5)]
    writer = _store(etcd)
    writer.set(keys[0], b"r0")  # already there when the wait starts
    got: list[list[bytes]] = []
    waiter = _waiting(_store(etcd), keys, got)
    writer.set("torchelastic/other", b"not waited for")
    for i, key in enumerate(keys[1:], start=1):
        assert not got, f"the wait ended with {i} of {len(keys)} keys written"
        writer.set(key, f"r{i}".encode())
    waiter.join(timeout=10.0)
    assert got == [[b"r0", b"r1", b"r2", b"r3", b"r4"]]


def test_a_wait_for_a_key_nobody_writes_ends_at_its_timeout(etcd) -> None:
    store = _store(etcd)
    began = time.monotonic()
    with pytest.raises(TimeoutError, match="not set within"):
        store.wait(["torchelastic/never"], timedelta(seconds=0.5))
    assert 0.5 <= time.monotonic() - began < 3.0


def test_more_agents_than_one_transaction_holds(etcd) -> None:
    """torch's rank 0 reads every agent's key and writes every agent's ranks at once; etcd
    refuses a transaction of more than 128 operations by default (a 129-node job failed
    right after its round formed)."""
    agents = 300
    store = _store(etcd)
    store.multi_set([f"torchelastic/role_info/{i}" for i in range(agents)],
                    [f"default:{i}" for i in range(agents)])
    keys = [f"torchelastic/role_info/{i}" for i in range(agents)]
    assert store.multi_get(keys) == [f"default:{i}".encode() for i in range(agents)]
    store.wait(keys, timedelta(seconds=5))
    assert store.check(keys) and not store.check([*keys, "torchelastic/never"])


def test_an_etcd_stalled_past_connect_timeout_is_waited_for_until_the_stores_timeout(
        etcd) -> None:
    """1,024 agents on 2 cores: etcd left an agent's rank-assignment request unanswered for
    longer than connect_timeout, and the agent failed where torch waits up to the store's
    timeout. A stalled etcd (SIGSTOP: a disk or CPU stall) stands in for the busy one."""
    member = etcd.members[0]
    assert member.proc is not None
    settings = settings_for(member.endpoint, connect_timeout="2", request_timeout="0.5")
    patient = EtcdV3Store(EtcdClient(settings), "/t/store/g/1/", timeout=timedelta(seconds=30))
    hasty = EtcdV3Store(EtcdClient(settings), "/t/store/g/1/", timeout=timedelta(seconds=3))
    patient.set("before", b"1")
    hasty.set("before", b"1")
    results: dict[str, tuple[str, float]] = {}

    def attempt(name: str, store: EtcdV3Store) -> threading.Thread:
        def run() -> None:
            began = time.monotonic()
            try:
                store.set(name, b"2")
                results[name] = ("set", time.monotonic() - began)
            except Exception as exc:  # what torch's agent would get
                results[name] = (type(exc).__name__, time.monotonic() - began)
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread
    os.kill(member.proc.popen.pid, signal.SIGSTOP)
    try:
        threads = [attempt("patient", patient), attempt("hasty", hasty)]
        time.sleep(5.0)  # the stall: longer than connect_timeout and the hasty store's 3 s
    finally:
        os.kill(member.proc.popen.pid, signal.SIGCONT)
    for thread in threads:
        thread.join(timeout=30)
    assert results["patient"][0] == "set", results
    assert patient.get("patient") == b"2"
    kind, after = results["hasty"]
    assert kind == "StoreUnavailableError" and 3.0 <= after < 6.0, results
