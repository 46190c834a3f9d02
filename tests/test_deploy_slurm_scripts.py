"""deploy/slurm/torchrun-node.sh on its own, with a stub in place of torchrun: no SLURM lab.

The wrapper refuses to start torchrun when ``--nnodes`` is missing (torchrun's default
``1:1`` would make every node train alone at world size 1 under the same run id) or does
not fit the torchrun agents of the srun step (MAX below their count, MIN above it); a
call that fits replaces the wrapper with torchrun (``exec``: the same process).
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest

WRAPPER = Path(__file__).resolve().parent.parent / "deploy" / "slurm" / "torchrun-node.sh"
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
