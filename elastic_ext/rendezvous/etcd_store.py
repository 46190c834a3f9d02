"""A ``torch.distributed.Store`` on etcd v3, for what torch's agent does after a round.

torch's agent uses the round's store to assign worker ranks and for its exit
barrier. torch's own ``EtcdStore`` speaks the v2 API, which etcd 3.6 removed.
"""

from __future__ import annotations

import time
from datetime import timedelta

from torch.distributed import Store

from elastic_ext.rendezvous.etcd_client import EtcdClient

_POLL = 0.02


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
        timeout = override_timeout if override_timeout is not None else self._timeout
        deadline = time.monotonic() + timeout.total_seconds()
        while not self.check(keys):
            if time.monotonic() > deadline:
                raise TimeoutError(f"etcd store: keys {keys} not set within {timeout}")
            time.sleep(_POLL)

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
