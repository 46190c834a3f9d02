"""Starting the bundled trainer in tests, reading what it wrote, and shared reference runs."""

from __future__ import annotations

import json
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elastic_ext.jsonlines import JsonLinesTail, read_json_lines
from elastic_ext.local.processes import Proc, ProcessSet, environ_of, wait_until

PY = sys.executable
_TORCHRUN = Path(sys.executable).with_name("torchrun")

# One job shape shared by the multi-process tests, so that one uninterrupted run is
# the reference for all of them: 40 steps, 14 samples a step (uneven over 3 ranks),
# 150 samples an epoch (10 steps, 10 samples dropped), so 4 epochs.
BASE_ARGS: tuple[str, ...] = ("--steps", "40", "--global-batch-size", "14", "--dataset-size", "150",
                              "--seed", "7", "--model-size", "tiny")


def env(**extra: str) -> dict[str, str]:
    """The environment of every trainer run: one intra-op thread, so that runs compare bit for
    bit."""
    e = dict(os.environ)
    e.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TRAINER_LOG_LEVEL": "INFO"})
    e.update(extra)
    return e


def trainer_cmd(*args: str) -> list[str]:
    return [PY, "-m", "trainer", *args]


def torchrun_cmd(nproc: int, *args: str, agent_args: Sequence[str] = ()) -> list[str]:
    launcher = [str(_TORCHRUN)] if _TORCHRUN.exists() else [PY, "-m", "torch.distributed.run"]
    return [*launcher, "--standalone", f"--nproc-per-node={nproc}", *agent_args, "-m", "trainer",
            *args]


def of(evs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in evs if e["event"] == kind]


def wait_event(path: Path, predicate: Callable[[dict[str, Any]], bool], timeout: float,
               proc: Proc | None = None, what: str = "event") -> dict[str, Any]:
    """The first event matching ``predicate``; fails early, with the log, if ``proc`` ended
    first."""
    tail = JsonLinesTail(path)

    def check() -> dict[str, Any] | None:
        for event in tail.poll():
            if predicate(event):
                return event
        if proc is not None and proc.popen.poll() is not None:
            raise AssertionError(f"{proc.name} exited with {proc.popen.returncode} before {what}:\n"
                                 f"{proc.output()[-6000:]}")
        return None
    result = wait_until(check, timeout=timeout, what=what)
    assert isinstance(result, dict)
    return result


def finish(proc: Proc, timeout: float) -> int:
    try:
        return proc.wait(timeout)
    except Exception as exc:
        raise AssertionError(f"{proc.name} did not finish in {timeout}s:\n"
                             f"{proc.output()[-6000:]}") from exc


def run_to_end(processes: ProcessSet, name: str, cmd: list[str], timeout: float,
               extra_env: dict[str, str] | None = None) -> Proc:
    proc = processes.spawn(name, cmd, env=env(**(extra_env or {})))
    code = finish(proc, timeout)
    assert code == 0, f"{name} exited with {code}:\n{proc.output()[-6000:]}"
    return proc


def worker_pids(proc: Proc, expected: int, timeout: float = 60) -> dict[int, int]:
    """rank -> pid of the agent's live workers, from the ``RANK`` torchrun gave each."""
    def look() -> dict[int, int] | None:
        found: dict[int, int] = {}
        for pid in proc.pids():
            rank = environ_of(pid).get("RANK")
            if pid != proc.pid and rank is not None and not pid_gone(pid):
                found[int(rank)] = pid
        return found if len(found) == expected else None
    return wait_until(look, timeout=timeout, what=f"{expected} live workers")


def exit_lines(proc: Proc) -> list[tuple[int, int]]:
    """(rank, status) of every worker that logged its exit."""
    return [(int(r), int(c)) for r, c in
            re.findall(r"\[rank (\d+)\] INFO \S+: exiting with status (-?\d+)", proc.output())]


def pid_gone(pid: int) -> bool:
    """True once ``pid`` is gone or a zombie (exited, not yet reaped by its agent)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


@dataclass(frozen=True)
class Reference:
    sha256: str
    samples: list[dict[str, Any]]


_REFERENCES: dict[tuple[Any, ...], Reference] = {}


def reference(processes: ProcessSet, tmp: Path, nproc: int,
              args: Sequence[str] = BASE_ARGS) -> Reference:
    """The uninterrupted run of ``args`` at ``nproc`` ranks, run once per test session."""
    key = (nproc, tuple(args))
    if key not in _REFERENCES:
        out = tmp / f"reference-{nproc}"
        out.mkdir(parents=True, exist_ok=True)
        full = [*args, "--metrics", str(out / "m.jsonl"),
                "--record-samples", str(out / "samples.jsonl")]
        cmd = trainer_cmd(*full) if nproc == 1 else torchrun_cmd(nproc, *full)
        start = time.monotonic()
        run_to_end(processes, f"reference-{nproc}", cmd, timeout=90)
        done = of(read_json_lines(out / "m.jsonl"), "done")
        assert len(done) == 1, f"reference run logged {done} after {time.monotonic() - start:.1f}s"
        samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
        _REFERENCES[key] = Reference(sha256=done[0]["params_sha256"], samples=samples)
    return _REFERENCES[key]
