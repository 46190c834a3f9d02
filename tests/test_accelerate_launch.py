"""``accelerate launch`` with ``--rdzv_backend etcd-ext``: two machines on loopback against a
real etcd, as ``docs/integrations.md`` tells a user to run them.

accelerate runs torch's elastic agent in its own process with its own command line, so
the plugin reads the agent's restart budget and worker command from the agent, not from
``sys.argv`` (``torch_compat``). What only this can prove: the workers under
``-m elastic_ext.warm`` are forked by the warm-start server, and a worker's failure
spends one restart of the job-wide budget that ``--max_restarts`` set, as
``elastic-ext status`` shows, after which the job runs to its end.
"""

from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path

import pytest

from elastic_ext.local.etcd import start_cluster
from elastic_ext.local.processes import ProcessSet, wait_until
from elastic_ext.ops import status as status_command
from tests.support.agents import agent_env

pytestmark = [pytest.mark.slow, pytest.mark.etcd]

JOB = Path(__file__).parent / "support" / "accelerate_job.py"
RUN_ID = "accelerate"


def status(endpoint: str) -> str:
    """What ``elastic-ext status`` prints for the run."""
    parser = argparse.ArgumentParser()
    status_command.add_arguments(parser, "status")
    out = io.StringIO()
    args = parser.parse_args(["--endpoint", endpoint, "--run-id", RUN_ID])
    args.command = "status"  # what the CLI's subcommand parser sets
    status_command.run(args, out)
    return out.getvalue()


@pytest.mark.timeout(240)
def test_accelerate_launch_gets_warm_workers_and_the_job_wide_budget(
        processes: ProcessSet, tmp_path: Path) -> None:
    # machine rank 0 refuses a --main_process_port in use on its own localhost: etcd
    # listens on another loopback address, as the docs say
    etcd = start_cluster(processes, tmp_path / "etcd", host="127.0.0.2")
    endpoint = etcd.members[0].endpoint
    host, _, port = endpoint.rpartition(":")
    marks = tmp_path / "marks"
    marks.mkdir()
    machines = [processes.spawn(f"machine{rank}", [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
        "--num_machines", "2", "--machine_rank", str(rank), "--num_processes", "2",
        "--main_process_ip", host, "--main_process_port", port,
        "--rdzv_backend", "etcd-ext", "--max_restarts", "3",
        "-m", "elastic_ext.warm", str(JOB), str(marks)],
        env=agent_env({"PET_RDZV_ID": RUN_ID})) for rank in (0, 1)]

    def lines() -> list[str]:
        return [line for m in machines for line in m.output().splitlines()
                if line.startswith("ACCELERATE ")]

    def explain() -> str:
        return "\n".join(f"== {m.name}\n{m.output()[-3000:]}" for m in machines)

    try:
        wait_until(lambda: len([x for x in lines() if "world=2" in x]) >= 4, 150,
                   what="two rounds of two workers")
        wait_until(lambda: "restarts: 1 of 3 used" in status(endpoint), 30,
                   what="the budget spent once")
    except TimeoutError as exc:
        raise AssertionError(f"{exc}\n{lines()}\n{explain()}") from None
    assert all("warm=True" in line for line in lines()), lines()
    (marks / "go").touch()
    assert [m.wait(timeout=90) for m in machines] == [0, 0], explain()
