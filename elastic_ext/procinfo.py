"""Whether a process id names a live process.

Product code needs this to tell a crashed writer's leftovers from a running
writer's files; it lives here so that product code never imports the local test
lab's tooling for it.
"""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (ours or not); a zombie counts as dead."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def process_state(pid: int) -> str:
    """``pid``'s state letter in ``/proc`` (R, S, D, T, t, Z...), "" when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


__all__ = ["pid_alive", "process_state"]
