"""A ``torch.distributed.Store`` on etcd v3, for what torch's agent does after a round.

torch's agent uses the round's store to assign worker ranks and for its exit
barrier. torch's own ``EtcdStore`` speaks the v2 API, which etcd 3.6 removed.
Every agent of a round waits on it at once (for rank 0's assignment, at the barrier), so
a wait is a watch of the keys it waits for, not a read every few milliseconds: at 1,024
agents a read every 20 ms is 51,200 requests a second for as long as the slowest takes.
torch waits on a store up to its timeout, so an etcd that leaves a request unanswered for
longer than ``connect_timeout`` (a busy etcd as a large job starts) is asked again until
then, not an error that ends the agent.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from functools import partial
from typing import TypeVar

from tenacity import Retrying, retry_if_exception_type, stop_after_delay, wait_exponential
from torch.distributed import Store

from elastic_ext.rendezvous.errors import StoreUnavailableError
from elastic_ext.rendezvous.stores.etcd.client import EtcdClient

logger = logging.getLogger(__name__)

_NEVER = threading.Event()  # a watch's stop that is never set: a wait ends by its deadline
_T = TypeVar("_T")


def _bytes(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class EtcdV3Store(Store):
    def __init__(self, client: EtcdClient, prefix: str,
                 timeout: timedelta = timedelta(seconds=300)) -> None:
        super().__init__()  # required for pybind's trampoline
        self._client = client
        self._prefix = prefix if prefix.endswith("/") else prefix + "/"
        self._timeout = timeout
        self.set_timeout(timeout)

    def set_timeout(self, timeout: timedelta) -> None:
        super().set_timeout(timeout)
        self._timeout = timeout  # what ``wait`` uses by default

    def _key(self, key: str) -> str:
        return self._prefix + key

    def _patiently(self, operation: Callable[[], _T]) -> _T:
        """``operation``, again while etcd does not answer, until the store's timeout; no
        request outlives it (``EtcdClient.within``: the load lengthens request timeouts)."""
        def said(state: object) -> None:
            logger.warning("etcd-ext: the round's store on etcd did not answer; asking "
                           "again until its timeout (%s)", self._timeout)
        deadline = time.monotonic() + self._timeout.total_seconds()

        def bounded() -> _T:
            with self._client.within(max(0.0, deadline - time.monotonic())):
                return operation()
        retrying = Retrying(stop=stop_after_delay(self._timeout.total_seconds()),
                            wait=wait_exponential(multiplier=0.1, max=1.0),
                            retry=retry_if_exception_type(StoreUnavailableError),
                            before_sleep=said, reraise=True)
        return retrying(bounded)

    def set(self, key: str, value: str | bytes) -> None:
        self._patiently(lambda: self._client.put(self._key(key), _bytes(value)))

    def get(self, key: str) -> bytes:
        return self._values([key], self._timeout)[0]

    def add(self, key: str, num: int) -> int:
        return self._patiently(lambda: add(self._client, self._key(key), num))

    def compare_set(self, key: str, expected_value: str | bytes,
                    desired_value: str | bytes) -> bytes:
        expected, desired = _bytes(expected_value), _bytes(desired_value)
        return self._patiently(lambda: self._compare_set(key, expected, desired))

    def _compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        while True:
            current = self._client.get(self._key(key))
            if current is None and expected:
                return expected
            if current is not None and current.value != expected:
                return current.value
            ok, now = self._client.compare_and_swap(self._key(key), desired,
                                                    current.mod_revision if current else None)
            if ok:
                return desired

    def check(self, keys: list[str]) -> bool:
        names = [self._key(k) for k in keys]
        return all(kv is not None for kv in self._patiently(lambda: self._client.multi_get(names)))

    def wait(self, keys: list[str], override_timeout: timedelta | None = None) -> None:
        self._values(keys, override_timeout if override_timeout is not None else self._timeout)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._values(keys, self._timeout)

    def _values(self, keys: list[str], timeout: timedelta) -> list[bytes]:
        """The values of ``keys`` once every one exists; ``TimeoutError`` after ``timeout``.
        One read; for the keys it did not find, a watch from now, then a read once the
        watch is in place (a key written in between is not missed); the values the watch
        delivers need no further read."""
        deadline = time.monotonic() + timeout.total_seconds()
        names = [self._key(k) for k in keys]
        found: dict[str, bytes] = {}
        while True:
            missing = [n for n in names if n not in found]
            self._patiently(partial(_read_into, self._client, missing, found))
            if all(n in found for n in names):
                return [found[n] for n in names]
            if time.monotonic() >= deadline:
                raise TimeoutError(f"etcd store: keys {keys} not set within {timeout}")
            _watch_into(self._client, {n for n in names if n not in found}, found, deadline)

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        pairs = [(self._key(k), _bytes(v)) for k, v in zip(keys, values, strict=True)]
        self._patiently(lambda: self._client.multi_put(pairs))

    def delete_key(self, key: str) -> bool:
        def delete() -> bool:
            existed = self._client.get(self._key(key)) is not None
            self._client.delete(self._key(key))
            return existed
        return self._patiently(delete)

    def num_keys(self) -> int:
        return len(self._patiently(lambda: self._client.get_prefix(self._prefix)))


def add(client: EtcdClient, key: str, amount: int) -> int:
    """Atomic integer add, by compare-and-swap (torch's ``Store.add``)."""
    while True:
        current = client.get(key)
        base = int(current.value) if current and current.value else 0
        ok, _ = client.compare_and_swap(key, str(base + amount).encode(),
                                        current.mod_revision if current else None)
        if ok:
            return base + amount


class _AllWritten(Exception):
    """Every key waited for was found by the read after the watch was in place."""


def _read_into(client: EtcdClient, names: list[str], found: dict[str, bytes]) -> None:
    """Put the value of each of ``names`` that exists into ``found``."""
    for name, kv in zip(names, client.multi_get(names), strict=True):
        if kv is not None:
            found[name] = kv.value


def _watch_into(client: EtcdClient, missing: set[str], found: dict[str, bytes],
                deadline: float) -> None:
    """Watch ``missing`` from now, putting each value written into ``found``, until every
    one was, the deadline, or a broken or idle stream (the caller reads them again).
    Several keys are watched as the range of their common prefix (rank 0 waits for every
    agent's key; the others wait for one). From now, not from the first read's revision:
    etcd looks through its history for a watch that starts in the past, at every change,
    until it caught up."""
    watched = sorted(missing)
    key = watched[0] if len(watched) == 1 else os.path.commonprefix(watched)
    remaining = set(watched)

    def read_again() -> None:  # what was written before the watch was in place
        _read_into(client, watched, found)
        remaining.difference_update(found)
        if not remaining:
            raise _AllWritten

    try:
        idle = max(0.0, deadline - time.monotonic())
        for _, changed, kv in client.watch(key, 0, idle, _NEVER, prefix=len(watched) > 1,
                                           on_created=read_again):
            name = changed.decode(errors="replace")
            if name in remaining and kv is not None:
                found[name] = kv.value
                remaining.discard(name)
                if not remaining:
                    return
            if time.monotonic() >= deadline:
                return
    except _AllWritten:
        return
    except StoreUnavailableError as exc:  # the read that follows says if etcd is gone
        logger.debug("etcd-ext: watch of the round store's %s: %s", key, exc)
