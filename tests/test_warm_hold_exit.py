"""A foreign script's worker held after a peer's death is out as soon as its agent says so.

pytorch/examples' multinode DDP script (``tests/support/plain_ddp.py``), two ranks on
gloo, run through the launcher (``python -m elastic_ext.warm``) as torchrun would run
them, with this test as rank 0's agent (its control directory). Rank 1 is SIGKILLed
mid-epoch: rank 0's collective fails, the launcher reports the fault as its peer's and
holds. The agent's decision is its SIGTERM; the worker must be gone within 0.1 s of it,
not after the interpreter's teardown of the broken process group (1.1-1.5 s measured
before the hold left through ``os._exit``). No torchrun, etcd or network namespace.

The 0.1 s is the worker's own time: from the signal to its exit, less the time it sat
runnable waiting for a CPU (the kernel's ``run_delay`` in ``/proc/PID/schedstat``, read
from the zombie before it is reaped). On 2 cores shared with another test the wait for
a CPU alone has measured 0.118 s; what the worker does with the CPU is what is tested.
The wait of its other threads, which the kernel ends at the exit, is not in ``run_delay``
(0.104 s measured with 0.000 s of ``run_delay`` beside two end-to-end tests, 0.152 s beside
fast tests, 0.04-0.05 s alone): the test is ``quiet``, run alone.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from elastic_ext.agent.control import AgentControl
from elastic_ext.control_channel import CONTROL_DIR_ENV
from elastic_ext.local.processes import ProcessSet, wait_until
from elastic_ext.net import free_port

pytestmark = [pytest.mark.slow, pytest.mark.quiet, pytest.mark.timeout(120)]

PLAIN_DDP = Path(__file__).parent / "support" / "plain_ddp.py"
OUT_WITHIN_S = 0.1


def _run_delay(pid: int) -> float:
    """Seconds the main thread of ``pid`` has waited runnable for a CPU (zombies too)."""
    return int(Path(f"/proc/{pid}/schedstat").read_text().split()[1]) / 1e9


def _exited_at(pid: int, timeout: float) -> float:
    """``time.monotonic()`` when ``pid`` (a child) exited, leaving it a zombie, unreaped, so
    that its ``/proc`` entry can still be read."""
    exited: list[float] = []

    def wait() -> None:
        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
        exited.append(time.monotonic())
    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    waiter.join(timeout)
    assert exited, f"pid {pid} did not exit within {timeout}s"
    return exited[0]


def _rank_env(rank: int, port: int, control: Path | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != CONTROL_DIR_ENV}
    env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
               PYTHONPATH=str(Path(__file__).parents[1]))
    if control is not None:
        env[CONTROL_DIR_ENV] = str(control)
    return env


def test_a_held_foreign_worker_is_out_within_a_tenth_of_a_second_of_its_agents_signal(
        processes: ProcessSet, tmp_path: Path) -> None:
    agent = AgentControl(tmp_path / "ctl")
    agent.publish_round(1)
    port = free_port("127.0.0.1")
    command = [sys.executable, "-u", "-m", "elastic_ext.warm", str(PLAIN_DDP), "1000", "500",
               "--batch_size", "16"]
    workers = []
    for rank in (0, 1):
        cwd = tmp_path / f"rank{rank}"
        cwd.mkdir()
        workers.append(processes.spawn(f"rank{rank}", command, cwd=cwd,
                                       env=_rank_env(rank, port, agent.path if rank == 0
                                                     else None)))
    survivor, victim = workers
    wait_until(lambda: "Epoch 2 |" in survivor.output(), 60, what="rank 0 in its third epoch")
    os.killpg(victim.pid, signal.SIGKILL)
    wait_until(lambda: agent.fault_reported(1), 30, what="rank 0's report of its peer's fault")
    assert survivor.popen.poll() is None, survivor.output()[-3000:]
    # The agent decides: SIGTERM, as torch's agent stops its workers.
    waited_before = _run_delay(survivor.pid)
    signalled = time.monotonic()
    os.kill(survivor.pid, signal.SIGTERM)
    took = _exited_at(survivor.pid, 30) - signalled
    waited_for_cpu = _run_delay(survivor.pid) - waited_before
    code = survivor.popen.wait(timeout=30)
    out = survivor.output()
    assert code == 128 + signal.SIGTERM, out[-3000:]
    assert "reported to the etcd-ext agent as not this worker's fault" in out, out[-3000:]
    own = took - waited_for_cpu
    assert own <= OUT_WITHIN_S, (f"the held worker took {own:.3f}s of its own to exit "
                                 f"({took:.3f}s, {waited_for_cpu:.3f}s of it waiting for a "
                                 f"CPU):\n{out[-3000:]}")
