"""What the warm-start tests ask of a node's processes: were its workers forked by its
server, and is everything of a killed node gone at once."""

from __future__ import annotations

import re
import time
from pathlib import Path

from elastic_ext.local.processes import Proc, environ_of, wait_until

SERVER_MODULE = "elastic_ext.warm.server"
GONE_WITHIN_S = 1.0
"""How long the processes of a killed agent or node may outlive it."""


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of ``pid``; None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[1])


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return "(gone)"


def live_children(proc: Proc, parent: int) -> list[int]:
    """The live (not zombie) processes of ``proc``'s tag whose parent is ``parent``."""
    found = []
    for pid in proc.pids():
        stat = _stat(pid)
        if stat is not None and stat[0] != "Z" and stat[1] == parent:
            found.append(pid)
    return found


def server_of(proc: Proc, agent: int) -> int:
    """The warm-start server the agent ``agent`` started."""
    def look() -> int | None:
        return next((pid for pid in live_children(proc, agent)
                     if SERVER_MODULE in cmdline(pid)), None)
    return wait_until(look, 30, what=f"the warm-start server of agent {agent}")


def launchers_of(proc: Proc, agent: int) -> list[int]:
    """The agent's workers as torchrun sees them: its children that torchrun gave a RANK."""
    return [pid for pid in live_children(proc, agent) if "RANK" in environ_of(pid)]


def training_pids(output: str) -> set[int]:
    """The pids the bundled trainer's ranks logged at their start."""
    return {int(pid) for pid in re.findall(r"rank \d+/\d+ pid (\d+) starting", output)}


def assert_warm(proc: Proc, agent: int, nproc: int) -> int:
    """Check that the agent's ``nproc`` training processes were forked by its server (not
    started cold by their launchers); returns the server's pid."""
    server = server_of(proc, agent)
    workers = wait_until(lambda: (lambda found: found if len(found) == nproc else None)(
        live_children(proc, server)), 30, what=f"{nproc} workers forked by server {server}")
    assert len(launchers_of(proc, agent)) == nproc, proc.output()[-4000:]
    training = wait_until(lambda: training_pids(proc.output()) & set(workers) or None, 30,
                          what="the trainer's start lines")
    assert training == set(workers), (training, workers)
    return server


def assert_gone_within(proc: Proc, seconds: float, since: float) -> None:
    """Every process of ``proc``'s tag is gone ``seconds`` after ``since`` (monotonic)."""
    try:
        wait_until(lambda: not proc.pids(), max(0.0, since + seconds - time.monotonic()), 0.01,
                   f"the processes of {proc.name} to end")
    except TimeoutError:
        left = {pid: cmdline(pid)[:160] for pid in proc.pids()}
        raise AssertionError(f"{len(left)} process(es) of {proc.name} still there "
                             f"{seconds}s after the kill: {left}") from None
