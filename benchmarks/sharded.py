"""Sharded state (FSDP2, HSDP) under faults: recovery time, the buddy copy's cost, and the
host memory the kept shards take. The harness of ``benchmarks/recovery.py``: 3 local
torchrun agents (``--nnodes=2:3``, gloo on the CPU) train the bundled trainer on a local
etcd (etcd-ext, warm start) or on stock torchrun's c10d backend.

1. recovery (``--scenarios``; SIGKILL a whole node that is not rank 0 once step 15 is
   logged, then measure the seconds from the fault to the first step at the new world
   size, the training pause, and the finished steps trained twice, i.e. step numbers
   that appear more than once among the ``step`` events):

     ddp              ``--shard none`` 3x1, etcd-ext; the state handed off from memory
     hsdp             ``--shard hsdp`` 3 nodes x 2 procs, etcd-ext; replica twins hand off
     fsdp             ``--shard fsdp --shard-copy-every 1`` 3x1, etcd-ext, no snapshot dir:
                      the dead node's shards come from its buddy's host memory
     fsdp-disk        ``--shard fsdp --shard-copy-every 0`` 3x1, etcd-ext, a DCP snapshot
                      every 10 steps in one shared directory: the restart reads it
     fsdp-disk-stock  the same job under stock torchrun (c10d): what stock plus DCP gives

   The ``restore`` event of the new world says where the state came from (``source``)
   and how long ``ElasticLoop.restore`` took (``seconds``); the etcd-ext phases
   (``recovery.breakdown``) show where the rest went. ``restore`` there spans
   ``pg_ready_at`` to ``restored_at``: building the model, ``fully_shard`` and the
   optimizer, then the restore call itself.

2. copy cost (``--cost-sizes``): the ``fsdp`` job (3x1, no step delay) with
   ``--shard-copy-every 1`` and with ``0``, at each model size: the median step time in
   steady state (differences of consecutive ``step`` event timestamps, after the first
   ``--cost-warmup`` steps) and the median ``copy_s`` (seconds the copy blocked the loop),
   as a percentage of the copying job's step.

3. host memory: while a survivor keeps and restores, a thread polls every survivor's
   node-memory directory (``$ELASTIC_EXT_CONTROL_DIR/state``, ``shards-*.bin``) every
   20 ms and records the peak. After a keep a fully sharded rank holds its own set of the
   kept step, the set it last sent, and the two sets it received from the rank it keeps
   for: about 4 x (state bytes / world size) per rank, where the state is the fp32
   parameters and AdamW's two moments (3 x 4 bytes a parameter). Measured on the copying
   runs of (2), killed after their steady state, and on the sharded recovery runs of (1).

   With ``--profile-reps N`` each etcd-ext sharded scenario also runs N times with timers
   inside the workers (monkeypatched in this script, through the warm-start launcher):
   rank 0's seconds in building the model, sharding it and each piece of the restore
   call, and every rank's launch / main / process-group-ready / restored times, reported
   apart from the unprofiled timings.

On stock c10d the victim is never the node whose agent hosts the c10d store (the first
agent to bind the endpoint): losing that node ends the whole job, whatever the snapshots.
Every progress line (stderr) names a fingerprint of the product's sources; the summary
warns when they changed while the benchmark ran.

Usage: python benchmarks/sharded.py [--reps 3] [--stock-reps 1] [--timeout 180]
           [--scenarios ddp,hsdp,fsdp,fsdp-disk,fsdp-disk-stock] [--cost-sizes small,100mb]
           [--cost-steps small=60,100mb=15] [--no-cost] [--profile-reps 0]
           [--keep-dir DIR]
Prints markdown tables (median and range over the runs). The default run takes about
7-9 minutes on 2 cores. Run it on an otherwise idle machine: every process shares the
CPUs, and the timings are of this machine's cores.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elastic_ext.control_channel import (
    CONTROL_DIR_ENV,
    STATE_SUBDIR,
    node_memory_directory,
    remove_abandoned,
)
from elastic_ext.jsonlines import JsonLinesTail, read_json_lines
from elastic_ext.local.job import JobSpec, LocalJob, Node, wait_for_step
from elastic_ext.local.processes import environ_of, wait_until
from trainer.model import MODEL_SIZES

if str(Path(__file__).resolve().parent) not in sys.path:  # python -m benchmarks.sharded
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cell, cpu_model, terminated_by_sigterm  # noqa: E402  (siblings)
from recovery import PHASES, breakdown  # noqa: E402

KILL_AT_STEP = 15
SNAPSHOT_EVERY = 10
SNAPSHOT_DIR = "<snapshots>"  # replaced by the run's shared snapshot directory


@dataclass(frozen=True)
class Config:
    label: str
    shard: str
    nproc: int
    store: str
    args: tuple[str, ...] = ()
    target: float | None = None
    copies: bool = False


CONFIGS: dict[str, Config] = {
    "ddp": Config("DDP 3x1, etcd-ext warm (memory hand-off)", "none", 1, "etcd"),
    "hsdp": Config("HSDP 3x2, etcd-ext warm (replica twins)", "hsdp", 2, "etcd", target=1.5),
    "fsdp": Config("FSDP 3x1 + buddy copy every step, etcd-ext warm", "fsdp", 1, "etcd",
                   ("--shard-copy-every", "1"), target=2.5, copies=True),
    "fsdp-disk": Config(f"FSDP 3x1, DCP every {SNAPSHOT_EVERY}, etcd-ext warm", "fsdp", 1,
                        "etcd", ("--shard-copy-every", "0", "--snapshot-dir", SNAPSHOT_DIR,
                                 "--snapshot-every", str(SNAPSHOT_EVERY))),
    "fsdp-disk-stock": Config(f"FSDP 3x1, DCP every {SNAPSHOT_EVERY}, stock torchrun c10d",
                              "fsdp", 1, "stock-c10d",
                              ("--shard-copy-every", "0", "--snapshot-dir", SNAPSHOT_DIR,
                               "--snapshot-every", str(SNAPSHOT_EVERY))),
}


def code_fingerprint() -> str:
    """sha256 (12 hex digits) of the product's and the trainer's Python sources: the code
    a run measured, for a tree that may change while the benchmark runs."""
    import hashlib
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for path in sorted([*root.glob("elastic_ext/**/*.py"), *root.glob("trainer/**/*.py")]):
        digest.update(str(path.relative_to(root)).encode())
        try:
            digest.update(path.read_bytes())
        except OSError:
            pass
    return digest.hexdigest()[:12]


def state_bytes(model_size: str) -> int:
    """fp32 parameters and AdamW's two moments: what a sharded state holds, less the
    optimizer's step counters and the data position (a few hundred bytes)."""
    return MODEL_SIZES[model_size].parameter_count() * 4 * 3


def steps_of(metrics: Path) -> list[dict[str, Any]]:
    return [e for e in read_json_lines(metrics) if e.get("event") == "step"]


# -- node memory -------------------------------------------------------------------------
def state_dir_of(node: Node) -> Path | None:
    """The node-memory directory its etcd-ext agent gives its workers (None on stock)."""
    for pid in node.worker_pids():
        control = environ_of(pid).get(CONTROL_DIR_ENV)
        if control:
            return Path(control) / STATE_SUBDIR
    return None


@dataclass
class Peak:
    bytes: int = 0
    files: list[tuple[str, int]] = field(default_factory=list)


class MemoryPoller:
    """Polls the ``shards-*.bin`` files of some node-memory directories; keeps each one's
    peak total (and the files at that peak)."""

    def __init__(self, dirs: dict[str, Path], interval: float = 0.02) -> None:
        self.dirs, self.interval = dirs, interval
        self.peaks = {name: Peak() for name in dirs}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> MemoryPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.is_set():
            for name, directory in self.dirs.items():
                files: list[tuple[str, int]] = []
                try:
                    for entry in os.scandir(directory):
                        if entry.name.startswith("shards-") and entry.name.endswith(".bin"):
                            try:
                                files.append((entry.name, entry.stat().st_size))
                            except OSError:
                                pass
                except OSError:
                    continue
                total = sum(size for _, size in files)
                if total > self.peaks[name].bytes:
                    self.peaks[name] = Peak(total, sorted(files))
            self._stop.wait(self.interval)


@dataclass(frozen=True)
class MemorySample:
    """One survivor node's peak of kept shard files during one recovery."""

    what: str
    model_size: str
    world: int
    nproc: int
    copies: bool
    hsdp: bool
    peak: Peak

    def formula(self) -> int:
        """The expected bytes on the node: per rank 4 sets (own, last sent, two received)
        of state/world with buddy copies, else its own set; HSDP shards within the node."""
        per_rank = state_bytes(self.model_size) // (self.nproc if self.hsdp else self.world)
        return per_rank * (4 if self.copies else 1) * self.nproc


# -- inside the restore (--profile-reps) -----------------------------------------------------
PROFILED = ("total restore call", "read kept files", "agree (all_gather + plan)",
            "state_dict template", "dcp.load", "set_model_state_dict",
            "set_optimizer_state_dict", "drop older kept")
BUILD = ("task", "build_model", "mesh", "fully_shard")


def worker_profile(out: Path, argv: list[str]) -> int:
    """A worker of a profiled run: the bundled trainer, with timers around what a worker does
    between its process group and its first step (build, shard, and the pieces of
    ``ShardedState.restore``), appended to ``out`` as JSON lines. Monkeypatched here, in
    the benchmark: the product is not changed."""
    import functools
    import json

    import torch.distributed.checkpoint as dcp

    import trainer.train as train
    from elastic_ext.worker.loop.elastic_loop import ElasticLoop
    from elastic_ext.worker.snapshot import sharded
    from trainer.cli import main as trainer_main

    fd = os.open(out, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    restored = threading.Event()

    def timed(name: str, fn: Any) -> Any:
        @functools.wraps(fn)
        def wrapper(*a: Any, **k: Any) -> Any:
            if restored.is_set():
                return fn(*a, **k)
            started = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                line = json.dumps({"name": name, "seconds": time.perf_counter() - started,
                                   "rank": int(os.environ.get("RANK", "0")),
                                   "world": int(os.environ.get("WORLD_SIZE", "1")),
                                   "restart": os.environ.get("TORCHELASTIC_RESTART_COUNT"),
                                   "time": time.time()})
                os.write(fd, (line + "\n").encode())
        return wrapper

    def patch(owner: Any, attr: str, label: str) -> None:
        if hasattr(owner, attr):  # the product may have renamed it: then untimed
            setattr(owner, attr, timed(label, getattr(owner, attr)))

    state = sharded.ShardedState
    restore = state.restore

    def restore_once(self: Any) -> Any:
        try:
            return restore(self)
        finally:
            restored.set()
    setattr(state, "restore", timed("total restore call", restore_once))  # noqa: B010
    patch(state, "_read_kept", "read kept files")
    patch(state, "_drop_kept_before", "drop older kept")
    patch(state, "state_dict", "state_dict template")  # the template DCP loads into,
    patch(state, "dcp_state", "state_dict template")   # by either name
    plan = sharded.plan_shard_restore
    gather = sharded.all_gather_objects
    agree_started: list[float] = []

    def gather_timed(*a: Any, **k: Any) -> Any:
        agree_started.append(time.perf_counter())
        return gather(*a, **k)

    def plan_timed(*a: Any, **k: Any) -> Any:
        try:
            return plan(*a, **k)
        finally:
            if agree_started and not restored.is_set():
                line = json.dumps({"name": "agree (all_gather + plan)",
                                   "seconds": time.perf_counter() - agree_started.pop(),
                                   "rank": int(os.environ.get("RANK", "0")),
                                   "world": int(os.environ.get("WORLD_SIZE", "1")),
                                   "restart": os.environ.get("TORCHELASTIC_RESTART_COUNT"),
                                   "time": time.time()})
                os.write(fd, (line + "\n").encode())
    setattr(sharded, "all_gather_objects", gather_timed)  # noqa: B010
    setattr(sharded, "plan_shard_restore", plan_timed)  # noqa: B010
    patch(dcp, "load", "dcp.load")
    patch(sharded, "set_model_state_dict", "set_model_state_dict")
    patch(sharded, "set_optimizer_state_dict", "set_optimizer_state_dict")
    patch(train, "build_model", "build_model")
    patch(train, "shard_model", "fully_shard")
    patch(train.SyntheticTask, "make", "task")
    patch(ElasticLoop, "mesh", "mesh")
    loop_restore = ElasticLoop.restore

    def restore_and_tell(self: Any, *a: Any, **k: Any) -> Any:
        """Every rank's start times (the metrics file has rank 0's alone)."""
        try:
            return loop_restore(self, *a, **k)
        finally:
            times = dict(getattr(self, "_times", {}))
            os.write(fd, (json.dumps({"name": "times", "seconds": 0.0, **times,
                                      "rank": int(os.environ.get("RANK", "0")),
                                      "world": int(os.environ.get("WORLD_SIZE", "1")),
                                      "time": time.time()}) + "\n").encode())
    setattr(ElasticLoop, "restore", restore_and_tell)  # noqa: B010
    return trainer_main(argv)


START_MARKS = ("launched_at", "main_at", "pg_ready_at", "restored_at")


def read_profile(path: Path, world: int, since: float) -> dict[str, float]:
    """Per piece, the seconds rank 0 of the new world (``world`` ranks) spent in it (summed
    over its calls); and per rank ``r`` of it, ``rank<r> <mark>``: its start marks in seconds
    after ``since`` (the fault)."""
    pieces: dict[str, float] = {}
    for record in read_json_lines(path):
        if record["world"] != world:
            continue
        if record["name"] == "times":
            for mark in START_MARKS:
                if mark in record:
                    pieces[f"rank{record['rank']} {mark}"] = float(record[mark]) - since
        elif record["rank"] == 0:
            pieces[record["name"]] = pieces.get(record["name"], 0.0) + float(record["seconds"])
    return pieces


# -- recovery ------------------------------------------------------------------------------
@dataclass
class Recovery:
    total: float | None
    paused: float | None = None
    twice: int = 0
    phases: dict[str, float] = field(default_factory=dict)
    restore: dict[str, Any] = field(default_factory=dict)
    lost: int | None = None
    """The old world's last logged step less the step restored: the steps trained again
    (-1: the restored step finished its update, but the fault came before it was logged)."""
    memory: list[MemorySample] = field(default_factory=list)
    profile: dict[str, float] = field(default_factory=dict)
    why: str = ""
    """For a run that never recovered: "timeout", or "job died" (every survivor exited)."""


def trainer_command(metrics: Path, shard: str, model_size: str, step_delay: float,
                    extra: tuple[str, ...], snapshots: Path) -> list[str]:
    return ["-m", "trainer", "--steps", "100000", "--global-batch-size", "24",
            "--metrics", str(metrics), "--step-delay", str(step_delay), "--seed", "1",
            "--progress-every", "0", "--model-size", model_size, "--shard", shard,
            *(str(snapshots) if a == SNAPSHOT_DIR else a for a in extra)]


def listening_inodes(port: int) -> set[str]:
    """Socket inodes listening on TCP ``port`` (any address), from ``/proc/net/tcp*``."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":
                inodes.add(fields[9])
    return inodes


def hosts_c10d_store(node: Node, port: int) -> bool:
    """Whether the node's agent listens on the stock c10d store's port (it hosts the
    store: the first agent to bind it, here any of them)."""
    inodes = listening_inodes(port)
    try:
        links = [os.readlink(f"/proc/{node.proc.pid}/fd/{fd}")
                 for fd in os.listdir(f"/proc/{node.proc.pid}/fd")]
    except OSError:
        return False
    return any(link == f"socket:[{inode}]" for link in links for inode in inodes)


def victim_of(job: LocalJob, spare_store_host: bool) -> Node:
    """A live node that is not rank 0's; with ``spare_store_host`` on stock c10d, also not
    the one whose agent hosts the rendezvous store (its loss ends the whole job)."""
    rank0 = job.rank0_node()
    candidates = [n for n in job.nodes if n is not rank0 and n.alive()]
    if spare_store_host and job.spec.store == "stock-c10d":
        port = int(job.endpoint.rsplit(":", 1)[1])
        spared = [n for n in candidates if not hosts_c10d_store(n, port)]
        if not spared:
            raise RuntimeError("every node that is not rank 0's hosts the c10d store?")
        return spared[0]
    return candidates[0]


def kill_and_watch(job: LocalJob, metrics: Path, world: int, nproc: int, timeout: float,
                   poll_memory: bool, spare_store_host: bool = True
                   ) -> tuple[float, Node, dict[str, Any] | None, dict[str, Peak]]:
    """SIGKILL a node that is not rank 0; the fault's time, the victim, the first step
    event at the smaller world (None: never within ``timeout``, or every survivor's
    agent exited) and the survivors' node-memory peaks."""
    victim = victim_of(job, spare_store_host)
    dirs = {n.name: d for n in job.nodes if n is not victim and n.alive()
            for d in [state_dir_of(n)] if d is not None} if poll_memory else {}
    with MemoryPoller(dirs) as poller:
        fault_at = time.time()
        victim.kill()
        tail = JsonLinesTail(metrics)
        survivors = [n for n in job.nodes if n is not victim and n.alive()]

        def found() -> dict[str, Any] | str | None:
            for e in tail.poll():
                if e.get("event") == "step" and e["time"] > fault_at \
                        and e["world_size"] == (world - 1) * nproc:
                    return e
            return None if any(n.alive() for n in survivors) else "dead"
        try:
            got = wait_until(found, timeout, 0.05, "a step at the smaller world")
        except TimeoutError:
            got = None
        event = got if isinstance(got, dict) else None
    return fault_at, victim, event, poller.peaks


def recovery_run(name: str, workdir: Path, timeout: float, step_delay: float,
                 model_size: str, profile: bool = False) -> Recovery:
    cfg = CONFIGS[name]
    metrics = workdir / "metrics.jsonl"
    command = trainer_command(metrics, cfg.shard, model_size, step_delay, cfg.args,
                              workdir / "snapshots")
    profile_file = workdir / "profile.jsonl"
    if profile:  # the same trainer through the warm-start launcher, with timers
        command = ["-m", "elastic_ext.warm", str(Path(__file__).resolve()), "--worker-profile",
                   str(profile_file), *command[2:]]
    spec = JobSpec(command=command, store=cfg.store, nnodes="2:3", nproc_per_node=cfg.nproc,
                   run_id=f"sharded-{name}", max_restarts=100)
    with LocalJob(spec, workdir).start(3) as job:
        wait_for_step(metrics, after=0, world_size=3 * cfg.nproc, timeout=180)
        wait_until(lambda: steps_of(metrics)[-1]["step"] >= KILL_AT_STEP, 120,
                   what=f"step {KILL_AT_STEP}")
        fault_at, victim, event, peaks = kill_and_watch(
            job, metrics, 3, cfg.nproc, timeout, poll_memory=cfg.shard != "none")
        survivors = [n for n in job.nodes if n is not victim]
        if event is None:
            return Recovery(None, why="timeout" if any(n.alive() for n in survivors)
                            else "job died")
        phases = breakdown(fault_at, survivors, metrics, event) if cfg.store == "etcd" else {}
        old = [e for e in steps_of(metrics) if e["world_size"] == 3 * cfg.nproc
               and e["time"] < event["time"]]
        paused = event["time"] - old[-1]["time"] if old else None
        restores = [e for e in read_json_lines(metrics) if e.get("event") == "restore"
                    and fault_at < e["time"] <= event["time"]]
        restore = restores[-1] if restores else {}
        lost = old[-1]["step"] - restore["step"] if old and restore else None
        wait_for_step(metrics, after=event["time"] + 1.0, world_size=2 * cfg.nproc,
                      timeout=timeout)
        steps = [e["step"] for e in steps_of(metrics)]
        memory = [MemorySample(name, model_size, 3, cfg.nproc,
                               copies=cfg.copies,
                               hsdp=cfg.shard == "hsdp", peak=peak)
                  for peak in peaks.values()]
        return Recovery(event["time"] - fault_at, paused, len(steps) - len(set(steps)),
                        phases, restore, lost, memory,
                        read_profile(profile_file, 2 * cfg.nproc, fault_at) if profile else {})


# -- copy cost -----------------------------------------------------------------------------
@dataclass
class Cost:
    step_s: list[float]
    copy_s: list[float]
    memory: list[MemorySample] = field(default_factory=list)
    recovered: float | None = None


BACKGROUND = 2
"""The cost mode of a copy every step on its own thread (``--shard-copy-background``)."""


def cost_run(model_size: str, mode: int, warmup: int, measured: int, workdir: Path,
             timeout: float, measure_memory: bool) -> Cost:
    """The fsdp job in steady state; with ``measure_memory``, then kill a node and poll
    the survivors' node memory through the keep and the restore. ``mode``: 0 no copies,
    1 a copy every step waited for, ``BACKGROUND`` a copy every step in the background."""
    metrics = workdir / "metrics.jsonl"
    copy_every = min(mode, 1)
    flags: tuple[str, ...] = ("--shard-copy-every", str(copy_every))
    if mode == BACKGROUND:
        flags += ("--shard-copy-background",)
    command = trainer_command(metrics, "fsdp", model_size, 0.0, flags, workdir / "snapshots")
    spec = JobSpec(command=command, store="etcd", nnodes="2:3", nproc_per_node=1,
                   run_id=f"sharded-cost-{model_size}-{mode}", max_restarts=100)
    with LocalJob(spec, workdir).start(3) as job:
        first = wait_for_step(metrics, after=0, world_size=3, timeout=300)
        last = first["step"] + warmup + measured
        wait_until(lambda: steps_of(metrics)[-1]["step"] >= last, timeout,
                   what=f"step {last}")
        events = [e for e in steps_of(metrics)
                  if e["world_size"] == 3 and first["step"] + warmup <= e["step"] <= last]
        step_s = [b["time"] - a["time"] for a, b in zip(events, events[1:], strict=False)
                  if b["step"] == a["step"] + 1]
        copy_s = [float(e["copy_s"]) for e in events if "copy_s" in e]
        cost = Cost(step_s, copy_s)
        if measure_memory:
            fault_at, _, event, peaks = kill_and_watch(job, metrics, 3, 1, timeout,
                                                       poll_memory=True)
            cost.recovered = None if event is None else event["time"] - fault_at
            cost.memory = [MemorySample(f"cost {model_size}", model_size, 3, 1,
                                        copies=copy_every > 0, hsdp=False, peak=peak)
                           for peak in peaks.values()]
        return cost


# -- report --------------------------------------------------------------------------------
def mb(n: float) -> str:
    return f"{n / 1e6:.2f}"


def whys(outcomes: list[Recovery]) -> str:
    reasons = [o.why for o in outcomes if o.total is None]
    return f" ({', '.join(reasons)})" if reasons else ""


def print_recovery(results: dict[str, list[Recovery]], timeout: float, model_size: str,
                   step_delay: float) -> None:
    print(f"\n## 1. Dead node (SIGKILL, not rank 0, at step {KILL_AT_STEP}): seconds from "
          f"the fault to the first step in the new world\n")
    print(f"Model `{model_size}`, `--step-delay {step_delay:g}`, timeout {timeout:g}s; "
          "median (min-max).\n")
    print("| job | runs | fault -> first step (s) | target | never recovered | training "
          "paused (s) | steps trained twice (per run) | restore source | restore event "
          "seconds | restore bytes moved | old world's last logged step - restored step |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, outcomes in results.items():
        cfg = CONFIGS[name]
        ok = [o for o in outcomes if o.total is not None]
        totals = [o.total for o in ok if o.total is not None]
        target = f"<= {cfg.target:g}" if cfg.target is not None else "-"
        sources = sorted({str(o.restore.get("source")) for o in ok if o.restore})
        print(f"| {cfg.label} | {len(outcomes)} | {cell(totals, 2)} | {target} | "
              f"{len(outcomes) - len(ok)}{whys(outcomes)} | "
              f"{cell([o.paused for o in ok if o.paused is not None], 2)} | "
              f"{', '.join(str(o.twice) for o in ok) or '-'} | {', '.join(sources) or '-'} | "
              f"{cell([float(o.restore['seconds']) for o in ok if o.restore], 3)} | "
              f"{cell([float(o.restore.get('bytes') or 0) for o in ok if o.restore])} | "
              f"{cell([float(o.lost) for o in ok if o.lost is not None])} |")
    etcd = [(n, o) for n, o in results.items() if CONFIGS[n].store == "etcd"]
    if not etcd:
        return
    print("\nWhere the time goes (etcd-ext; medians in seconds; phases as in "
          "`benchmarks/recovery.py`; `restore` = model build + shard + optimizer + the "
          "restore call, of which `restore call` is the restore event's `seconds`)\n")
    print("| job | " + " | ".join(PHASES) + " | restore call | total |")
    print("|---|" + "---|" * (len(PHASES) + 2))
    for name, outcomes in etcd:
        complete = [o for o in outcomes if o.phases and o.total is not None]
        if not complete:
            continue
        cells = [f"{statistics.median(o.phases[p] for o in complete):.2f}" for p in PHASES]
        call = [float(o.restore["seconds"]) for o in complete if o.restore]
        call_cell = f"{statistics.median(call):.3f}" if call else "-"
        total = statistics.median(o.total for o in complete if o.total is not None)
        print(f"| {name} | " + " | ".join(cells) + f" | {call_cell} | {total:.2f} |")


def print_profile(profiled: dict[str, list[Recovery]]) -> None:
    runs = {n: [o for o in os if o.profile] for n, os in profiled.items()}
    runs = {n: os for n, os in runs.items() if os}
    if not runs:
        return
    print("\nInside the restore (profiled runs: the same trainer with timers, through the "
          "warm-start launcher; seconds rank 0 of the new world spent in each, median over "
          "runs; first what runs before the restore call, then the restore call and its "
          "pieces; `state_dict template` is get_model_state_dict + get_optimizer_state_dict "
          "of the fresh model, what DCP loads into)\n")
    names = [*BUILD, *PROFILED]
    print("| job | runs | fault -> first step | " + " | ".join(names) + " |")
    print("|---|---|---|" + "---|" * len(names))
    for name, outcomes in runs.items():
        cells = []
        for piece in names:
            seconds = [o.profile[piece] for o in outcomes if piece in o.profile]
            cells.append(f"{statistics.median(seconds):.3f}" if seconds else "-")
        totals = [o.total for o in outcomes if o.total is not None]
        print(f"| {name} | {len(outcomes)} | {cell(totals, 2)} | " + " | ".join(cells) + " |")
    print("\nEvery rank's start in the profiled runs (seconds after the fault, median over "
          "runs): launched (its launcher started), main, process group ready (pg-init waits "
          "for the last rank), restored\n")
    print("| job | rank | " + " | ".join(START_MARKS) + " |")
    print("|---|---|" + "---|" * len(START_MARKS))
    for name, outcomes in runs.items():
        ranks = sorted({int(k.split()[0][4:]) for o in outcomes for k in o.profile
                        if k.startswith("rank") and k[4:5].isdigit()})
        for rank in ranks:
            marks = []
            for mark in START_MARKS:
                values = [o.profile[f"rank{rank} {mark}"] for o in outcomes
                          if f"rank{rank} {mark}" in o.profile]
                marks.append(f"{statistics.median(values):.2f}" if values else "-")
            print(f"| {name} | {rank} | " + " | ".join(marks) + " |")


def print_cost(costs: dict[tuple[str, int], Cost], warmup: int) -> None:
    print(f"\n## 2. Buddy copy cost: fsdp 3x1, etcd-ext, no step delay (steady state: "
          f"after the first {warmup} steps)\n")
    print("| model | state (MB) | per rank (MB) | copy | step s | step time added | copy_s "
          "(median, range): the loop held | copy_s / step | target |")
    print("|---|---|---|---|---|---|---|---|---|")
    names = {0: "none", 1: "every step, waited for", BACKGROUND: "every step, in the background"}
    for size in dict.fromkeys(s for s, _ in costs):
        off = costs.get((size, 0))
        off_s = statistics.median(off.step_s) if off and off.step_s else None
        state = state_bytes(size)
        for mode, name in names.items():
            run = costs.get((size, mode))
            if run is None:
                continue
            on_s = statistics.median(run.step_s) if run.step_s else None
            copy = statistics.median(run.copy_s) if run.copy_s else None
            added = (f"{(on_s - off_s) / off_s * 100:+.1f}%" if on_s and off_s and mode
                     else "-")
            share = f"{copy / on_s * 100:.1f}%" if copy is not None and on_s else "-"
            print(f"| {size} | {mb(state)} | {mb(state / 3)} | {name} | "
                  f"{cell(run.step_s, 4)} ({len(run.step_s)} steps) | {added} | "
                  f"{cell(run.copy_s, 4) if run.copy_s else '-'} | {share} | "
                  f"{'<= 5%' if mode else ''} |")


def print_memory(samples: list[MemorySample]) -> None:
    if not samples:
        return
    print("\n## 3. Host memory per survivor node for kept shards (+ buddy copies): peak of "
          "`shards-*.bin` in its node-memory directory during the keep and restore\n")
    print("Formula: per rank, with buddy copies, own set of the kept step + the set last "
          "sent + two received ~= 4 x (state bytes / world size); without copies its own "
          "set; HSDP: state / ranks per node. State = parameters x 12 bytes (fp32 + AdamW's "
          "two moments).\n")
    print("| run | model | nodes x procs | copies | samples (nodes) | measured MB (median, "
          "range) | formula MB | measured / formula | files at peak (one node) |")
    print("|---|---|---|---|---|---|---|---|---|")
    groups: dict[tuple[str, str], list[MemorySample]] = {}
    for sample in samples:
        groups.setdefault((sample.what, sample.model_size), []).append(sample)
    for (what, size), group in groups.items():
        first = group[0]
        measured = [float(s.peak.bytes) for s in group]
        formula = first.formula()
        ratio = statistics.median(measured) / formula if formula else 0.0
        files = max(group, key=lambda s: s.peak.bytes).peak.files
        listing = "<br>".join(f"{name} {mb(size_)}" for name, size_ in files) or "none"
        print(f"| {what} | {size} | {first.world}x{first.nproc} | "
              f"{'yes' if first.copies else 'no'} | {len(group)} | "
              f"{cell([m / 1e6 for m in measured], 2)} | {mb(formula)} | {ratio:.2f} | "
              f"{listing} |")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker-profile"]:
        return worker_profile(Path(argv[1]), argv[2:])
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3, help="runs of each etcd-ext scenario")
    parser.add_argument("--stock-reps", type=int, default=1,
                        help="runs of stock c10d (each may take up to --timeout)")
    parser.add_argument("--timeout", type=float, default=180.0,
                        help="seconds after the fault before a run counts as never recovered")
    parser.add_argument("--scenarios", default=",".join(CONFIGS),
                        help="recovery scenarios, comma separated ('' for none)")
    parser.add_argument("--model-size", default="small", choices=sorted(MODEL_SIZES),
                        help="model of the recovery runs (default small)")
    parser.add_argument("--step-delay", type=float, default=0.05,
                        help="sleep per step in the recovery runs (default 0.05)")
    parser.add_argument("--cost-sizes", default="small,100mb",
                        help="model sizes of the copy-cost runs ('' for none)")
    parser.add_argument("--cost-steps", default="small=60,100mb=15",
                        help="steady-state steps measured per size")
    parser.add_argument("--cost-warmup", type=int, default=5)
    parser.add_argument("--no-cost", action="store_true", help="skip the copy-cost runs")
    parser.add_argument("--profile-reps", type=int, default=0,
                        help="extra runs of each etcd-ext sharded scenario with timers inside "
                             "the workers' restore (reported apart)")
    parser.add_argument("--keep-dir", type=Path, default=None,
                        help="run in this directory and keep it (logs, metrics)")
    args = parser.parse_args(argv)
    scenarios = [s for s in args.scenarios.split(",") if s]
    unknown = [s for s in scenarios if s not in CONFIGS]
    if unknown:
        parser.error(f"unknown scenarios {unknown}; known: {', '.join(CONFIGS)}")
    sizes = [] if args.no_cost else [s for s in args.cost_sizes.split(",") if s]
    steps_for = {k: int(v) for k, v in (p.split("=") for p in args.cost_steps.split(",") if p)}

    started = time.time()
    print("# Sharded state under faults (benchmarks/sharded.py)\n")
    print(f"Machine: {cpu_model()}, {os.cpu_count()} CPUs; load average at start "
          f"{os.getloadavg()[0]:.2f}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(f"Command: python benchmarks/sharded.py {' '.join(argv)}")
    sys.stdout.flush()
    results: dict[str, list[Recovery]] = {}
    costs: dict[tuple[str, int], Cost] = {}
    codes: list[str] = []

    def progress(text: str) -> None:
        """A line on stderr per run: what it gave, the code it ran, the machine's load."""
        codes.append(code_fingerprint())
        print(f"  {text} [code {codes[-1]}, load {os.getloadavg()[0]:.2f}]", file=sys.stderr,
              flush=True)
    print(f"Code (sha256 of elastic_ext/ and trainer/ sources): {code_fingerprint()}")
    sys.stdout.flush()
    with terminated_by_sigterm(), tempfile.TemporaryDirectory(prefix="sharded-bench-") as tmp:
        base = args.keep_dir or Path(tmp)
        for rep in range(max(args.reps, args.stock_reps) if scenarios else 0):
            for name in scenarios:
                stock = CONFIGS[name].store != "etcd"
                if rep >= (args.stock_reps if stock else args.reps):
                    continue
                outcome = recovery_run(name, base / f"{name}-{rep}", args.timeout,
                                       args.step_delay, args.model_size)
                results.setdefault(name, []).append(outcome)
                shown = (f"never ({outcome.why})" if outcome.total is None
                         else f"{outcome.total:.2f}s")
                progress(f"rep {rep + 1}: {name:<16} {shown} twice={outcome.twice} "
                         f"restore={outcome.restore.get('source')}/"
                         f"{outcome.restore.get('seconds')}")
        profiled: dict[str, list[Recovery]] = {}
        for rep in range(args.profile_reps):
            for name in scenarios:
                if CONFIGS[name].store != "etcd" or CONFIGS[name].shard == "none":
                    continue
                outcome = recovery_run(name, base / f"profiled-{name}-{rep}", args.timeout,
                                       args.step_delay, args.model_size, profile=True)
                profiled.setdefault(name, []).append(outcome)
                progress(f"profiled rep {rep + 1}: {name:<16} "
                         f"{outcome.total if outcome.total is None else round(outcome.total, 2)}")
        for size in sizes:
            for mode in (0, 1, BACKGROUND):
                cost = cost_run(size, mode, args.cost_warmup, steps_for.get(size, 30),
                                base / f"cost-{size}-{mode}", args.timeout,
                                measure_memory=mode == 1)
                costs[(size, mode)] = cost
                progress(f"cost {size} mode {mode}: step "
                         f"{statistics.median(cost.step_s) if cost.step_s else None} copy "
                         f"{statistics.median(cost.copy_s) if cost.copy_s else None}")
    # The node-memory directories of the agents killed here (the victims, and every agent
    # at a job's end) would stay until the next agent starts on this machine.
    remove_abandoned(node_memory_directory())
    if results:
        print_recovery(results, args.timeout, args.model_size, args.step_delay)
    print_profile(profiled)
    if costs:
        print_cost(costs, args.cost_warmup)
        recovered = [(s, c.recovered) for (s, e), c in costs.items() if e == 1]
        if recovered:
            print("\nAfter the copy-cost run the memory probe killed a node: fault -> first "
                  "step " + ", ".join(f"{s}: {'never' if r is None else f'{r:.2f}s'}"
                                       for s, r in recovered))
    samples = [m for rs in results.values() for r in rs for m in r.memory if m.peak.bytes]
    samples += [m for c in costs.values() for m in c.memory if m.peak.bytes]
    print_memory(samples)
    print(f"\nWall time {time.time() - started:.0f}s; load average at the end "
          f"{os.getloadavg()[0]:.2f}")
    if len(set(codes)) > 1:
        print(f"WARNING: the code changed while the benchmark ran (fingerprints after each "
              f"run: {', '.join(dict.fromkeys(codes))}): runs measured different code")
    return 0


if __name__ == "__main__":
    sys.exit(main())
