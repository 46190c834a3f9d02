"""The launcher-server wire format: length-prefixed JSON on a Unix stream socket.

The request carries the launcher's stdin, stdout and stderr as ``SCM_RIGHTS`` with
its first byte. Messages:

- launcher to server: ``{"op": "run", ...}`` (see :class:`RunRequest`) or
  ``{"op": "status"}``;
- server to launcher: ``{"pid": N}`` once the worker is forked, then
  ``{"status": S}`` (the raw ``waitpid`` status) when it ends; or ``{"refused": why}``;
  for a status query, :func:`elastic_ext.warm.safety` facts.
"""

from __future__ import annotations

import json
import os
import socket
import struct
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

_HEADER = struct.Struct("!I")
MAX_MESSAGE = 16 << 20
"""An environment, argv and a few numbers: far below this; anything larger is garbage."""


class ProtocolError(Exception):
    """The peer sent something that is not a message of this protocol."""


@dataclass(frozen=True)
class RunRequest:
    """Everything a worker needs to be the process torchrun would have started."""

    kind: str
    """``module`` (``python -m NAME``) or ``path`` (``python PATH``)."""
    name: str
    argv: list[str]
    """The arguments after the module or path."""
    env: dict[str, str]
    cwd: str
    umask: int
    rlimits: dict[str, list[int]] = field(default_factory=dict)
    launched_at: float = 0.0
    """Unix time the launcher process started: where a worker start is measured from."""

    def to_message(self) -> dict[str, Any]:
        return {"op": "run", **asdict(self)}

    @classmethod
    def from_message(cls, message: dict[str, Any]) -> RunRequest:
        """The request in ``message``, checked as strictly as the worker will use it.

        Raises:
            ProtocolError: a field is missing, of the wrong type or out of range.
        """
        try:
            argv, env, rlimits = message["argv"], message["env"], message.get("rlimits", {})
            if not isinstance(argv, list) or not isinstance(env, dict) \
                    or not isinstance(rlimits, dict):
                raise TypeError("argv must be a list, env and rlimits objects")
            request = cls(kind=str(message["kind"]), name=str(message["name"]),
                          argv=[str(a) for a in argv],
                          env={str(k): str(v) for k, v in env.items()},
                          cwd=str(message["cwd"]), umask=int(message["umask"]),
                          rlimits={str(k): _limit_pair(v) for k, v in rlimits.items()},
                          launched_at=float(message.get("launched_at", 0.0)))
        except (KeyError, TypeError, ValueError, IndexError, OverflowError) as exc:
            raise ProtocolError(f"malformed run request: {exc!r}") from exc
        if request.kind not in ("module", "path"):
            raise ProtocolError(f"unknown target kind {request.kind!r}")
        if not request.name or "\0" in request.name:
            raise ProtocolError("the request names no module or script")
        if not 0 <= request.umask <= 0o777:
            raise ProtocolError(f"umask {request.umask:#o} is not a umask")
        if "\0" in request.cwd or not request.cwd.startswith("/"):
            raise ProtocolError(f"cwd {request.cwd!r} is not an absolute path")
        for key, value in request.env.items():  # what the worker's putenv would refuse
            if not key or "=" in key or "\0" in key or "\0" in value:
                raise ProtocolError(f"environment variable {key!r} cannot be set")
        return request


def _limit_pair(value: Any) -> list[int]:
    if not isinstance(value, list) or len(value) != 2:
        raise TypeError(f"a resource limit is [soft, hard], not {value!r}")
    return [int(value[0]), int(value[1])]


def send_message(sock: socket.socket, message: dict[str, Any], fds: Sequence[int] = ()) -> None:
    """Send one message; ``fds`` travel with its first byte.

    Raises:
        ProtocolError: the message is larger than the receiver accepts.
        OSError: the socket failed.
    """
    data = json.dumps(message).encode()
    if len(data) > MAX_MESSAGE:
        raise ProtocolError(f"a {len(data)}-byte message is over the {MAX_MESSAGE}-byte limit")
    framed = _HEADER.pack(len(data)) + data
    if fds:
        socket.send_fds(sock, [framed[:1]], list(fds))
        framed = framed[1:]
    sock.sendall(framed)


def _recv_exact(sock: socket.socket, size: int, got: bytes = b"") -> bytes:
    chunks = [got]
    remaining = size - len(got)
    while remaining > 0:
        chunk = sock.recv(remaining)
        if not chunk:
            raise ProtocolError("connection closed inside a message")
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def recv_message(sock: socket.socket, max_fds: int = 0) -> tuple[dict[str, Any] | None, list[int]]:
    """The next message and any descriptors sent with it; ``(None, [])`` on a clean EOF.

    Raises:
        ProtocolError: a truncated, oversized or non-JSON message.
        OSError: the socket failed (a timeout included).
    """
    fds: list[int] = []
    if max_fds:
        first, fds, _, _ = socket.recv_fds(sock, 1, max_fds)
    else:
        first = sock.recv(1)
    if not first:
        for fd in fds:
            _close_quietly(fd)
        return None, []
    try:
        (size,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size, first))
        if size > MAX_MESSAGE:
            raise ProtocolError(f"a {size}-byte message is not one of ours")
        try:
            message = json.loads(_recv_exact(sock, size))
        except (ValueError, RecursionError) as exc:  # RecursionError: [[[[... nested too deep
            raise ProtocolError(f"not a JSON message: {exc}") from exc
        if not isinstance(message, dict):
            raise ProtocolError("a message must be a JSON object")
    except BaseException:  # a timeout or a bad message: the descriptors are nobody's
        for fd in fds:
            _close_quietly(fd)
        raise
    return message, fds


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass
