"""Preemption and stops with real torchrun agents and workers (stock c10d rendezvous, gloo).

- SIGUSR2 to the agent with ``--signals-to-handle`` including SIGUSR2: torchrun forwards
  it to the workers; a snapshot at the next step boundary, a ``preempted`` event,
  workers exit 0; the next start resumes from exactly that step and ends bit-exact with
  an uninterrupted run.
- A worker that only learned of the stop from its peers waits for its own signal: one
  that gets it exits 0, one that does not exits non-zero after the hold (one 3-rank run).
- SIGTERM while a peer is frozen: the worker leaves within the grace, not after 30 s.

Gone because another test proves what they did:

- SIGUSR2 sent to the workers themselves (SLURM ``--signal=USR2@N`` without ``B:``):
  ``tests/test_handoff_e2e.py``'s three-rank test sends SIGUSR2 to every worker, its
  agents exit 0, one ``preempted`` event, no step past it, its snapshot on disk, and a
  new job resumes there with nothing redone and ends bit-exact; the SLURM preemption
  test (``tests/test_deploy_slurm.py``) does it through SLURM. The worker's side under the
  stock agent is the SIGUSR2-to-the-agent test here (the agent only forwards it).
- A peer's death under an agent that listens for fault reports (the survivor reports,
  holds until its agent stops it, exits at once; bit-exact after the restart): the real
  run of ``tests/test_trainer_progress.py``, which was the same job (2 workers,
  ``--max-restarts=1``, rank 1 SIGKILLed after a snapshot) and now carries every
  assertion of it.
"""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import pytest

from elastic_ext.jsonlines import read_json_lines
from elastic_ext.local.processes import ProcessSet, signal_pids, wait_until
from tests.support.trainer_runs import (
    BASE_ARGS,
    env,
    exit_lines,
    finish,
    of,
    pid_gone,
    reference,
    run_to_end,
    torchrun_cmd,
    wait_event,
    worker_pids,
)

pytestmark = pytest.mark.slow  # starts torchrun agents

HANDLE_USR2 = ("--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR2", "--shutdown-timeout=60")


def _torchrun_has(flag: str) -> bool:
    from torch.distributed.run import get_args_parser

    return any(flag in action.option_strings for action in get_args_parser()._actions)


def _job(tmp_path: Path) -> tuple[Path, list[str]]:
    metrics = tmp_path / "m.jsonl"
    return metrics, [*BASE_ARGS, "--snapshot-dir", str(tmp_path / "snaps"), "--snapshot-every", "5",
                     "--metrics", str(metrics)]


def _check_preempted_then_resume(processes: ProcessSet, tmp_path: Path, metrics: Path,
                                 args: list[str], ref_sha: str) -> int:
    """The run stopped with a durable snapshot at its last step; a new start resumes exactly
    there."""
    evs = read_json_lines(metrics)
    preempted = of(evs, "preempted")
    assert len(preempted) == 1, evs[-5:]
    k = preempted[0]["step"]
    assert max(e["step"] for e in of(evs, "step")) == k  # nothing ran past the agreed boundary
    assert k in [e["step"] for e in of(evs, "snapshot")]
    assert evs[-1]["event"] == "preempted"

    run_to_end(processes, "resume", torchrun_cmd(2, *args), timeout=90)
    evs = read_json_lines(metrics)
    start = of(evs, "start")[-1]
    assert start["resumed_from"] == k
    after = [e["step"] for e in evs[evs.index(start):] if e["event"] == "step"]
    assert after == list(range(k + 1, 41))  # no step lost, none repeated
    assert of(evs, "done")[-1]["params_sha256"] == ref_sha
    return k


@pytest.mark.timeout(150)
@pytest.mark.skipif(not (_torchrun_has("--signals-to-handle")
                         and _torchrun_has("--shutdown-timeout")),
                    reason="torchrun has --signals-to-handle since torch 2.10, "
                           "--shutdown-timeout since 2.12")
def test_sigusr2_to_the_agent(processes: ProcessSet, tmp_path: Path) -> None:
    """torchrun forwards SIGUSR2 to the workers, waits for them, then exits 1.

    With SIGUSR2 in ``--signals-to-handle`` the agent turns it into a SignalException:
    it sends SIGUSR2 to each worker's process group, waits up to ``--shutdown-timeout``
    for them (they commit and exit 0 well before), and then re-raises the exception,
    so torchrun itself always ends with status 1 after a handled signal (torch 2.13).
    """
    ref = reference(processes, tmp_path, 2)
    metrics, args = _job(tmp_path)
    agent = processes.spawn("agent",
                            torchrun_cmd(2, *args, "--step-delay", "0.1", agent_args=HANDLE_USR2),
                            env=env())
    wait_event(metrics, lambda e: e["event"] == "step" and e["step"] >= 8, 60, agent, "step 8")
    worker_pids(agent, 2)
    sent = time.monotonic()
    agent.popen.send_signal(signal.SIGUSR2)
    code = finish(agent, 30)
    elapsed = time.monotonic() - sent
    log = agent.output()
    assert sorted(exit_lines(agent)) == [(0, 0), (1, 0)], log[-4000:]
    assert log.count("closing signal SIGUSR2") == 2
    assert "forcefully exiting" not in log  # no worker needed SIGKILL
    assert code == 1 and "SignalException" in log
    assert elapsed < 20  # the agent returned as soon as its workers had, not after the 60 s timeout
    _check_preempted_then_resume(processes, tmp_path, metrics, args, ref.sha256)


@pytest.mark.timeout(120)
def test_a_worker_told_by_its_peers_waits_for_its_own_signal(processes: ProcessSet,
                                                             tmp_path: Path) -> None:
    """Rank 0 is signalled. Ranks 1 and 2 learn of the stop from it and hold: rank 1 gets
    its own signal later and exits 0, rank 2 gets none and exits non-zero after the hold."""
    metrics, args = _job(tmp_path)
    agent = processes.spawn("agent", torchrun_cmd(3, *args, "--step-delay", "0.1",
                                                  "--hold-timeout", "5"), env=env())
    wait_event(metrics, lambda e: e["event"] == "step" and e["step"] >= 6, 60, agent, "step 6")
    workers = worker_pids(agent, 3)
    signal_pids([workers[0]], signal.SIGUSR2)
    wait_event(metrics, lambda e: e["event"] == "preempted", 30, agent, "preempted")
    wait_until(lambda: all(f"[rank {rank}] INFO elastic_ext.worker.preemption: a peer was signalled"
                           in agent.output() for rank in (1, 2)),
               timeout=10, what="ranks 1 and 2 holding")
    assert not pid_gone(workers[1])  # holding, not exited 0 behind its agent's back
    signal_pids([workers[1]], signal.SIGUSR2)
    assert finish(agent, 30) != 0  # torchrun sees rank 2's failure
    log = agent.output()
    assert sorted(exit_lines(agent)) == [(0, 0), (1, 0), (2, 1)], log[-4000:]
    # torchrun's own verdict: rank 2 failed, no other rank did
    assert re.search(r"rank +: 2 \(local_rank: 2\)", log) and "<NO_OTHER_FAILURES>" in log
    assert log.count("no signal reached this worker within 5s") == 1
    assert ("[rank 2] ERROR elastic_ext.worker.preemption: no signal reached this worker "
            "within 5s") in log
    preempted = of(read_json_lines(metrics), "preempted")[0]
    assert preempted["step"] in [e["step"] for e in of(read_json_lines(metrics), "snapshot")]


@pytest.mark.timeout(90)
def test_sigterm_with_a_frozen_peer_leaves_within_the_grace(processes: ProcessSet,
                                                            tmp_path: Path) -> None:
    metrics, args = _job(tmp_path)
    agent = processes.spawn("agent", torchrun_cmd(2, *args, "--step-delay", "0.05"), env=env())
    wait_event(metrics, lambda e: e["event"] == "step" and e["step"] >= 5, 60, agent, "step 5")
    workers = worker_pids(agent, 2)
    signal_pids([workers[1]], signal.SIGSTOP)  # frozen: rank 0 blocks in its next collective
    sent = time.monotonic()
    agent.popen.send_signal(signal.SIGTERM)  # as at a restart: the agent SIGTERMs its workers
    wait_until(lambda: pid_gone(workers[0]), timeout=20, what="rank 0 to exit")
    elapsed = time.monotonic() - sent
    assert elapsed < 3.0 + 2.5, f"rank 0 took {elapsed:.1f}s"  # the 3 s grace, not torch's 30 s
    assert "the step boundary was not reached within 3.0s" in agent.output()
    assert (0, 128 + signal.SIGTERM) in exit_lines(agent)
