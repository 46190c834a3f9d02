"""Bit-exact resume: a run SIGKILLed after a snapshot and started again ends as an uninterrupted
one, at 4 ranks (where DDP's bucket layout decides how gloo rounds a sum: see
``trainer.train.settle_buckets``).

4 ranks only: 1 and 2 ranks take the same path with fewer buckets, 2 ranks after a
worker's kill end bit-exact in the chaos matrix's ``kill-worker``, and 3 ranks (an odd
world, the other bucket case) is the 3-node runs of ``tests/test_handoff_e2e.py``, one of
them a whole-job restart from disk, which end bit-exact as well."""

from __future__ import annotations

from pathlib import Path

import pytest

from elastic_ext.jsonlines import read_json_lines
from elastic_ext.local.processes import ProcessSet
from tests.support.trainer_runs import (
    BASE_ARGS,
    env,
    finish,
    of,
    reference,
    run_to_end,
    torchrun_cmd,
    trainer_cmd,
    wait_event,
)

pytestmark = pytest.mark.slow  # starts torchrun agents


@pytest.mark.timeout(150)
@pytest.mark.parametrize("nproc", [4])
def test_killed_run_resumes_bit_exact(processes: ProcessSet, tmp_path: Path, nproc: int) -> None:
    ref = reference(processes, tmp_path, nproc)
    snaps, metrics = tmp_path / "snaps", tmp_path / "m.jsonl"
    args = [*BASE_ARGS, "--snapshot-dir", str(snaps), "--snapshot-every", "5",
            "--metrics", str(metrics)]

    def cmd(*extra: str) -> list[str]:
        return trainer_cmd(*args, *extra) if nproc == 1 else torchrun_cmd(nproc, *args, *extra)

    first = processes.spawn("first", cmd("--step-delay", "0.1"), env=env())
    snap = wait_event(metrics, lambda e: e["event"] == "snapshot" and e["step"] >= 10, timeout=60,
                      proc=first, what="a snapshot at step 10 or later")
    first.kill()  # SIGKILL to the agent and every worker, mid-run
    finish(first, timeout=10)
    evs = read_json_lines(metrics)
    killed_at = max(e["step"] for e in of(evs, "step"))
    assert not of(evs, "done") and killed_at < 40

    run_to_end(processes, "second", cmd(), timeout=90)
    evs = read_json_lines(metrics)
    start = of(evs, "start")[-1]
    newest_durable = max(e["step"] for e in of(evs, "snapshot") if e["step"] <= killed_at)
    assert start["resumed_from"] == newest_durable >= snap["step"]
    second_steps = [e["step"] for e in evs[evs.index(start):] if e["event"] == "step"]
    assert second_steps == list(range(newest_durable + 1, 41))
    assert of(evs, "done")[-1]["params_sha256"] == ref.sha256
