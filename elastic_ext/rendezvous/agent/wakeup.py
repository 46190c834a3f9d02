"""A ``threading.Event`` a selector can wait on together with sockets.

The keeper sleeps between its ticks until its interval passed or something asks for a
tick at once (a state change, a notice, a machine found silent). It also holds a
connection to every watched node's presence port, whose end is how a killed agent is
found; waiting on those connections in the same sleep (``PresenceWatch.wait``) finds the
death when it happens instead of at the next tick, up to an interval later (1 s on etcd,
and several seconds for a starved watcher of 1,024 nodes).
"""

from __future__ import annotations

import socket
import threading


class Wakeup:
    """Set from any thread; waited on and cleared by one (the keeper's). Its ``fileno``
    turns readable when it is set."""

    def __init__(self) -> None:
        self._read, self._write = socket.socketpair()
        self._read.setblocking(False)
        self._write.setblocking(False)
        self._set = threading.Event()

    def set(self) -> None:
        self._set.set()
        try:
            self._write.send(b"\0")
        except OSError:  # full (it is readable already) or closed (the keeper stopped)
            pass

    def is_set(self) -> bool:
        return self._set.is_set()

    def clear(self) -> None:
        """Not set any more; check ``is_set`` before each select (a ``set`` may land
        between the two halves of this)."""
        self._set.clear()
        try:
            while self._read.recv(4096):
                pass
        except OSError:  # drained (BlockingIOError), or closed
            pass

    def fileno(self) -> int:
        return self._read.fileno()

    def close(self) -> None:
        self._read.close()
        self._write.close()
