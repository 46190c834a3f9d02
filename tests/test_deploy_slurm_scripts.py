"""deploy/slurm's per-node scripts on their own: no SLURM lab.

torchrun-node.sh, with a stub in place of torchrun, refuses to start torchrun when
``--nnodes`` is missing (torchrun's default ``1:1`` would make every node train alone at
world size 1 under the same run id) or does not fit the torchrun agents of the srun step
(MAX below their count, MIN above it); a call that fits replaces the wrapper with torchrun
(``exec``: the same process). etcd-member.sh, with a real one-member etcd on loopback,
tells its node's address, runs its member through a preemption notice, and removes the
member's data when it is stopped.
"""

from __future__ import annotations

import os
import signal
import subprocess
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from elastic_ext.local.processes import ProcessSet, wait_until
from elastic_ext.net import free_ports

WRAPPER = Path(__file__).resolve().parent.parent / "deploy" / "slurm" / "torchrun-node.sh"
MEMBER = WRAPPER.with_name("etcd-member.sh")
STUB = """#!/bin/sh
{ echo "pid=$$"; echo "omp=$OMP_NUM_THREADS"; for a in "$@"; do echo "arg=$a"; done; } > "$STUB_OUT"
"""


@pytest.fixture
def stub(tmp_path: Path) -> Path:
    path = tmp_path / "torchrun"
    path.write_text(STUB)
    path.chmod(0o755)
    return path


@dataclass
class Run:
    code: int
    err: str
    ran: bool = False  # torchrun (the stub) was started
    exec: bool = False  # ... in the wrapper's own process
    args: list[str] = field(default_factory=list)
    omp: str = ""

    def refusal(self) -> str:
        """The wrapper's one line of refusal (its lines start with ``[torchrun-node``)."""
        lines = [line for line in self.err.splitlines() if line.startswith("[torchrun-node ")]
        assert len(lines) == 1, self.err
        return lines[0]


def wrapper(stub: Path, args: list[str], **slurm: str) -> Run:
    """Run the wrapper as srun would on one node, ``slurm`` its SLURM_* variables."""
    out = stub.parent / "stub.out"
    out.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "PET_", "ELASTIC_EXT_", "OMP_"))}
    env.update(ELASTIC_EXT_TORCHRUN=str(stub), ELASTIC_EXT_LOCAL_ADDR="10.9.8.7",
               STUB_OUT=str(out), **slurm)
    proc = subprocess.Popen(["bash", str(WRAPPER), *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    _, err = proc.communicate(timeout=30)
    run = Run(proc.returncode, err)
    if out.exists():
        lines = [line.partition("=") for line in out.read_text().splitlines()]
        run.ran = True
        run.exec = ("pid", "=", str(proc.pid)) in lines
        run.args = [value for key, _, value in lines if key == "arg"]
        run.omp = next(value for key, _, value in lines if key == "omp")
    return run


STEP = {"SLURM_STEP_NUM_TASKS": "2", "SLURM_JOB_NUM_NODES": "2", "SLURM_NNODES": "2",
        "SLURM_JOB_ID": "77"}
TRAINER = ["-m", "trainer", "--steps", "10"]
FIX = "pass --nnodes=MIN:MAX with MIN <= 2 <= MAX"


def test_a_missing_nnodes_is_refused_before_torchrun_starts(stub: Path) -> None:
    run = wrapper(stub, ["--nproc-per-node=1", "--rdzv-backend=etcd-ext", *TRAINER], **STEP)
    line = run.refusal()
    assert run.code == 2 and not run.ran, run.err
    assert "--nnodes is missing: torchrun would take 1:1" in line
    assert "(SLURM_STEP_NUM_TASKS=2) would train alone at world size 1" in line and FIX in line


def test_the_trainers_own_nnodes_is_not_taken_for_torchruns(stub: Path) -> None:
    """What follows the script or ``-m module`` is the trainer's, whatever its names."""
    for args in ([*TRAINER, "--nnodes", "2"], ["train.py", "--nnodes=2"],
                 ["--no-python", "python3", "--nnodes=2"]):
        run = wrapper(stub, args, **STEP)
        assert run.code == 2 and not run.ran, args
        assert "--nnodes is missing" in run.refusal(), args


REFUSED = [
    ("--nnodes=1:1", "--nnodes=1:1 does not match the 2 torchrun agents of this step "
                     "(SLURM_STEP_NUM_TASKS=2): MAX 1 < 2 would leave 1 of them out of every "
                     "round"),
    ("--nnodes 1", "--nnodes=1 does not match the 2 torchrun agents of this step "
                   "(SLURM_STEP_NUM_TASKS=2): MAX 1 < 2"),
    ("--nnodes=3:4", "--nnodes=3:4 does not match the 2 torchrun agents of this step "
                     "(SLURM_STEP_NUM_TASKS=2): MIN 3 > 2, no round could ever start"),
    ("--nnodes 3", "MIN 3 > 2"),
    ("--nnodes=two", "--nnodes=two is not N or MIN:MAX"),
    ("--nnodes=", "--nnodes= is not N or MIN:MAX"),
    ("--nnodes=2:1", "--nnodes=2:1 is not a range (1 <= MIN <= MAX)"),
    ("--nnodes=0", "--nnodes=0 is not a range (1 <= MIN <= MAX)"),
]


@pytest.mark.parametrize(("nnodes", "why"), REFUSED, ids=[nnodes for nnodes, _ in REFUSED])
def test_an_nnodes_that_does_not_fit_the_step_is_refused(stub: Path, nnodes: str,
                                                         why: str) -> None:
    run = wrapper(stub, [*nnodes.split(), *TRAINER], **STEP)
    line = run.refusal()
    assert run.code == 2 and not run.ran, run.err
    assert why in line and FIX in line, line


@pytest.mark.parametrize("nnodes", [
    "--nnodes=1:2",  # what elastic.sbatch passes: $ELASTIC_EXT_MIN_NODES:$SLURM_JOB_NUM_NODES
    "--nnodes 1:2", "--nnodes=2", "--nnodes 2", "--nnodes=2:2",
    "--nnodes=1:8",  # room for nodes that join later
    "--nn=2", "--nnode 1:2",  # torchrun's argparse takes unique prefixes
    "--nnodes=1 --nnodes=1:2",  # the last one counts, as in argparse
])
def test_an_nnodes_that_fits_the_step_execs_torchrun_with_every_argument(
        stub: Path, nnodes: str) -> None:
    args = ["--max-restarts", "3", *nnodes.split(), "--rdzv-id", "77", *TRAINER]
    run = wrapper(stub, args, **STEP)
    assert run.code == 0 and run.ran, run.err
    assert run.args == ["--local-addr=10.9.8.7", *args]
    assert run.exec, "torchrun did not run in the wrapper's process (no exec)"


def test_the_count_is_the_steps_tasks_then_the_jobs_nodes(stub: Path) -> None:
    # a step over part of the allocation (an etcd node kept out of it, say)
    run = wrapper(stub, ["--nnodes=3", *TRAINER], SLURM_STEP_NUM_TASKS="3",
                  SLURM_JOB_NUM_NODES="4", SLURM_NNODES="4")
    assert run.code == 0 and run.ran, run.err
    run = wrapper(stub, ["--nnodes=1:3", *TRAINER], SLURM_JOB_NUM_NODES="4", SLURM_NNODES="4")
    assert run.code == 2 and "(SLURM_JOB_NUM_NODES=4): MAX 3 < 4" in run.refusal()
    run = wrapper(stub, ["--nnodes=1:3", *TRAINER], SLURM_NNODES="4")
    assert run.code == 2 and "(SLURM_NNODES=4): MAX 3 < 4" in run.refusal()


def test_torchruns_pet_nnodes_counts_as_given(stub: Path) -> None:
    run = wrapper(stub, TRAINER, PET_NNODES="1:2", **STEP)
    assert run.code == 0 and run.ran, run.err
    run = wrapper(stub, TRAINER, PET_NNODES="1", **STEP)
    assert run.code == 2 and not run.ran and "PET_NNODES=1 does not match" in run.refusal()
    run = wrapper(stub, ["--nnodes=2", *TRAINER], PET_NNODES="1", **STEP)
    assert run.code == 0 and run.ran, run.err  # the option wins, as in torchrun


def test_values_given_with_a_space_are_skipped_and_set_the_threads(stub: Path) -> None:
    args = ["--nproc-per-node", "2", "-r", "3", "-t3", "--standalone", "--nnodes", "2", *TRAINER]
    run = wrapper(stub, args, SLURM_CPUS_ON_NODE="8", **STEP)
    assert run.code == 0 and run.ran, run.err
    assert run.omp == "4"  # 8 CPUs / 2 workers


def test_outside_slurm_nothing_is_checked(stub: Path) -> None:
    run = wrapper(stub, TRAINER)
    assert run.code == 0 and run.ran and run.exec, run.err


def member_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "ELASTIC_EXT_"))}
    env.update(SLURMD_NODENAME="node7", SLURM_JOB_ID="77", **extra)
    return env


def test_the_member_script_tells_its_nodes_name_and_address() -> None:
    out = subprocess.run(["bash", str(MEMBER), "addr"], capture_output=True, text=True,
                         env=member_env(ELASTIC_EXT_LOCAL_ADDR="10.9.8.7"), timeout=30)
    assert (out.returncode, out.stdout) == (0, "node7 10.9.8.7\n"), out.stderr
    out = subprocess.run(["bash", str(MEMBER), "addr"], capture_output=True, text=True,
                         env=member_env(ELASTIC_EXT_LOCAL_ADDR="127.0.1.1"), timeout=30)
    assert out.returncode == 2 and not out.stdout, out.stderr
    assert "[etcd-member node7 " in out.stderr and "set ELASTIC_EXT_IFNAME" in out.stderr


def test_a_node_that_is_not_in_the_cluster_runs_no_member(tmp_path: Path) -> None:
    out = subprocess.run(["bash", str(MEMBER), "run", "2379", "token",
                          "node1=http://10.0.0.1:2380,node2=http://10.0.0.2:2380"],
                         capture_output=True, text=True, timeout=30,
                         env=member_env(TMPDIR=str(tmp_path)))
    assert out.returncode == 2, out.stderr
    assert "node7" in out.stderr and "is not a member of the job's etcd cluster" in out.stderr
    assert not list(tmp_path.iterdir())


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as reply:
            return b'"health":"true"' in reply.read()
    except OSError:
        return False


@pytest.mark.etcd
@pytest.mark.timeout(90)
@pytest.mark.parametrize("stop", [signal.SIGUSR1, signal.SIGTERM], ids=["USR1", "TERM"])
def test_a_member_outlives_a_preemption_notice_and_takes_its_data_when_stopped(
        processes: ProcessSet, tmp_path: Path, stop: signal.Signals) -> None:
    """USR1 is how elastic.sbatch stops its members (srun passes it on), TERM how scancel and
    the end of the job do; USR2, a preemption notice, must not stop etcd under the agents."""
    client, peer = free_ports(2, "127.0.0.1")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    member = processes.spawn("member", [
        "bash", str(MEMBER), "run", str(client), "elastic-ext-77-0",
        f"node7=http://127.0.0.1:{peer}"], env=member_env(TMPDIR=str(scratch)))
    wait_until(lambda: healthy(client), 30, 0.1, "the member to answer /health")
    data = list(scratch.glob("elastic-ext-etcd-77-node7.*"))
    assert len(data) == 1 and data[0].is_dir(), member.output()
    assert "clients at http://127.0.0.1:" in member.output()

    member.send(signal.SIGUSR2)  # SLURM signals every process of the step: script and etcd
    wait_until(lambda: healthy(client), 10, 0.1, "the member to answer after USR2")
    assert member.popen.poll() is None, member.output()

    member.send(stop)
    assert member.wait(timeout=20) == 0, member.output()
    assert f"stopping on {stop.name}" in member.output()
    assert not list(scratch.iterdir()), "the member left its data behind"
    wait_until(lambda: not member.pids(), 10, 0.1, "etcd to be gone")


def test_the_doctor_step_runs_the_doctor_on_the_same_line_and_address(stub: Path) -> None:
    """elastic.sbatch's preflight step: the wrapper execs the doctor instead of torchrun,
    with the same arguments and the same --local-addr."""
    args = ["--nnodes=1:2", "--rdzv-id", "77", *TRAINER]
    doctor = stub.with_name("doctor-stub")
    doctor.write_text(STUB)
    doctor.chmod(0o755)
    run = wrapper(stub, args, **STEP, ELASTIC_EXT_NODE_STEP="doctor",
                  ELASTIC_EXT_DOCTOR_CMD=f"{doctor} doctor")
    assert run.code == 0 and run.ran and run.exec, run.err
    assert run.args == ["doctor", "--local-addr=10.9.8.7", *args]


def test_the_batch_script_runs_the_doctor_first_unless_switched_off() -> None:
    script = WRAPPER.with_name("elastic.sbatch").read_text()
    doctor = script.index('ELASTIC_EXT_NODE_STEP=doctor srun')
    assert script.index('if [ "${ELASTIC_EXT_DOCTOR:-1}" != 0 ]') < doctor
    assert doctor < script.index('srun --ntasks-per-node=1 --no-kill')  # before torchrun's step
