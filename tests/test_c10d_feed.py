"""The embedded store's write count (``elastic_ext.rendezvous.stores.c10d.feed``) on a real
TCPStore in this process: a node waiting on the state sends one wait and no read until a
write, wakes at the write, and the keys that wake it do not pile up."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from torch.distributed import PrefixStore, TCPStore

from elastic_ext.rendezvous.protocol.clock import SystemClock
from elastic_ext.rendezvous.stores.c10d.backend import C10dBackend, list_keys
from elastic_ext.rendezvous.stores.c10d.feed import (
    CHANGED_KEPT,
    STATE_SEQ,
    WriteFeed,
    announce_write,
    read_count,
)
from tests.support.stores import settings_for

pytestmark = pytest.mark.timeout(60)


class Counting:
    """A store that records the name of every call made on it."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.inner, name)

        def call(*args: Any) -> Any:
            self.calls.append(name)
            return method(*args)
        return call


@pytest.fixture
def server() -> Iterator[TCPStore]:
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, multi_tenant=True,
                     timeout=timedelta(seconds=5))
    yield store


def client(server: TCPStore) -> Any:
    return PrefixStore("/run/", TCPStore("127.0.0.1", server.port, is_master=False,
                                         wait_for_workers=False, multi_tenant=True,
                                         timeout=timedelta(seconds=5)))


def test_a_waiter_sends_one_read_and_one_wait_until_a_write_wakes_it(server: TCPStore) -> None:
    writer, waiter = client(server), Counting(client(server))
    feed = WriteFeed(lambda: waiter, poke=writer)
    try:
        assert not feed.wait_past(0, 0.5)  # nothing written yet
        assert waiter.calls == ["compare_set", "wait"]  # then nothing while it waits
        began = time.monotonic()
        assert announce_write(writer) == 1
        assert feed.wait_past(0, 10)
        assert time.monotonic() - began < 1.0
        assert not feed.wait_past(1, 0.2)  # and it waits for the next one
        assert waiter.calls == ["compare_set", "wait", "compare_set", "wait"]
    finally:
        feed.close()


def test_only_the_newest_wake_keys_are_kept(server: TCPStore) -> None:
    writer = client(server)
    for _ in range(CHANGED_KEPT + 6):
        announce_write(writer)
    changed = sorted(int(k.rsplit("/", 1)[1]) for k in list_keys(server) or []
                     if "/changed/" in k)
    assert changed == list(range(7, CHANGED_KEPT + 7))
    assert read_count(writer, STATE_SEQ) == CHANGED_KEPT + 6


def test_reading_a_counter_that_is_not_there_creates_no_key(server: TCPStore) -> None:
    reader = client(server)
    assert read_count(reader, "join/g/1/n") == 0
    assert not any("join/" in k for k in list_keys(server) or [])


def test_a_waiter_wakes_when_the_store_goes_away() -> None:
    host = [TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, multi_tenant=True,
                     timeout=timedelta(seconds=5))]
    waiter = client(host[0])
    feed = WriteFeed(lambda: waiter, poke=client(host[0]))
    try:
        assert not feed.wait_past(0, 0.3)
        host.clear()  # the host agent dies with its store
        assert feed.wait_past(0, 10)
    finally:
        feed.close()


def test_a_closed_feed_stops_waiting_and_leaves_no_key_and_the_others_wait_on(
        server: TCPStore) -> None:
    writer = client(server)
    announce_write(writer)
    mine, others = WriteFeed(lambda: client(server), poke=writer), \
        WriteFeed(lambda: client(server), poke=writer)
    try:
        assert not mine.wait_past(1, 0.3) and not others.wait_past(1, 0.1)
        mine.close()
        assert not mine._thread.is_alive()
        assert not others.wait_past(1, 0.5)  # woke, found no write, waits again
        assert sorted(k for k in list_keys(server) or [] if "/changed/" in k) == ["/run//changed/1"]
        announce_write(writer)
        assert others.wait_past(1, 5)
    finally:
        others.close()


def test_a_feed_closed_after_the_run_was_removed_still_stops(server: TCPStore) -> None:
    """The last node out removes the run's keys, its count among them, before its backend
    closes: a feed left waiting would abort the agent at exit (a C++ wait returning into a
    finalizing interpreter)."""
    writer = client(server)
    announce_write(writer)
    feed = WriteFeed(lambda: client(server), poke=writer)
    assert not feed.wait_past(1, 0.3)
    for key in [k for k in list_keys(server) or [] if k.startswith("/run/")]:
        server.delete_key(key)
    feed.close()
    assert not feed._thread.is_alive()
    assert [k for k in list_keys(server) or [] if k.startswith("/run/")] == []


def test_the_closer_waits_for_a_join_without_reading_the_count_meanwhile(
        server: TCPStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 27: the closer of an open round on the embedded store read the join count every
    50 ms; it now waits on the key the next join creates, on a connection of its own."""
    settings = settings_for(f"c10d://127.0.0.1:{server.port}", "run1")
    closer, joiner = C10dBackend(settings, server), C10dBackend(settings, server)
    reads: list[str] = []
    count_joins = C10dBackend.count_joins

    def counting(self: C10dBackend, generation: str, round_: int) -> int:
        reads.append(generation)
        return count_joins(self, generation, round_)
    monkeypatch.setattr(C10dBackend, "count_joins", counting)
    clock = SystemClock()
    try:
        joiner.join("g", 1, "n1", b"e1")
        began = time.monotonic()
        assert not closer.wait_for_joins("g", 1, 2, 0.5, clock)  # nobody joins meanwhile
        assert time.monotonic() - began >= 0.45 and not reads
        timer = threading.Timer(0.2, lambda: joiner.join("g", 1, "n2", b"e2"))
        timer.start()
        began = time.monotonic()
        assert closer.wait_for_joins("g", 1, 2, 10.0, clock)
        timer.join()
        assert time.monotonic() - began < 2.0 and not reads
        assert closer.read_joins("g", 1) == [("n1", b"e1"), ("n2", b"e2")]
        assert closer.wait_for_joins("g", 2, 1, 0.1, clock) is False  # a new round's feed
    finally:
        closer.close()
    assert not reads
