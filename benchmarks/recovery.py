"""Recovery benchmark: stock torchrun c10d against etcd-ext, side by side, in one run.

3 local torchrun agents (``--nnodes=2:3``, one gloo worker each) train the bundled
trainer. Each scenario injects one fault and measures the seconds from the fault
to the first training step in the new world:

  dead        SIGKILL a whole node (agent and workers) that is not rank 0
  dead-rank0  SIGKILL the node that hosts group rank 0
  hung        SIGSTOP a whole node that is not rank 0
  scale-up    start a third node while 2 of 2:3 train (from its agent reaching the
              rendezvous, i.e. its "Rendezvous'ing worker group" log line)

Usage: python benchmarks/recovery.py [--reps 3] [--timeout 90] [--stores stock-c10d,etcd]
Prints a table of median / min / max seconds and how many runs never recovered.
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

from elastic_ext.local.job import JobSpec, LocalJob, wait_for_step

SCENARIOS = ("dead", "dead-rank0", "hung", "scale-up")


def rendezvous_reached(log: str) -> float | None:
    """Unix time of the agent's first "Rendezvous'ing worker group" line (glog format, UTC)."""
    match = re.search(r"I(\d{2})(\d{2}) (\d\d:\d\d:\d\d\.\d+) +\d+ \S+\] \[default\] "
                      r"Rendezvous'ing worker group", log)
    if not match:
        return None
    month, day, clock = match.groups()
    year = dt.datetime.now(dt.timezone.utc).year
    stamp = dt.datetime.strptime(f"{year}-{month}-{day} {clock}", "%Y-%m-%d %H:%M:%S.%f")
    return stamp.replace(tzinfo=dt.timezone.utc).timestamp()


def one_run(store: str, scenario: str, workdir: Path, timeout: float,
            step_delay: float) -> float | None:
    metrics = workdir / "metrics.jsonl"
    command = ["-m", "trainer", "--steps", "100000", "--global-batch-size", "24",
               "--snapshot-dir", str(workdir / "snapshots"), "--snapshot-every", "20",
               "--metrics", str(metrics), "--step-delay", str(step_delay), "--seed", "1"]
    spec = JobSpec(command=command, store=store, nnodes="2:3", run_id=f"bench-{scenario}",
                   max_restarts=100)
    start_nodes = 2 if scenario == "scale-up" else 3
    with LocalJob(spec, workdir).start(start_nodes) as job:
        wait_for_step(metrics, after=0, world_size=start_nodes, timeout=120)
        fault_at = time.time()
        if scenario == "dead":
            job.other_node(job.rank0_node()).kill()
        elif scenario == "dead-rank0":
            job.rank0_node().kill()
        elif scenario == "hung":
            job.other_node(job.rank0_node()).freeze()
        else:
            node = job.add_node()
        target = 3 if scenario == "scale-up" else 2
        try:
            event = wait_for_step(metrics, after=fault_at, world_size=target, timeout=timeout)
        except TimeoutError:
            return None
        if scenario == "scale-up":
            reached = rendezvous_reached(node.proc.output())
            fault_at = reached if reached is not None else fault_at
        return event["time"] - fault_at


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=90.0,
                        help="seconds after the fault before a run counts as never recovered")
    parser.add_argument("--stores", default="stock-c10d,etcd")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--step-delay", type=float, default=0.05)
    args = parser.parse_args(argv)
    stores, scenarios = args.stores.split(","), args.scenarios.split(",")
    results: dict[tuple[str, str], list[float | None]] = {}
    with tempfile.TemporaryDirectory(prefix="recovery-bench-") as tmp:
        for rep in range(args.reps):
            for scenario in scenarios:
                for store in stores:
                    workdir = Path(tmp) / f"{store}-{scenario}-{rep}"
                    seconds = one_run(store, scenario, workdir, args.timeout, args.step_delay)
                    results.setdefault((store, scenario), []).append(seconds)
                    shown = "never" if seconds is None else f"{seconds:.2f}s"
                    print(f"  rep {rep + 1}: {store:<10} {scenario:<10} {shown}", file=sys.stderr,
                          flush=True)
    label = {"stock-c10d": "stock c10d", "etcd": "etcd-ext (etcd)",
             "embedded": "etcd-ext (embedded)"}
    print(f"\nRecovery: seconds from the fault to the first step in the new world "
          f"({args.reps} runs each, timeout {args.timeout:g}s)\n")
    print("| scenario | backend | median | min | max | never recovered |")
    print("|---|---|---|---|---|---|")
    for scenario in scenarios:
        for store in stores:
            values = results[(store, scenario)]
            ok = [v for v in values if v is not None]
            fmt = (lambda v: f"{v:.1f}") if ok else (lambda v: "-")
            stats = ((fmt(statistics.median(ok)), fmt(min(ok)), fmt(max(ok))) if ok
                     else ("-", "-", "-"))
            print(f"| {scenario} | {label.get(store, store)} | {stats[0]} | {stats[1]} | "
                  f"{stats[2]} | {len(values) - len(ok)} of {len(values)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
