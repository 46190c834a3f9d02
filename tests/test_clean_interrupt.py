"""Ctrl-C (or SIGTERM) of the README's main job: the workers save, torchrun ends in one
line, no traceback, and the same command resumes. A ``--rdzv-conf`` torchrun cannot build
the handler with ends in one line too."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

from elastic_ext.control_channel import node_memory_directory
from elastic_ext.jsonlines import read_json_lines
from elastic_ext.local.processes import ProcessSet
from elastic_ext.net import free_port
from elastic_ext.torch_compat import STOPPED_LINE
from tests.support.trainer_runs import env, finish, of, wait_event

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def readme_job(tmp: Path, port: int) -> list[str]:
    """The README's main job (fewer steps), on an embedded store of its own."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2",
            "--nproc-per-node=2", "--rdzv-backend=etcd-ext",
            f"--rdzv-endpoint=c10d://127.0.0.1:{port}", "--rdzv-id=demo", "-m", "trainer",
            "--steps", "300", "--snapshot-dir", str(tmp / "snapshots"), "--snapshot-every", "50",
            "--metrics", str(tmp / "metrics.jsonl"), "--step-delay", "0.01"]


# Ctrl-C only: torch's agent turns SIGTERM into the same SignalException, which takes the
# same path (tests/test_torch_compat.py checks that it still does).
@pytest.mark.parametrize("sig", [signal.SIGINT], ids=["ctrl-c"])
def test_a_stop_saves_ends_in_one_line_and_the_same_command_resumes(
        processes: ProcessSet, tmp_path: Path, sig: signal.Signals) -> None:
    metrics = tmp_path / "metrics.jsonl"
    first = processes.spawn("first", readme_job(tmp_path, free_port("127.0.0.1")), env=env())
    wait_event(metrics, lambda e: e["event"] == "step" and e["step"] >= 60, 120, first, "step 60")
    os.killpg(first.pid, sig)  # what a terminal's Ctrl-C does: torchrun's whole group
    code = finish(first, 60)
    output = first.output()
    assert code == 1, output[-3000:]  # torchrun's own status after a signal (torch's choice)
    assert "Traceback" not in output, output[-3000:]
    assert output.count(STOPPED_LINE.format(signal=sig.name)) == 1, output[-3000:]
    # torch skips the rendezvous shutdown after a signal; what the node kept in memory
    # goes with the agent all the same
    assert not list(node_memory_directory().glob(f"elastic-ext-ctl-{first.pid}-*"))
    preempted = of(read_json_lines(metrics), "preempted")
    assert len(preempted) == 1 and preempted[0]["signal"] == sig.name
    saved = preempted[0]["step"]
    assert saved in [e["step"] for e in of(read_json_lines(metrics), "snapshot")]

    second = processes.spawn("second", readme_job(tmp_path, free_port("127.0.0.1")), env=env())
    assert finish(second, 120) == 0, second.output()[-3000:]
    events = read_json_lines(metrics)
    assert of(events, "start")[-1]["resumed_from"] == saved
    assert of(events, "done")[-1]["step"] == 300


@pytest.mark.parametrize("conf, message", [
    ("heartbeat_interval=abc", "--rdzv-conf heartbeat_interval='abc' is not a number"),
    ("metrics_port=9", "--rdzv-conf metrics_port needs prometheus-client"),
], ids=["bad-number", "metrics-without-prometheus-client"])
def test_a_bad_rdzv_conf_ends_torchrun_in_one_line_naming_the_fix(
        processes: ProcessSet, tmp_path: Path, conf: str, message: str) -> None:
    no_prometheus = tmp_path / "shadow" / "prometheus_client"
    no_prometheus.mkdir(parents=True)  # as if not installed: its import fails
    (no_prometheus / "__init__.py").write_text("raise ImportError('not installed')\n")
    agent = processes.spawn("agent", [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--rdzv-backend=etcd-ext",
        f"--rdzv-endpoint=c10d://127.0.0.1:{free_port('127.0.0.1')}", f"--rdzv-conf={conf}",
        "-m", "trainer", "--steps", "1"], env=env(PYTHONPATH=str(no_prometheus.parent)))
    code = finish(agent, 60)
    output = agent.output()
    assert code == 1, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    last = output.strip().splitlines()[-1]
    assert last.startswith("torchrun --rdzv-backend=etcd-ext: ") and message in last, output
