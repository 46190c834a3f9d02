"""The uninterrupted run a fault-free world size is compared with, cached by its arguments.

One torchrun agent with ``--standalone --nproc-per-node=W`` runs the same training
command with no faults and no step delay (the delay is a sleep; it changes no
number). The trainer is bit-exact for a given world size whatever the placement of
its ranks, so its final ``params_sha256`` is what every chaos run at that world
size must end with. Runs are cached: the full matrix needs only a few.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from elastic_ext.jsonlines import read_json_lines
from elastic_ext.local.processes import ProcessSet

logger = logging.getLogger(__name__)


class ReferenceError(RuntimeError):
    """The uninterrupted run did not finish."""


def trainer_args(*, module: str, steps: int, global_batch_size: int, seed: int, snapshot_every: int,
                 model_size: str, step_delay: float, metrics: Path, snapshot_dir: Path,
                 extra: Sequence[str] = ()) -> list[str]:
    """``-m MODULE`` (a script, for a ``module`` ending in ``.py``, through the warm-start
    launcher, as users run one) and the trainer contract's flags (``python -m trainer
    --help``)."""
    program = ["-m", "elastic_ext.warm", module] if module.endswith(".py") else ["-m", module]
    return [*program, "--steps", str(steps), "--global-batch-size", str(global_batch_size),
            "--seed", str(seed), "--snapshot-every", str(snapshot_every),
            "--model-size", model_size, "--step-delay", f"{step_delay:g}",
            "--metrics", str(metrics), "--snapshot-dir", str(snapshot_dir),
            *extra]


def cache_key(args: Sequence[str], world_size: int) -> str:
    """Arguments that change the numbers (not the paths, not the delay), plus torch's version."""
    kept: list[str] = []
    skip = {"--metrics", "--snapshot-dir", "--step-delay"}
    items = list(args)
    i = 0
    while i < len(items):
        if items[i] in skip:
            i += 2
            continue
        kept.append(items[i])
        i += 1
    blob = json.dumps({"args": kept, "world_size": world_size, "torch": torch.__version__})
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def _with(args: Sequence[str], flag: str, value: str) -> list[str]:
    items = list(args)
    at = items.index(flag)
    items[at + 1] = value
    return items


def reference_sha(args: Sequence[str], world_size: int, workdir: Path, *, cache_dir: Path | None,
                  timeout: float = 300.0) -> str:
    """The final params_sha256 of an uninterrupted run of ``args`` at ``world_size``."""
    key = cache_key(args, world_size)
    cached = cache_dir / f"{key}.json" if cache_dir is not None else None
    if cached is not None and cached.exists():
        return str(json.loads(cached.read_text())["params_sha256"])
    run_dir = workdir / f"reference-{key}"
    metrics = run_dir / "metrics.jsonl"
    cmd_args = _with(_with(_with(args, "--metrics", str(metrics)), "--snapshot-dir",
                           str(run_dir / "snapshots")), "--step-delay", "0")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={world_size}", "--max-restarts=0", "--monitor-interval=0.1",
           *cmd_args]
    env = dict(os.environ, OMP_NUM_THREADS="1", LOGLEVEL="WARNING")
    processes = ProcessSet(run_dir / "logs")
    logger.info("reference run at world size %d in %s", world_size, run_dir)
    try:
        proc = processes.spawn("reference", cmd, env=env)
        code = proc.wait(timeout)
    except Exception as exc:
        raise ReferenceError(f"the uninterrupted run did not finish in {timeout:g}s: "
                             f"{exc}") from exc
    finally:
        processes.cleanup()
    done = [e for e in read_json_lines(metrics) if e.get("event") == "done"]
    if code != 0 or not done:
        raise ReferenceError(f"the uninterrupted run exited with {code}; its log: "
                             f"{proc.log}\n{proc.output()[-2000:]}")
    sha = str(done[-1]["params_sha256"])
    if cached is not None:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"params_sha256": sha, "world_size": world_size,
                                   "args": list(args)}))
        tmp.replace(cached)
    return sha
