"""Spawning torchrun agents and servers, and killing every last one of them.

Each spawned command gets its own session (so it is its own process group) and an
environment tag. torchrun puts each worker in a session of its own, and workers of
a SIGKILLed agent are re-parented, so cleanup finds processes by the tag in
``/proc/<pid>/environ`` rather than by walking the process tree.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

TAG_ENV = "ELASTIC_EXT_LOCAL_TAG"
T = TypeVar("T")


def tagged_pids(tag: str) -> list[int]:
    """Every live process whose environment carries ``TAG_ENV=tag``."""
    pids = (int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit())
    return [pid for pid in pids if environ_of(pid).get(TAG_ENV) == tag]


def environ_of(pid: int) -> dict[str, str]:
    """The environment ``pid`` was started with; empty once it is gone."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    pairs = (item.decode(errors="replace").partition("=") for item in raw.split(b"\0") if item)
    return {key: value for key, _, value in pairs}


def signal_pids(pids: Iterable[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def wait_until(predicate: Callable[[], T | None], timeout: float, interval: float = 0.05,
               what: str = "condition") -> T:
    """Poll ``predicate`` until it returns something truthy, and return that; raise
    ``TimeoutError`` naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.1f}s waiting for {what}")
        time.sleep(interval)


@dataclass
class Proc:
    """One spawned command: its own session, its own tag, its log file."""

    name: str
    popen: subprocess.Popen
    tag: str
    log: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def pids(self) -> list[int]:
        """The command and every descendant, workers in other sessions included."""
        return tagged_pids(self.tag)

    def send(self, sig: int) -> list[int]:
        """Signal the whole node: agent and workers. Returns the pids signalled."""
        pids = self.pids()
        signal_pids(pids, sig)
        return pids

    def kill(self) -> None:
        self.send(signal.SIGKILL)

    def wait(self, timeout: float) -> int:
        return self.popen.wait(timeout=timeout)

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


@dataclass
class ProcessSet:
    """Owns every process a test starts; ``cleanup`` leaves nothing behind."""

    log_dir: Path
    procs: list[Proc] = field(default_factory=list)
    before_exec: Callable[[], object] | None = None
    """Run in each child before it executes its program (``subprocess``'s ``preexec_fn``)."""

    def spawn(self, name: str, cmd: Sequence[str], env: Mapping[str, str] | None = None,
              cwd: str | Path | None = None) -> Proc:
        tag = uuid.uuid4().hex
        full_env = dict(os.environ if env is None else env)
        full_env[TAG_ENV] = tag
        full_env.setdefault("PYTHONUNBUFFERED", "1")
        log = self.log_dir / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            popen = subprocess.Popen(list(cmd), env=full_env, cwd=cwd, stdout=out,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True, preexec_fn=self.before_exec)
        proc = Proc(name, popen, tag, log)
        self.procs.append(proc)
        return proc

    def cleanup(self, timeout: float = 10.0) -> None:
        """SIGKILL every process of the set, again until none is left: one that was being
        forked while the first round was sent (a warm-start server's new worker, an agent's
        new launcher) is not in that round's list."""
        deadline = time.monotonic() + timeout
        while True:
            leftovers = [p for proc in self.procs for p in proc.pids()]
            if not leftovers:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"processes survived cleanup: {leftovers}")
            signal_pids(leftovers, signal.SIGCONT)
            signal_pids(leftovers, signal.SIGKILL)
            for proc in self.procs:
                proc.popen.poll()  # reap our own children: a zombie is not a survivor
            time.sleep(0.05)
        for proc in self.procs:
            try:
                proc.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
