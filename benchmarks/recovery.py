"""Recovery benchmark: stock torchrun c10d, etcd-ext cold and etcd-ext warm, side by side.

3 local torchrun agents (``--nnodes=2:3``, one gloo worker each, etcd-ext on a local
etcd) train the bundled trainer. Each scenario injects one fault and measures the
seconds from the fault to the first training step in the new world:

  dead        SIGKILL a whole node (agent and workers) that is not rank 0
  dead-rank0  SIGKILL the node that hosts group rank 0
  hung        SIGSTOP a whole node that is not rank 0
  stuck       SIGSTOP the training worker (local rank 0) of a node that is not rank 0,
              its agent alive: a hang only step progress shows (stock torchrun waits
              for the collective timeout, which a stopped process never reaches)
  scale-up    start a third node while 2 of 2:3 train (from its agent reaching the
              rendezvous, i.e. its "Rendezvous'ing worker group" log line)
  notice      SIGUSR2 (a preemption notice) to the agent and workers of a node that is
              not rank 0, as one node's own SLURM job gets it
  term-rank0  SIGTERM to the agent alone of the node that hosts group rank 0 (a
              Kubernetes pod deleted)

Modes: ``stock`` (torchrun's own c10d backend), ``cold`` (etcd-ext with
``--rdzv-conf warm_start=off``) and ``warm`` (etcd-ext's default). For etcd-ext the
time is broken down from the agents' events (``events_file``) and the trainer's
``start`` event:

  detect   fault -> the first surviving agent decides to restart (``leaving_round``)
  stop     -> the last survivor is back in the rendezvous, its workers stopped (``restart``)
  round    -> the new round closed (``joined``, rank 0's node)
  spawn    -> the new rank-0 worker's process started (``launched_at``)
  launch   -> its ``main`` runs (``main_at``): the worker start, warm or cold
  pg-init  -> its process group is up (``pg_ready_at``)
  restore  -> its model and optimizer are built and its state restored (``restored_at``)
  step     -> the first step in the new world

``--program examples/own_loop.py`` runs a script on ``ElasticLoop`` instead of the
bundled trainer (it speaks the same flags and events), through the warm-start launcher
(``-m elastic_ext.warm``) as a user runs one.

Usage: python benchmarks/recovery.py [--reps 5] [--stock-reps 2] [--timeout 180]
Prints the totals (median, min, max, runs that never recovered, and how long training
paused: the old world's last step to the new world's first) and the breakdown
(medians). Run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import re
import signal
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elastic_ext.jsonlines import read_json_lines
from elastic_ext.local.job import JobSpec, LocalJob, Node, wait_for_step
from elastic_ext.local.processes import wait_until
from elastic_ext.rendezvous.agent.events import EventKind

SCENARIOS = ("dead", "dead-rank0", "hung", "stuck", "scale-up", "notice", "term-rank0")
MODES = ("stock", "cold", "warm")
PHASES = ("detect", "stop", "round", "spawn", "launch", "pg-init", "restore", "step")


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


@dataclass
class Outcome:
    total: float | None
    phases: dict[str, float] = field(default_factory=dict)
    paused: float | None = None
    """Seconds between the old world's last step and the new world's first: what the
    job lost (for a scale-up, the fault-to-step time also counts the newcomer's start)."""
    victim_exit: tuple[int, float] | None = None
    """For a notice or a SIGTERM: the signalled node's agent's exit status, and seconds
    from the fault to its exit."""
    twice: int = 0
    """Step numbers logged more than once (trained again after the fault)."""


def _times(nodes: list[Node], kind: EventKind, after: float) -> list[float]:
    return [float(e["time"]) for node in nodes for e in node.events(kind) if e["time"] > after]


def breakdown(fault_at: float, survivors: list[Node], metrics: Path,
              first_step: dict[str, Any]) -> dict[str, float]:
    """Seconds spent in each phase of one recovery, from events (empty when incomplete)."""
    detect = _times(survivors, EventKind.LEAVING_ROUND, fault_at)
    back = _times(survivors, EventKind.RESTART, fault_at)
    joined = [float(e["time"]) for node in survivors for e in node.events(EventKind.JOINED)
              if e["time"] > fault_at and e["rank"] == 0]
    starts = [e for e in read_json_lines(metrics) if e.get("event") == "start"
              and e["time"] > fault_at and e["time"] <= first_step["time"]
              and "launched_at" in e]
    if not (detect and back and joined and starts):
        return {}
    start = starts[-1]
    marks = [fault_at, min(detect), max(back), max(joined), start["launched_at"],
             start["main_at"], start["pg_ready_at"], start["restored_at"], first_step["time"]]
    return {phase: marks[i + 1] - marks[i] for i, phase in enumerate(PHASES)}


def one_run(mode: str, scenario: str, workdir: Path, timeout: float,
            step_delay: float, program: str = "trainer",
            program_args: tuple[str, ...] = ()) -> Outcome:
    metrics = workdir / "metrics.jsonl"
    command = [*(["-m", "elastic_ext.warm", program] if program.endswith(".py")
                 else ["-m", program]),
               "--steps", "100000", "--global-batch-size", "24",
               "--snapshot-dir", str(workdir / "snapshots"), "--snapshot-every", "20",
               "--metrics", str(metrics), "--step-delay", str(step_delay), "--seed", "1",
               *(["--progress-every", "0"] if program == "trainer" else []), *program_args]
    spec = JobSpec(command=command, store="stock-c10d" if mode == "stock" else "etcd",
                   nnodes="2:3", run_id=f"bench-{scenario}", max_restarts=100,
                   rdzv_conf="warm_start=off" if mode == "cold" else "")
    start_nodes = 2 if scenario == "scale-up" else 3
    with LocalJob(spec, workdir).start(start_nodes) as job:
        wait_for_step(metrics, after=0, world_size=start_nodes, timeout=180)
        fault_at = time.time()
        survivors = list(job.nodes)
        if scenario == "dead":
            victim = job.other_node(job.rank0_node())
            victim.kill()
        elif scenario == "dead-rank0":
            victim = job.rank0_node()
            victim.kill()
        elif scenario == "hung":
            victim = job.other_node(job.rank0_node())
            victim.freeze()
        elif scenario == "stuck":  # in steady training: a round's first steps get longer
            first = wait_for_step(metrics, after=0, world_size=start_nodes, timeout=180)
            wait_until(lambda: any(e.get("event") == "step" and e["step"] >= first["step"] + 20
                                   for e in read_json_lines(metrics)), 60, what="20 steps")
            victim = job.other_node(job.rank0_node())
            pid = wait_until(victim.training_pid, 30, what="the worker to stop")
            fault_at = time.time()
            os.kill(pid, signal.SIGSTOP)
        elif scenario == "notice":
            victim = job.other_node(job.rank0_node())
            for pid in [victim.proc.pid, *victim.worker_pids()]:
                os.kill(pid, signal.SIGUSR2)
        elif scenario == "term-rank0":
            victim = job.rank0_node()
            os.kill(victim.proc.pid, signal.SIGTERM)
        else:
            victim = job.add_node()
        if scenario not in ("scale-up", "stuck"):
            survivors.remove(victim)
        exited: list[tuple[int, float]] = []
        watcher = threading.Thread(target=lambda: exited.append(
            (victim.proc.popen.wait(), time.time() - fault_at)), daemon=True)
        if scenario in ("notice", "term-rank0"):
            watcher.start()
        target = 3 if scenario in ("scale-up", "stuck") else 2
        try:
            after = fault_at
            if scenario == "stuck":  # the same world: the new round's first step
                after = wait_until(lambda: next((e["time"] for e in read_json_lines(metrics)
                                                 if e.get("event") == "start"
                                                 and e["time"] > fault_at), None),
                                   timeout, what="a new round's start")
            event = wait_for_step(metrics, after=after, world_size=target, timeout=timeout)
        except TimeoutError:
            return Outcome(None)

        if scenario == "scale-up":
            reached = rendezvous_reached(victim.proc.output())
            fault_at = reached if reached is not None else fault_at
        phases = breakdown(fault_at, survivors, metrics, event) if mode != "stock" else {}
        old_steps = [e["time"] for e in read_json_lines(metrics) if e.get("event") == "step"
                     and e["world_size"] == start_nodes and e["time"] < event["time"]]
        paused = event["time"] - max(old_steps) if old_steps else None
        if watcher.is_alive():
            watcher.join(timeout=30)  # the signalled agent's exit, if it comes
        wait_for_step(metrics, after=event["time"] + 1.0, world_size=target, timeout=timeout)
        steps = [e["step"] for e in read_json_lines(metrics) if e.get("event") == "step"]
        return Outcome(event["time"] - fault_at, phases, paused, exited[0] if exited else None,
                       twice=len(steps) - len(set(steps)))


def _fmt(values: list[float]) -> tuple[str, str, str]:
    if not values:
        return "-", "-", "-"
    return (f"{statistics.median(values):.2f}", f"{min(values):.2f}", f"{max(values):.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=5, help="runs of each etcd-ext mode")
    parser.add_argument("--stock-reps", type=int, default=2,
                        help="runs of stock c10d (each may take up to --timeout)")
    parser.add_argument("--timeout", type=float, default=180.0,
                        help="seconds after the fault before a run counts as never recovered")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--step-delay", type=float, default=0.05)
    parser.add_argument("--program", default="trainer",
                        help="the training module, or a script such as examples/own_loop.py "
                             "(default: the bundled trainer)")
    parser.add_argument("--program-args", default="",
                        help="more flags for the program, one string (e.g. '--shard fsdp2')")
    args = parser.parse_args(argv)
    modes, scenarios = args.modes.split(","), args.scenarios.split(",")
    results: dict[tuple[str, str], list[Outcome]] = {}
    with tempfile.TemporaryDirectory(prefix="recovery-bench-") as tmp:
        for rep in range(max(args.reps, args.stock_reps)):
            for scenario in scenarios:
                for mode in modes:
                    if rep >= (args.stock_reps if mode == "stock" else args.reps):
                        continue
                    workdir = Path(tmp) / f"{mode}-{scenario}-{rep}"
                    outcome = one_run(mode, scenario, workdir, args.timeout, args.step_delay,
                                      args.program, tuple(args.program_args.split()))
                    results.setdefault((mode, scenario), []).append(outcome)
                    shown = "never" if outcome.total is None else f"{outcome.total:.2f}s"
                    print(f"  rep {rep + 1}: {mode:<5} {scenario:<10} {shown}", file=sys.stderr,
                          flush=True)
    label = {"stock": "stock c10d", "cold": "etcd-ext, cold start", "warm": "etcd-ext, warm start"}
    print(f"\nRecovery: seconds from the fault to the first step in the new world "
          f"(timeout {args.timeout:g}s)\n")
    print(f"Training program: {args.program} {args.program_args}\n")
    print("| scenario | mode | runs | median | min | max | never recovered | training paused "
          "(median) | steps trained twice (all runs) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for scenario in scenarios:
        for mode in modes:
            outcomes = results.get((mode, scenario), [])
            ok = [o.total for o in outcomes if o.total is not None]
            median, low, high = _fmt(ok)
            paused = [o.paused for o in outcomes if o.paused is not None]
            shown = f"{statistics.median(paused):.2f}" if paused else "-"
            twice = sum(o.twice for o in outcomes if o.total is not None)
            print(f"| {scenario} | {label[mode]} | {len(outcomes)} | {median} | {low} | {high} | "
                  f"{len(outcomes) - len(ok)} | {shown} | {twice if ok else '-'} |")
    exits = [(scenario, mode, o.victim_exit) for scenario in scenarios for mode in modes
             for o in results.get((mode, scenario), []) if o.victim_exit is not None]
    if exits:
        print("\nThe signalled node's agent: exit status, seconds from the fault to its exit\n")
        print("| scenario | mode | exits |")
        print("|---|---|---|")
        for scenario in scenarios:
            for mode in modes:
                exit_texts = [f"{code} after {after:.1f}s" for s, m, (code, after) in exits
                              if (s, m) == (scenario, mode)]
                if exit_texts:
                    print(f"| {scenario} | {label[mode]} | {'; '.join(exit_texts)} |")
    print("\nWhere the time goes (etcd-ext; medians in seconds; see the module docstring)\n")
    print("| scenario | mode | " + " | ".join(PHASES) + " | total |")
    print("|---|---|" + "---|" * (len(PHASES) + 1))
    for scenario in scenarios:
        for mode in modes:
            if mode == "stock":
                continue
            complete = [o for o in results.get((mode, scenario), []) if o.phases]
            if not complete:
                continue
            cells = [f"{statistics.median(o.phases[p] for o in complete):.2f}" for p in PHASES]
            total = statistics.median(o.total for o in complete if o.total is not None)
            print(f"| {scenario} | {mode} | " + " | ".join(cells) + f" | {total:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
