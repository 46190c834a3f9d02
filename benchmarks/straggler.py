"""Straggler benchmark: one node at a third of its speed, etcd-ext (drop, warn) beside stock
torchrun.

3 local torchrun agents (``--nnodes=2:3``, one gloo worker each; etcd-ext on a local etcd,
stock torchrun on its c10d backend) train the bundled trainer, compute-bound (the small
model, a global batch of 4800, no step delay). Once it trains at full speed, the chaos
harness's ``slow`` fault (``elastic_ext/chaos/throttle.py``) stops and continues the
workers of one node that is not rank 0 so that they run a third of the time. Measured,
per mode:

  named     seconds from the slowdown to the ``slow`` event (etcd-ext; stock: never)
  before    samples/s at full speed, the last ``--window`` seconds before the slowdown
  slowed    samples/s from 1 s after the slowdown to the event (stock: the same length
            of time as the median etcd-ext run's)
  after     samples/s over ``--window`` seconds from the first step without the node
            (drop), or from 1 s after the event (warn), or as long after the slowdown as
            the median drop (stock): the job still slowed where nothing is left out

plus, for etcd-ext, the gain ``straggler=drop`` estimated when it named the node (samples
per second without the node over with it, ``protocol/straggler.py``), and the runs in
which the node was left out. The trainer keeps its global batch whatever the world size,
so a step's samples are the same on two nodes and three: samples/s is steps/s x 4800.

Usage: python benchmarks/straggler.py [--repeats 3] [--quick] [--straggler-for 5]
[--fraction 1/3] [--period-ms 30]. Prints a Markdown table (median and range). Run it on
an otherwise idle machine: a busy one slows every node, and the judge compares them.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if str(Path(__file__).resolve().parent) not in sys.path:  # python -m benchmarks.NAME
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import cell, cpu_model, terminated_by_sigterm  # noqa: E402

from elastic_ext.chaos.inject import Injector  # noqa: E402
from elastic_ext.chaos.scenario import parse  # noqa: E402
from elastic_ext.jsonlines import read_json_lines  # noqa: E402
from elastic_ext.local.job import JobSpec, LocalJob, Node, wait_for_step  # noqa: E402
from elastic_ext.local.processes import wait_until  # noqa: E402
from elastic_ext.rendezvous.agent.events import EventKind  # noqa: E402

MODES = ("drop", "warn", "stock")
LABELS = {"drop": "etcd-ext, straggler=drop", "warn": "etcd-ext, straggler=warn",
          "stock": "stock torchrun (c10d)"}
BATCH, DATASET = 4800, 19200
SETTLE_S = 1.0
"""Seconds after the slowdown, or after the first step on two nodes, before a rate counts:
the steps in flight then are neither one pace nor the other."""


@dataclass
class Outcome:
    named: float | None = None  # seconds from the slowdown to the slow event
    gain: float | None = None  # the gain straggler=drop estimated then
    dropped: bool = False
    rates: dict[str, float] = field(default_factory=dict)  # before, slowed, after: samples/s
    notes: list[str] = field(default_factory=list)


def steps(metrics: Path) -> list[dict[str, Any]]:
    return [e for e in read_json_lines(metrics) if e.get("event") == "step"]


def samples_per_second(metrics: Path, start: float, end: float,
                       world: int | None = None) -> float | None:
    """Samples/s between two unix times, from the trainer's step events (steps after the
    first in the stretch, over the time since it)."""
    times = sorted(float(e["time"]) for e in steps(metrics)
                   if start <= e["time"] <= end and (world is None or e["world_size"] == world))
    if len(times) < 3 or times[-1] <= times[0]:
        return None
    return BATCH * (len(times) - 1) / (times[-1] - times[0])


def node_id(node: Node) -> str | None:
    started = node.events(EventKind.STARTED)
    return str(started[0]["node"]) if started else None


def wait_s(seconds: float) -> None:
    """A stretch of training to measure: time itself is what is waited for."""
    time.sleep(seconds)


def one_run(mode: str, workdir: Path, args: argparse.Namespace,
            stock_named_s: float, stock_after_s: float) -> Outcome:
    """One job of ``mode``; ``stock_*``: how long after the slowdown etcd-ext named the node
    and trained without it (medians so far), where stock torchrun is measured the same."""
    metrics = workdir / "metrics.jsonl"
    command = ["-m", "trainer", "--steps", "1000000", "--global-batch-size", str(BATCH),
               "--dataset-size", str(DATASET), "--seed", "1", "--model-size", "small",
               "--metrics", str(metrics), "--progress-every", "0"]
    conf = "" if mode == "stock" else (f"last_call_timeout=5,straggler={mode},"
                                       f"straggler_for={args.straggler_for:g}")
    spec = JobSpec(command=command, store="stock-c10d" if mode == "stock" else "etcd",
                   nnodes="2:3", run_id=f"bench-straggler-{mode}", max_restarts=0,
                   rdzv_conf=conf)
    outcome = Outcome()
    with LocalJob(spec, workdir).start(3) as job:
        first = wait_for_step(metrics, after=0, world_size=3, timeout=args.timeout)
        wait_s(max(0.0, first["time"] + SETTLE_S + args.window - time.time()))
        victim = next(n for n in job.nodes if n.group_rank() not in (0, None))
        injector = Injector(job, initial_nodes=3, snapshot_dir=workdir)
        fault = parse(f"at step 1: slow node {job.nodes.index(victim)} to {args.fraction} "
                      f"every {args.period_ms:g}ms\n").faults[0]
        record, undo = injector.inject(fault)
        assert undo is not None  # a slowdown lasts until its undo
        slowed_at = record.time
        before = samples_per_second(metrics, slowed_at - args.window, slowed_at, 3)
        if before is not None:
            outcome.rates["before"] = before
        try:
            if mode == "stock":
                wait_s(max(0.0, slowed_at + stock_named_s - time.time()))
                named_at = time.time()
            else:
                name = node_id(victim)
                try:
                    event = wait_until(
                        lambda: next((e for n in job.nodes for e in n.events(EventKind.SLOW)
                                      if e.get("peer") == name), None),
                        args.straggler_for + args.timeout, what="the slow event")
                except TimeoutError:
                    outcome.notes.append(f"{mode}: no slow event in "
                                         f"{args.straggler_for + args.timeout:g}s")
                    return outcome
                named_at = float(event["time"])
                outcome.named, outcome.gain = named_at - slowed_at, float(event["gain"])
                outcome.dropped = bool(event["dropped"])
            slowed = samples_per_second(metrics, slowed_at + SETTLE_S, named_at, 3)
            if slowed is not None:
                outcome.rates["slowed"] = slowed
            if outcome.dropped:
                try:
                    two = wait_for_step(metrics, after=named_at, world_size=2,
                                        timeout=args.timeout)
                except TimeoutError:
                    outcome.notes.append("drop: no step on two nodes after the drop")
                    return outcome
                start = float(two["time"]) + SETTLE_S
            elif mode == "stock":
                start = slowed_at + stock_after_s
            else:
                start = named_at + SETTLE_S
            wait_s(max(0.0, start + args.window - time.time()))
            after = samples_per_second(metrics, start, start + args.window)
            if after is not None:
                outcome.rates["after"] = after
            code = victim.proc.popen.poll()
            if outcome.dropped and code != 0:
                outcome.notes.append(f"drop: the left-out node's agent "
                                     f"{'runs on' if code is None else f'exited {code}'}")
        finally:
            undo.run()
    return outcome


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each mode")
    parser.add_argument("--quick", action="store_true",
                        help="one run of each mode and 3 s windows (about 1.5 minutes)")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--straggler-for", type=float, default=5.0,
                        help="--rdzv-conf straggler_for (seconds; etcd-ext's default is 30)")
    parser.add_argument("--fraction", default="1/3",
                        help="the slowed node's workers run this share of every period")
    parser.add_argument("--period-ms", type=float, default=30.0,
                        help="the stop-and-run cycle of the slow fault")
    parser.add_argument("--window", type=float, default=5.0,
                        help="seconds each rate is measured over (at most)")
    parser.add_argument("--timeout", type=float, default=90.0,
                        help="seconds to wait for the first step, the event, the drop")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.window = 1, 3.0
    modes = args.modes.split(",")
    if not set(modes) <= set(MODES):
        parser.error(f"--modes: choose from {', '.join(MODES)}")
    results: dict[str, list[Outcome]] = {mode: [] for mode in modes}
    with terminated_by_sigterm(), tempfile.TemporaryDirectory(prefix="straggler-bench-") as tmp:
        for rep in range(args.repeats):
            for mode in modes:
                named = [o.named for m in ("drop", "warn") for o in results.get(m, [])
                         if o.named is not None]
                two = [o.named + SETTLE_S for o in results.get("drop", [])
                       if o.named is not None and o.dropped]
                named_s = statistics.median(named) if named else args.straggler_for + 3
                after_s = statistics.median(two) + 1.0 if two else named_s + SETTLE_S
                began = time.monotonic()
                outcome = one_run(mode, Path(tmp) / f"{mode}-{rep}", args, named_s, after_s)
                results[mode].append(outcome)
                shown = ", ".join(f"{k} {v:.0f}" for k, v in outcome.rates.items())
                print(f"  rep {rep + 1}: {mode:<5} named "
                      f"{'never' if outcome.named is None else f'{outcome.named:.1f}s'} "
                      f"dropped {outcome.dropped}; samples/s {shown} "
                      f"({time.monotonic() - began:.0f}s) {' '.join(outcome.notes)}",
                      file=sys.stderr, flush=True)
    print(f"\nStraggler: one node's workers run {args.fraction} of every {args.period_ms:g} ms "
          f"(the chaos harness's slow fault); straggler_for={args.straggler_for:g}s, "
          f"{args.repeats} run(s) per mode, median (range)\n")
    print(f"{dt.date.today()}, {os.cpu_count()} cores ({cpu_model()}), 3 nodes x 1 gloo "
          f"worker, trainer --model-size small --global-batch-size {BATCH}\n")
    print("| mode | slow event after the slowdown (s) | estimated gain | left out | "
          "samples/s before | while slowed | after the drop (or as long after) | "
          "after / while slowed |")
    print("|---|---|---|---|---|---|---|---|")
    for mode in modes:
        outcomes = results[mode]
        named = [o.named for o in outcomes if o.named is not None]
        gains = [o.gain for o in outcomes if o.gain is not None]
        rate = {k: [o.rates[k] for o in outcomes if k in o.rates]
                for k in ("before", "slowed", "after")}
        ratios = [o.rates["after"] / o.rates["slowed"] for o in outcomes
                  if "after" in o.rates and "slowed" in o.rates]
        when = "never" if mode == "stock" else cell(named, 1) + (
            f", never in {len(outcomes) - len(named)}" if len(named) < len(outcomes) else "")
        left = "-" if mode != "drop" else f"{sum(o.dropped for o in outcomes)}/{len(outcomes)}"
        print(f"| {LABELS[mode]} | {when} | {cell(gains, 2) if mode != 'stock' else '-'} | "
              f"{left} | {cell(rate['before'])} | {cell(rate['slowed'])} | "
              f"{cell(rate['after'])} | {cell(ratios, 2)} |")
    notes = [n for mode in modes for o in results[mode] for n in o.notes]
    if notes:
        print("\nNotes:\n" + "\n".join(f"- {n}" for n in notes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
