"""Asking a running warm-start server how it is: ready, and safe to fork."""

from __future__ import annotations

import socket
import time
from typing import Any

from elastic_ext.warm.protocol import ProtocolError, recv_message, send_message


def query_status(socket_path: str, timeout: float) -> dict[str, Any] | None:
    """The server's fork-safety facts (``safety.ForkSafety.to_message``), or None when it
    did not answer within ``timeout`` seconds. It answers only once its imports are done,
    so an answer also means it is ready."""
    deadline = time.monotonic() + timeout
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(remaining)
                sock.connect(socket_path)
                send_message(sock, {"op": "status"})
                message, _ = recv_message(sock)
                return message
        except (OSError, ProtocolError):
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
