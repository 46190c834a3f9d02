"""Rendezvous time: 3 local torchrun agents on stock c10d and on etcd-ext, in one run.

For each backend and ``--nnodes`` range, starts 3 agents at once (one gloo worker
each, the bundled trainer for one step) and measures, from the agents' logs, the time
from the first agent entering the rendezvous ("Rendezvous'ing worker group") to the
last agent completing a round of all 3 nodes. Also the wall time from spawning the
agents to all of them exiting.

Usage: python benchmarks/rendezvous.py [--reps 3]
"""

from __future__ import annotations

import argparse
import datetime as dt
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

from elastic_ext.local.job import JobSpec, LocalJob

_STAMP = r"I(\d{2})(\d{2}) (\d\d:\d\d:\d\d\.\d+) +\d+ \S+\] "


def _times(log: str, pattern: str) -> list[float]:
    year = dt.datetime.now(dt.timezone.utc).year
    out = []
    for month, day, clock in re.findall(_STAMP + pattern, log):
        stamp = dt.datetime.strptime(f"{year}-{month}-{day} {clock}", "%Y-%m-%d %H:%M:%S.%f")
        out.append(stamp.replace(tzinfo=dt.timezone.utc).timestamp())
    return out


def group_rendezvous_seconds(logs: list[str]) -> float:
    """From the first agent entering the rendezvous to the last one in a round of all 3."""
    began = [t for log in logs for t in _times(log, r"\[default\] Rendezvous'ing worker group")]
    done = [_times(log, r"  group_world_size=3") for log in logs]
    if not began or not all(done):
        raise RuntimeError("agent logs lack the rendezvous lines (is LOGLEVEL=INFO set?)")
    return max(d[0] for d in done) - min(began)


def one_run(store: str, nnodes: str, workdir: Path) -> tuple[float, float]:
    command = ["-m", "trainer", "--steps", "1", "--global-batch-size", "6", "--seed", "1"]
    spec = JobSpec(command=command, store=store, nnodes=nnodes, run_id="rdzv-bench")
    started = time.monotonic()
    with LocalJob(spec, workdir).start(3) as job:
        codes = job.wait(timeout=180)
        wall = time.monotonic() - started
        if codes != [0, 0, 0]:
            raise RuntimeError(f"{store} {nnodes}: agents exited {codes}:\n"
                               + job.nodes[0].proc.output()[-3000:])
        return group_rendezvous_seconds([n.proc.output() for n in job.nodes]), wall


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args(argv)
    cases = [(s, n) for n in ("3:3", "2:3") for s in ("stock-c10d", "etcd", "embedded")]
    results: dict[tuple[str, str], list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="rdzv-bench-") as tmp:
        for rep in range(args.reps):
            for store, nnodes in cases:
                r = one_run(store, nnodes, Path(tmp) / f"{store}-{nnodes.replace(':', '-')}-{rep}")
                results.setdefault((store, nnodes), []).append(r)
                print(f"  rep {rep + 1}: {store:<10} --nnodes={nnodes}  rendezvous {r[0]:.2f}s  "
                      f"wall {r[1]:.2f}s", file=sys.stderr, flush=True)
    label = {"stock-c10d": "stock c10d", "etcd": "etcd-ext (etcd)",
             "embedded": "etcd-ext (embedded)"}
    print(f"\n3 local agents, one gloo worker each; median of {args.reps} runs (min-max)\n")
    print("| --nnodes | backend | rendezvous of all 3 (s) | spawn to all agents done (s) |")
    print("|---|---|---|---|")
    for store, nnodes in cases:
        rdzv = [r[0] for r in results[(store, nnodes)]]
        wall = [r[1] for r in results[(store, nnodes)]]
        print(f"| {nnodes} | {label[store]} | {statistics.median(rdzv):.2f} ({min(rdzv):.2f}-"
              f"{max(rdzv):.2f}) | {statistics.median(wall):.1f} "
              f"({min(wall):.1f}-{max(wall):.1f}) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
