"""The etcd v3 JSON gateway's message shapes: keys and values in base64, a transaction's
operations and the read replies inside it, and how many operations etcd takes at once."""

from __future__ import annotations

import base64
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")


def b64(data: bytes | str) -> str:
    raw = data.encode() if isinstance(data, str) else data
    return base64.b64encode(raw).decode()


def unb64(text: str) -> bytes:
    return base64.b64decode(text)


def prefix_end(prefix: bytes) -> bytes:
    """The smallest key greater than every key that starts with ``prefix``."""
    end = bytearray(prefix)
    for i in range(len(end) - 1, -1, -1):
        if end[i] < 0xFF:
            end[i] += 1
            return bytes(end[: i + 1])
    return b"\0"


@dataclass(frozen=True)
class KeyValue:
    key: bytes
    value: bytes
    mod_revision: int
    create_revision: int = 0

    @classmethod
    def from_reply(cls, kv: dict[str, Any]) -> KeyValue:
        return cls(unb64(kv["key"]), unb64(kv.get("value", "")), int(kv["mod_revision"]),
                   int(kv.get("create_revision", 0)))


def op_put(key: str, value: bytes, lease: int | None = None) -> dict[str, Any]:
    """A put inside a transaction (``etcd.client.EtcdClient.txn``)."""
    put: dict[str, Any] = {"key": b64(key), "value": b64(value)}
    if lease:
        put["lease"] = str(lease)
    return {"request_put": put}


def op_range(key: str, *, prefix: bool = False, keys_only: bool = False,
             count_only: bool = False) -> dict[str, Any]:
    """A read inside a transaction: one key, or every key under ``key`` with ``prefix``."""
    request: dict[str, Any] = {"key": b64(key)}
    if prefix:
        request["range_end"] = b64(prefix_end(key.encode()))
    if keys_only:
        request["keys_only"] = True
    if count_only:
        request["count_only"] = True
    return {"request_range": request}


def op_delete(key: str) -> dict[str, Any]:
    return {"request_delete_range": {"key": b64(key)}}


def range_reply(response: dict[str, Any]) -> tuple[list[KeyValue], int]:
    """The keys and the count of one read's answer inside a transaction's reply."""
    reply = response.get("response_range") or {}
    return [KeyValue.from_reply(kv) for kv in reply.get("kvs") or []], int(reply.get("count", 0))


MAX_TXN_OPS = 128
"""etcd's default ``--max-txn-ops``: it refuses a transaction with more operations."""


def batches(items: Sequence[T]) -> list[Sequence[T]]:
    return [items[i:i + MAX_TXN_OPS] for i in range(0, len(items), MAX_TXN_OPS)]
