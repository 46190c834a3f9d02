"""Starting real torchrun agents for end-to-end tests."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

from elastic_ext.local.processes import Proc, ProcessSet

SUPPORT = Path(__file__).parent
ALLREDUCE_JOB = SUPPORT / "allreduce_job.py"


def agent_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "LOGLEVEL": "INFO"})
    env.update(extra or {})
    return env


def torchrun(processes: ProcessSet, name: str, *, endpoint: str, run_id: str, nnodes: str,
             script: Sequence[str], backend: str = "etcd-ext", conf: str = "",
             max_restarts: int = 3, nproc: int = 1, extra_args: Sequence[str] = (),
             env: dict[str, str] | None = None) -> Proc:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}",
           f"--nproc-per-node={nproc}", f"--rdzv-backend={backend}", f"--rdzv-endpoint={endpoint}",
           f"--rdzv-id={run_id}", "--local-addr=127.0.0.1", f"--max-restarts={max_restarts}",
           "--monitor-interval=0.1", *extra_args]
    if conf:
        cmd.append(f"--rdzv-conf={conf}")
    cmd += list(script)
    return processes.spawn(name, cmd, env=agent_env(env))
