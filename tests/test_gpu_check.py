"""``benchmarks/gpu_check.py`` in CPU mode (``--cpu``), end to end: every check that runs
without a GPU passes, every GPU check is listed as skipped, the table comes with its
date and machine, and nothing the script started is left running.

The script starts torchrun agents, warm-start servers and trainers; it runs here in a
session of its own, with a deadline, and everything carrying this test's mark in its
environment is SIGKILLed at the end, whatever happened.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from elastic_ext.local.processes import environ_of, signal_pids

pytestmark = pytest.mark.slow  # its checks start torchrun agents

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu_check.py"
MARK_ENV = "GPU_CHECK_TEST_MARK"
DEADLINE_S = 200.0
"""Over the script's own worst case (its CPU budgets add up to 150 s); a pass takes 30-60 s
on 2 cores."""


def marked_pids(mark: str) -> list[int]:
    """Live processes that inherited ``MARK_ENV=mark``: the script and all it started."""
    pids = (int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit())
    return [pid for pid in pids if environ_of(pid).get(MARK_ENV) == mark]


def run_script(*args: str) -> tuple[int, str, str, float]:
    """The script's status, stdout, stderr and seconds; killed (SIGTERM, then SIGKILL to
    its group and everything marked) if it runs over ``DEADLINE_S``."""
    mark = uuid.uuid4().hex
    env = {**os.environ, MARK_ENV: mark, "PYTHONUNBUFFERED": "1"}
    began = time.monotonic()
    proc = subprocess.Popen([sys.executable, str(SCRIPT), *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        try:
            out, err = proc.communicate(timeout=DEADLINE_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)  # its checks' cleanup runs on SIGTERM
            try:
                out, err = proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                out, err = proc.communicate()
            pytest.fail(f"gpu_check.py ran over {DEADLINE_S:.0f}s:\n{out}\n{err[-6000:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        leftovers = marked_pids(mark)
        signal_pids(leftovers, signal.SIGKILL)
    assert not leftovers, f"processes left running: {leftovers}\n{err[-6000:]}"
    return proc.returncode, out, err, time.monotonic() - began


def table(out: str) -> list[list[str]]:
    """The table's rows after its header, as cells."""
    lines = out.splitlines()
    header = lines.index("| check | result | measured | seconds |")
    rows = []
    for line in lines[header + 2:]:
        if not line.startswith("| "):
            break
        rows.append([cell.strip() for cell in line.strip("|").split(" | ")])
    return rows


@pytest.mark.timeout(DEADLINE_S + 60)
def test_cpu_mode_passes_every_check_that_runs_and_skips_the_gpu_ones() -> None:
    code, out, err, seconds = run_script("--cpu")
    assert code == 0, f"exit {code}:\n{out}\n{err[-8000:]}"
    assert "No GPU (--cpu given)" in out, out
    assert re.search(r"^GPU check, \d{4}-\d\d-\d\d: \d+ CPUs \(.+\), no GPU, torch \S+, "
                     r"Python \S+; \d+s in all", out, re.MULTILINE), out
    rows = table(out)
    assert all(len(row) == 4 for row in rows), rows
    ran = [row for row in rows if row[1] != "SKIP (no GPU)"]
    skipped = [row for row in rows if row[1] == "SKIP (no GPU)"]
    numbers = [f"{n}." for n in range(1, 6)]
    assert [row[0].split()[0] for row in ran] == numbers, rows
    assert [row[0].split()[0] for row in skipped] == numbers, rows
    for check, result, measured, secs in ran:
        assert result == "PASS", f"{check}: {result}: {measured}\n{err[-8000:]}"
        assert "CPU" in check and measured and float(secs) > 0, (check, measured, secs)
    for check, _, _, secs in skipped:
        assert ("GPU" in check or "NCCL" in check or "CUDA" in check) and secs == "-", check
    print(f"gpu_check.py --cpu: {seconds:.1f}s\n{out}")
