"""A ``torch.distributed.Store`` on etcd v3, for what torch's agent does after a round.

torch's agent uses the round's store to assign worker ranks and for its exit
barrier. torch's own ``EtcdStore`` speaks the v2 API, which etcd 3.6 removed.
Every agent of a round waits on it at once (for rank 0's assignment, at the barrier), so
a wait is a watch of the keys it waits for, not a read every few milliseconds: at 1,024
agents a 20 ms poll was 50,000 requests a second for as long as the slowest agent took.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from datetime import timedelta

from torch.distributed import Store

from elastic_ext.rendezvous.errors import StoreUnavailableError
from elastic_ext.rendezvous.etcd_client import EtcdClient

logger = logging.getLogger(__name__)

_NEVER = threading.Event()  # a watch's stop that is never set: a wait ends by its deadline


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

    def set(self, key: str, value: str | bytes) -> None:
        self._client.put(self._key(key), _bytes(value))

    def get(self, key: str) -> bytes:
        self.wait([key])
        kv = self._client.get(self._key(key))
        if kv is None:
            raise LookupError(f"key {key!r} vanished from the etcd store")
        return kv.value

    def add(self, key: str, num: int) -> int:
        return self._client.add(self._key(key), num)

    def compare_set(self, key: str, expected_value: str | bytes,
                    desired_value: str | bytes) -> bytes:
        expected, desired = _bytes(expected_value), _bytes(desired_value)
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
        return all(kv is not None for kv in self._client.multi_get([self._key(k) for k in keys]))

    def wait(self, keys: list[str], override_timeout: timedelta | None = None) -> None:
        """Return once every one of ``keys`` exists; ``TimeoutError`` after the timeout.
        One read; for the keys it did not find, a watch from now, then a read once the
        watch is in place, so a key written in between is not missed."""
        timeout = override_timeout if override_timeout is not None else self._timeout
        deadline = time.monotonic() + timeout.total_seconds()
        names = [self._key(k) for k in keys]
        while True:
            values = self._client.multi_get(names)
            missing = {name for name, kv in zip(names, values, strict=True) if kv is None}
            if not missing:
                return
            if time.monotonic() >= deadline:
                raise TimeoutError(f"etcd store: keys {keys} not set within {timeout}")
            if _watch_until_written(self._client, missing, deadline):
                return

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self.wait(keys)
        return [kv.value for kv in self._client.multi_get([self._key(k) for k in keys]) if kv]

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        self._client.multi_put([(self._key(k), _bytes(v))
                                for k, v in zip(keys, values, strict=True)])

    def delete_key(self, key: str) -> bool:
        existed = self._client.get(self._key(key)) is not None
        self._client.delete(self._key(key))
        return existed

    def num_keys(self) -> int:
        return len(self._client.get_prefix(self._prefix))


class _AllWritten(Exception):
    """Every key waited for was found by the read after the watch was in place."""


def _watch_until_written(client: EtcdClient, missing: set[str], deadline: float) -> bool:
    """Watch ``missing`` from now until each was written (True), or until the deadline,
    a broken or idle stream (False: the caller reads them again). Several keys are
    watched as the range of their common prefix (rank 0 waits for every agent's key; the
    others wait for one). From now, not from the first read's revision: a watch from the
    past makes etcd search its history for it (at 512 agents waiting at once, etcd fell
    15 s behind)."""
    watched = sorted(missing)
    key = watched[0] if len(watched) == 1 else os.path.commonprefix(watched)

    def read_again() -> None:  # what was written before the watch was in place
        for name, kv in zip(sorted(missing), client.multi_get(sorted(missing)), strict=True):
            if kv is not None:
                missing.discard(name)
        if not missing:
            raise _AllWritten

    try:
        idle = max(0.0, deadline - time.monotonic())
        for _, changed, kv in client.watch(key, 0, idle, _NEVER, prefix=len(watched) > 1,
                                           on_created=read_again):
            name = changed.decode(errors="replace")
            if name in missing and kv is not None:
                missing.discard(name)
            elif name in watched and kv is None:
                missing.add(name)  # deleted again after it was written
            if not missing:
                return True
            if time.monotonic() >= deadline:
                return False
    except _AllWritten:
        return True
    except StoreUnavailableError as exc:  # the read that follows says if etcd is gone
        logger.debug("etcd-ext: watch of the round store's %s: %s", key, exc)
    return False
