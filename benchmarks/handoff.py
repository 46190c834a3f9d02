"""State hand-off benchmark: the work a fault costs, the time a 100 MB hand-off takes, and
what keeping the last step costs a healthy run; etcd-ext against stock torchrun.

Since the hand-off, a worker whose peer fails, or whose agent restarts the round for a
membership change, keeps the state of its last completed step in node memory, and the
next round restores the newest step any rank holds (the lowest holder sends it). So,
with no periodic snapshots at all (the trainer's default ``--snapshot-every 0``) and a
``--snapshot-dir`` of each node's own, a death should cost at most the step in flight
and a join or a preemption nothing. This measures that, on local torchrun agents
(``elastic_ext.local.job.LocalJob``), from the trainer's ``--metrics`` events:

1. lost work: steps trained twice (``step`` events whose step was logged before) after
   a SIGKILLed node (``dead``, ``dead-rank0``), a SIGSTOPped one (``hung``), a join
   (``scale-up``) and a preemption of the whole job followed by a new job (``preempt``),
   with the seconds from the fault to the first step in the new world and the ``restore``
   event (source, seconds). Stock torchrun (c10d, a shared snapshot directory: it has no
   hand-off) in the same run. Targets: <= 1 step for a death or a hang, 0 otherwise.
2. the hand-off of the 100 MB model (~304 MB of state with AdamW) at 2 and 3 ranks: a node
   joining (it holds nothing: a peer sends the state) and a node dying (the survivors
   hold it); the ``restore`` event's seconds and bytes and the time to the first step;
   stock torchrun's join restarts from the snapshot its workers write on SIGTERM.
3. the healthy step time of the 100 MB model at 2 ranks, this tree against the commit
   before the hand-off (``1ca6645``, in a git worktree), interleaved. Target: within 1 %.

    python benchmarks/handoff.py [--reps 3] [--stock-reps 1] [--only lost|handoff|healthy]

Run it on an otherwise idle machine; progress goes to stderr, the tables to stdout.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elastic_ext.jsonlines import read_json_lines
from elastic_ext.local.job import JobSpec, LocalJob, Node
from elastic_ext.local.processes import Proc, ProcessSet, signal_pids

if str(Path(__file__).resolve().parent) not in sys.path:  # python -m benchmarks.handoff
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from recovery import rendezvous_reached  # noqa: E402  (benchmarks/recovery.py, a sibling script)

REPO = Path(__file__).resolve().parent.parent
BASELINE_COMMIT = "1ca6645"
LOST_SCENARIOS = ("dead", "dead-rank0", "hung", "scale-up", "preempt")
LOST_TARGET = {"dead": 1, "dead-rank0": 1, "hung": 1, "scale-up": 0, "preempt": 0}
PARTS = ("lost", "handoff", "healthy")
STARTUP_TIMEOUT = 240.0
"""Seconds for a job's agents to start and train their first step (100 MB model included)."""
MB = 1_000_000


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# -- metrics ---------------------------------------------------------------------------------

def events(metrics: Path, kind: str | None = None) -> list[dict[str, Any]]:
    return [e for e in read_json_lines(metrics) if kind is None or e.get("event") == kind]


def redone_steps(metrics: Path) -> int:
    """Steps trained twice: ``step`` events whose step number was already logged."""
    steps = [int(e["step"]) for e in events(metrics, "step")]
    return len(steps) - len(set(steps))


def last_step(metrics: Path) -> int:
    steps = events(metrics, "step")
    return int(steps[-1]["step"]) if steps else -1


def wait_for(predicate: Callable[[], Any], timeout: float, what: str,
             alive: Callable[[], bool] | None = None, poll: float = 0.05) -> Any:
    """``predicate``'s first truthy value; TimeoutError after ``timeout`` s, and at once
    (with the reason) when ``alive`` says nothing is left that could make it true."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if alive is not None and not alive():
            raise TimeoutError(f"the job ended before {what}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {timeout:g}s")
        time.sleep(poll)


def step_at(metrics: Path, world: int, after: float) -> dict[str, Any] | None:
    """The first ``step`` event logged after ``after`` at world size ``world``."""
    for event in events(metrics, "step"):
        if event["time"] > after and event["world_size"] == world:
            return event
    return None


# -- jobs ------------------------------------------------------------------------------------

@dataclass
class TreeProcessSet(ProcessSet):
    """Spawns every agent with ``cwd`` as its working directory (for ``-m trainer``)."""

    cwd: Path | None = None

    def spawn(self, name: str, cmd: Sequence[str], env: Mapping[str, str] | None = None,
              cwd: str | Path | None = None) -> Proc:
        return super().spawn(name, cmd, env=env, cwd=cwd if cwd is not None else self.cwd)


def control_dirs_of(job: LocalJob) -> list[Path]:
    """The node-memory directories the job's etcd-ext agents made (a killed agent's stays
    until the next agent on the node starts: up to ~1 GB of RAM each with the 100 MB model)."""
    bases = {Path("/dev/shm"), Path(tempfile.gettempdir())}
    found: list[Path] = []
    for node in job.nodes:
        for base in bases:
            found.extend(base.glob(f"elastic-ext-ctl-{node.proc.pid}-*"))
    return found


@contextmanager
def running(spec: JobSpec, workdir: Path, nodes: int, cwd: Path | None = None
            ) -> Iterator[LocalJob]:
    """A started job; on exit every process is killed and its node memory freed."""
    job = LocalJob(spec, workdir)
    if cwd is not None:
        job.processes = TreeProcessSet(workdir / "logs", cwd=cwd)
    try:
        with job:
            job.start(nodes)
            yield job
    finally:
        for directory in control_dirs_of(job):
            shutil.rmtree(directory, ignore_errors=True)


def any_alive(nodes: Sequence[Node]) -> Callable[[], bool]:
    return lambda: any(n.alive() for n in nodes)


def exit_codes(nodes: Sequence[Node], timeout: float) -> list[int | None]:
    deadline = time.monotonic() + timeout
    codes: list[int | None] = []
    for node in nodes:
        try:
            codes.append(node.proc.wait(max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            codes.append(None)
    return codes


def free_snapshots(workdir: Path) -> None:
    """Snapshots of the 100 MB model are 300 MB each: keep the logs and metrics only."""
    for directory in workdir.rglob("snapshots"):
        if directory.is_dir():
            shutil.rmtree(directory, ignore_errors=True)


def trainer_command(workdir: Path, *, stock: bool, extra: Sequence[str]) -> list[str]:
    """etcd-ext: a snapshot directory of each node's own; stock: one shared directory."""
    snapshots = workdir / "snapshots" if stock else workdir / "{node}" / "snapshots"
    return ["-m", "trainer", "--snapshot-dir", str(snapshots), "--metrics",
            str(workdir / "metrics.jsonl"), "--progress-every", "0", *extra]


# -- one faulted run -------------------------------------------------------------------------

@dataclass
class Run:
    """One faulted run, measured from its metrics."""

    workdir: Path
    recovered: bool = False
    why_not: str = ""
    lost: int | None = None
    before: int | None = None
    """The last step the old world logged."""
    to_step: float | None = None
    """Seconds from the fault (for a join: the newcomer reaching the rendezvous; for a
    preemption: the signal) to the first step in the new world."""
    paused: float | None = None
    """Seconds from the old world's last step to the new world's first."""
    restore: dict[str, Any] = field(default_factory=dict)
    kept: str = ""
    received_s: float | None = None
    """A join: seconds from the start of rank 0's restore to the newcomer's log line saying
    it restored the state it received (the logs' clock has millisecond resolution)."""
    notes: list[str] = field(default_factory=list)


def measure_recovery(run: Run, metrics: Path, fault_at: float, first: dict[str, Any]) -> None:
    """Fill ``run`` from the new world's first step ``first``."""
    old = [e for e in events(metrics, "step") if e["time"] < first["time"]]
    run.recovered = True
    run.before = int(old[-1]["step"]) if old else None
    run.to_step = float(first["time"]) - fault_at
    run.paused = float(first["time"]) - float(old[-1]["time"]) if old else None
    restores = [e for e in events(metrics, "restore") if fault_at < e["time"] <= first["time"]]
    run.restore = restores[-1] if restores else {}
    kept = [f"{e['event']} kept {e.get('kept')}" for e in events(metrics)
            if e["event"] in ("fault", "stopped") and e["time"] >= fault_at - 1
            and e["time"] <= first["time"]]
    run.kept = "; ".join(kept)


RESTORED_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \[rank \d+\] INFO "
                           r"elastic_ext\.snapshot: restored step (\d+) from rank \d+'s copy",
                           re.MULTILINE)


def received(run: Run, metrics: Path, newcomer_log: str, after: float) -> None:
    """How long after rank 0 began restoring the newcomer had the state it was sent."""
    starts = [e for e in events(metrics, "start") if e["time"] > after]
    if not starts or not run.restore:
        return
    began = float(starts[0]["restored_at"]) - float(run.restore["seconds"])
    for match in RESTORED_LINE.finditer(newcomer_log):
        at = dt.datetime.strptime(match[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()  # local time
        if at > after and int(match[2]) == run.restore.get("step"):
            run.received_s = at - began
            return


def give_up(run: Run, exc: Exception, metrics: Path, nodes: Sequence[Node]) -> None:
    """A run that did not recover: why, and the state of its agents."""
    codes = [n.proc.popen.poll() for n in nodes]
    shown = ", ".join(f"{n.name} {'running' if c is None else f'exited {c}'}"
                      for n, c in zip(nodes, codes, strict=True))
    run.why_not = f"{exc} ({shown})"
    run.before = last_step(metrics)
    run.lost = redone_steps(metrics)


def wait_past(metrics: Path, step: int | None, timeout: float, alive: Callable[[], bool]) -> None:
    """Until the new world has logged a step after ``step`` (so every redone step is counted)."""
    if step is None:
        return
    try:
        wait_for(lambda: last_step(metrics) > step, timeout, f"a step after {step}", alive)
    except TimeoutError:
        pass


def lost_run(scenario: str, stock: bool, workdir: Path, *, steps: int, fault_step: int,
             step_delay: float, timeout: float) -> Run:
    """One run of a lost-work scenario (3 nodes of 2:3, or 2 for scale-up; 2:2 to preempt)."""
    metrics = workdir / "metrics.jsonl"
    command = trainer_command(workdir, stock=stock, extra=(
        "--steps", str(steps), "--global-batch-size", "24", "--seed", "1",
        "--step-delay", str(step_delay)))
    store = "stock-c10d" if stock else "etcd"
    run = Run(workdir)
    if scenario == "preempt":
        return preempt_run(run, command, store, workdir, fault_step=fault_step, timeout=timeout)
    spec = JobSpec(command=command, store=store, nnodes="2:3", run_id=f"lost-{scenario}",
                   max_restarts=100)
    start_nodes = 2 if scenario == "scale-up" else 3
    target = 3 if scenario == "scale-up" else 2
    with running(spec, workdir / "job", start_nodes) as job:
        alive = any_alive(job.nodes)
        wait_for(lambda: step_at(metrics, start_nodes, 0), STARTUP_TIMEOUT,
                 f"a step at world size {start_nodes}", alive)
        wait_for(lambda: last_step(metrics) >= fault_step, 120, f"step {fault_step}", alive)
        fault_at = time.time()
        survivors = list(job.nodes)
        if scenario == "scale-up":
            newcomer = job.add_node()
            survivors.append(newcomer)
        else:
            victim = job.rank0_node() if scenario == "dead-rank0" \
                else job.other_node(job.rank0_node())
            if scenario == "hung":
                victim.freeze()
            else:
                victim.kill()
            survivors.remove(victim)
        try:
            first = wait_for(lambda: step_at(metrics, target, fault_at), timeout,
                             f"step at world size {target}", any_alive(survivors))
        except TimeoutError as exc:
            give_up(run, exc, metrics, job.nodes)
            return run
        if scenario == "scale-up":
            reached = rendezvous_reached(newcomer.proc.output())
            fault_at = reached if reached is not None else fault_at
        measure_recovery(run, metrics, fault_at, first)
        wait_past(metrics, run.before, 60, any_alive(survivors))
        run.lost = redone_steps(metrics)
    return run


def preempt_run(run: Run, command: list[str], store: str, workdir: Path, *, fault_step: int,
                timeout: float) -> Run:
    """SIGUSR2 to every worker of a 2:2 job; then a new job (new agents) runs to the end."""
    metrics = workdir / "metrics.jsonl"
    spec = JobSpec(command=command, store=store, nnodes="2:2", run_id="lost-preempt",
                   max_restarts=3)
    with running(spec, workdir / "first", 2) as job:
        alive = any_alive(job.nodes)
        wait_for(lambda: step_at(metrics, 2, 0), STARTUP_TIMEOUT, "a step at world size 2", alive)
        wait_for(lambda: last_step(metrics) >= fault_step, 120, f"step {fault_step}", alive)
        fault_at = time.time()
        signal_pids([pid for n in job.nodes for pid in n.worker_pids()], signal.SIGUSR2)
        codes = exit_codes(job.nodes, 90)
        if codes != [0, 0]:
            run.notes.append(f"preempted job's agents exited {codes}")
    preempted = events(metrics, "preempted")
    if not preempted:
        run.notes.append("no preempted event")
    spec2 = JobSpec(command=command, store=store, nnodes="2:2", run_id="lost-preempt-2",
                    max_restarts=3)
    with running(spec2, workdir / "second", 2) as job:
        restart_at = time.time()
        try:
            first = wait_for(lambda: step_at(metrics, 2, restart_at), STARTUP_TIMEOUT,
                             "a step of the new job", any_alive(job.nodes))
        except TimeoutError as exc:
            give_up(run, exc, metrics, job.nodes)
            return run
        measure_recovery(run, metrics, fault_at, first)
        run.kept = f"preempted at {preempted[-1]['step']}" if preempted else "no preempted event"
        codes = exit_codes(job.nodes, timeout + STARTUP_TIMEOUT)
        if codes != [0, 0]:
            run.notes.append(f"the new job's agents exited {codes}")
        if not events(metrics, "done"):
            run.notes.append("the new job logged no done event")
    run.lost = redone_steps(metrics)
    return run


def handoff_run(kind: str, ranks: int, stock: bool, workdir: Path, *, batch: int,
                timeout: float) -> Run:
    """The 100 MB model: a node joins ``ranks - 1`` nodes, or one of ``ranks + 1`` dies."""
    metrics = workdir / "metrics.jsonl"
    command = trainer_command(workdir, stock=stock, extra=(
        "--model-size", "100mb", "--steps", "200", "--global-batch-size", str(batch),
        "--seed", "1"))
    join = kind == "join"
    start_nodes = ranks - 1 if join else ranks + 1
    nnodes = f"{ranks - 1}:{ranks}" if join else f"{ranks}:{ranks + 1}"
    spec = JobSpec(command=command, store="stock-c10d" if stock else "etcd", nnodes=nnodes,
                   run_id=f"handoff-{kind}-{ranks}", max_restarts=100)
    run = Run(workdir)
    with running(spec, workdir / "job", start_nodes) as job:
        alive = any_alive(job.nodes)
        first_old = wait_for(lambda: step_at(metrics, start_nodes, 0), STARTUP_TIMEOUT,
                             f"a step at world size {start_nodes}", alive)
        fault_step = int(first_old["step"]) + 3
        wait_for(lambda: last_step(metrics) >= fault_step, 120, f"step {fault_step}", alive)
        fault_at = time.time()
        survivors = list(job.nodes)
        if join:
            newcomer = job.add_node()
            survivors.append(newcomer)
        else:
            victim = job.other_node(job.rank0_node())
            victim.kill()
            survivors.remove(victim)
        try:
            first = wait_for(lambda: step_at(metrics, ranks, fault_at), timeout,
                             f"step at world size {ranks}", any_alive(survivors))
        except TimeoutError as exc:
            give_up(run, exc, metrics, job.nodes)
        else:
            joined_at = fault_at
            if join:
                reached = rendezvous_reached(newcomer.proc.output())
                fault_at = reached if reached is not None else fault_at
            measure_recovery(run, metrics, fault_at, first)
            if join:
                received(run, metrics, newcomer.proc.output(), joined_at)
            wait_past(metrics, run.before, 120, any_alive(survivors))
            run.lost = redone_steps(metrics)
    free_snapshots(workdir)
    return run


# -- the healthy step time -------------------------------------------------------------------

def imported_from(tree: Path) -> str:
    """Where ``elastic_ext`` and ``trainer`` come from for an agent started in ``tree``."""
    code = ("import elastic_ext, elastic_ext.agent.plugin, trainer; "
            "print(elastic_ext.__file__); print(trainer.__file__)")
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, "-c", code], cwd=tree, env=env, capture_output=True,
                         text=True, timeout=120, check=True).stdout.split()
    for path in out:
        if not Path(path).resolve().is_relative_to(tree.resolve()):
            raise RuntimeError(f"in {tree}, {path} was imported: not the tree's code")
    return ", ".join(str(Path(p).resolve().relative_to(tree.resolve())) for p in out)


@dataclass
class Healthy:
    step_s: float
    restore_events: int
    worker_tree: str


def healthy_run(tree: Path, workdir: Path, *, batch: int, warmup: int, measured: int) -> Healthy:
    """2 nodes of 2:2 (etcd-ext on its embedded store) with ``tree``'s code; the median
    step interval after ``warmup`` steps."""
    metrics = workdir / "metrics.jsonl"
    command = ["-m", "trainer", "--model-size", "100mb", "--steps", str(warmup + measured),
               "--global-batch-size", str(batch), "--seed", "1", "--metrics", str(metrics),
               "--progress-every", "0"]
    spec = JobSpec(command=command, store="embedded", nnodes="2:2", run_id="healthy",
                   max_restarts=0, env={"PYTHONPATH": str(tree)})
    with running(spec, workdir / "job", 2, cwd=tree) as job:
        worker_tree = ""
        try:
            pids = wait_for(lambda: [p for n in job.nodes for p in n.worker_pids()],
                            STARTUP_TIMEOUT, "workers", any_alive(job.nodes))
            worker_tree = os.readlink(f"/proc/{pids[0]}/cwd")
        except (TimeoutError, OSError):
            pass
        codes = exit_codes(job.nodes, STARTUP_TIMEOUT + 30 * (warmup + measured))
        if codes != [0, 0]:
            raise RuntimeError(f"healthy run in {tree} exited {codes}; logs in {workdir}")
    times = [float(e["time"]) for e in events(metrics, "step") if e["step"] > warmup]
    intervals = [b - a for a, b in zip(times, times[1:], strict=False)]
    return Healthy(statistics.median(intervals), len(events(metrics, "restore")), worker_tree)


@contextmanager
def baseline_worktree(path: Path) -> Iterator[Path]:
    if path.exists():
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(path)],
                       check=False, timeout=60, capture_output=True)
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(path),
                    BASELINE_COMMIT], check=True, timeout=120, capture_output=True)
    try:
        yield path
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(path)],
                       check=False, timeout=60, capture_output=True)


# -- formatting ------------------------------------------------------------------------------

def spread(values: Sequence[float], digits: int = 2) -> str:
    """``median (min-max)``, or the value alone, or ``-``."""
    if not values:
        return "-"
    median = f"{statistics.median(values):.{digits}f}"
    if len(values) == 1:
        return median
    return f"{median} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def counted(values: Sequence[str]) -> str:
    if not values:
        return "-"
    return ", ".join(f"{v} x{values.count(v)}" if values.count(v) > 1 else v
                     for v in sorted(set(values)))


def not_recovered(runs: Sequence[Run], timeout: float) -> str:
    failed = [r for r in runs if not r.recovered]
    if not failed:
        return ""
    since = sorted({r.before for r in failed if r.before is not None and r.before >= 0})
    trained = f"; last step logged: {'/'.join(map(str, since))}" if since else ""
    return f"no recovery in {timeout:g} s ({len(failed)}/{len(runs)}){trained}"


def header() -> str:
    return (f"Machine: {os.cpu_count()} CPUs, torch {importlib.metadata.version('torch')}, "
            f"Python {sys.version.split()[0]}; "
            f"{dt.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}; tree {REPO}")


# -- the parts -------------------------------------------------------------------------------

def part_lost(args: argparse.Namespace, root: Path) -> None:
    results: dict[tuple[str, bool], list[Run]] = {}
    for rep in range(max(args.reps, args.stock_reps)):
        for scenario in LOST_SCENARIOS:
            for stock in (False, True):
                if rep >= (args.stock_reps if stock else args.reps):
                    continue
                name = f"{'stock' if stock else 'etcd-ext'}-{scenario}-{rep}"
                started = time.monotonic()
                run = lost_run(scenario, stock, root / "lost" / name, steps=args.steps,
                               fault_step=args.fault_step, step_delay=args.step_delay,
                               timeout=args.stock_timeout if stock else args.timeout)
                results.setdefault((scenario, stock), []).append(run)
                log(f"  lost {name}: redone {run.lost}, "
                    f"{f'{run.to_step:.2f}s' if run.to_step is not None else run.why_not}, "
                    f"restore {run.restore.get('source')}@{run.restore.get('step')} "
                    f"{run.kept} {'; '.join(run.notes)} [{time.monotonic() - started:.0f}s]")
    print(f"\n## 1. Lost work (steps trained twice), default --snapshot-every 0\n\n"
          f"Tiny model, --step-delay {args.step_delay:g}, fault after step {args.fault_step}. "
          f"etcd-ext: etcd, a --snapshot-dir of each node's own; stock: torchrun "
          f"--rdzv-backend=c10d, one shared --snapshot-dir (stock has no hand-off: it restarts "
          f"from the newest snapshot on disk, and with --snapshot-every 0 there is none but a "
          f"preemption's). Time: from the fault (scale-up: the new agent reaching the "
          f"rendezvous; preempt: the SIGUSR2, then a whole new job is started) to the first "
          f"step in the new world. Median (min-max) over the runs that recovered.\n")
    print("| scenario | backend | runs | lost steps | target | met | fault -> first step (s) "
          "| training paused (s) | restore source | restore (s) | old last step -> restored "
          "| not recovered |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for scenario in LOST_SCENARIOS:
        for stock in (False, True):
            runs = results.get((scenario, stock), [])
            if not runs:
                continue
            ok = [r for r in runs if r.recovered]
            lost = [float(r.lost) for r in ok if r.lost is not None]
            target = LOST_TARGET[scenario]
            met = ("yes" if lost and max(lost) <= target and len(ok) == len(runs) else "no")
            sources = [str(r.restore.get("source", "?")) for r in ok]
            restore_s = [float(r.restore["seconds"]) for r in ok if "seconds" in r.restore]
            steps = [f"{r.before}->{r.restore.get('step', '?')}" for r in ok]
            timeout = args.stock_timeout if stock else args.timeout
            print(f"| {scenario} | {'stock c10d' if stock else 'etcd-ext'} | {len(runs)} | "
                  f"{spread(lost, 0)} | <= {target} | {met} | "
                  f"{spread([r.to_step for r in ok if r.to_step is not None])} | "
                  f"{spread([r.paused for r in ok if r.paused is not None])} | "
                  f"{counted(sources)} | {spread(restore_s, 3)} | {', '.join(steps) or '-'} | "
                  f"{not_recovered(runs, timeout) or '-'} |")
    notes = [f"{r.workdir.name}: {'; '.join(r.notes)}" for runs in results.values() for r in runs
             if r.notes]
    failed = [f"{r.workdir.name}: {r.why_not}" for runs in results.values() for r in runs
              if not r.recovered]
    if notes or failed:
        print("\nNotes: " + " | ".join([*failed, *notes]))


def part_handoff(args: argparse.Namespace, root: Path) -> None:
    results: dict[tuple[str, int, bool], list[Run]] = {}
    cases = [(kind, ranks, stock) for ranks in (2, 3) for kind in ("join", "death")
             for stock in (False, True) if not (stock and kind == "death")]
    for rep in range(max(args.handoff_reps, args.stock_reps)):
        for kind, ranks, stock in cases:
            if rep >= (args.stock_reps if stock else args.handoff_reps):
                continue
            name = f"{'stock' if stock else 'etcd-ext'}-{kind}-{ranks}-{rep}"
            started = time.monotonic()
            run = handoff_run(kind, ranks, stock, root / "handoff" / name, batch=args.batch,
                              timeout=args.stock_timeout if stock else args.timeout)
            results.setdefault((kind, ranks, stock), []).append(run)
            log(f"  handoff {name}: {run.restore} to-step {run.to_step} paused {run.paused} "
                f"redone {run.lost} {run.why_not} [{time.monotonic() - started:.0f}s]")
    print(f"\n## 2. Hand-off of the 100 MB model (--global-batch-size {args.batch})\n\n"
          f"join at N ranks: N-1 nodes of N-1:N train, a node with an empty memory and an "
          f"empty --snapshot-dir joins (time from its agent reaching the rendezvous); death "
          f"at N ranks: one of N+1 nodes (not rank 0) is SIGKILLed. The restore columns are "
          f"global rank 0's `restore` event: `local` = it loaded its own node-memory copy "
          f"(and, in a join, sent it: its seconds include the broadcast), `peer` = received; "
          f"newcomer received: from the start of rank 0's restore to the newcomer's log line "
          f"`restored step N from rank 0's copy` (the state received, its sha256 checked and "
          f"loaded; from the logs' millisecond clock). "
          f"Stock torchrun's join: its workers commit a snapshot to the shared directory on "
          f"SIGTERM and the new round restores it from disk.\n")
    print("| event | ranks | backend | runs | restore source | MB | restore (s) "
          "| newcomer received (s) | fault/join -> first step (s) | training paused (s) "
          "| lost steps | not recovered |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for kind, ranks, stock in sorted(results, key=lambda c: (c[0] != "join", c[1], c[2])):
        runs = results[(kind, ranks, stock)]
        ok = [r for r in runs if r.recovered]
        sizes = [float(r.restore["bytes"]) / MB for r in ok if "bytes" in r.restore]
        timeout = args.stock_timeout if stock else args.timeout
        print(f"| {kind} | {ranks} | {'stock c10d' if stock else 'etcd-ext'} | {len(runs)} | "
              f"{counted([str(r.restore.get('source', '?')) for r in ok])} | "
              f"{spread(sizes, 0)} | "
              f"{spread([float(r.restore['seconds']) for r in ok if 'seconds' in r.restore])} | "
              f"{spread([r.received_s for r in ok if r.received_s is not None])} | "
              f"{spread([r.to_step for r in ok if r.to_step is not None])} | "
              f"{spread([r.paused for r in ok if r.paused is not None])} | "
              f"{spread([float(r.lost) for r in ok if r.lost is not None], 0)} | "
              f"{not_recovered(runs, timeout) or '-'} |")
    failed = [f"{r.workdir.name}: {r.why_not}" for runs in results.values() for r in runs
              if not r.recovered]
    if failed:
        print("\nNotes: " + " | ".join(failed))


def part_healthy(args: argparse.Namespace, root: Path) -> None:
    baseline_path = Path(args.baseline_worktree)
    with baseline_worktree(baseline_path) as baseline:
        trees = {"baseline": baseline, "current": REPO}
        where = {name: imported_from(tree) for name, tree in trees.items()}
        for name, tree in trees.items():
            log(f"  {name}: {tree} imports {where[name]}")
        runs: dict[str, list[Healthy]] = {"baseline": [], "current": []}
        for pair in range(args.pairs):
            for name in ("baseline", "current"):
                result = healthy_run(trees[name], root / "healthy" / f"{name}-{pair}",
                                     batch=args.batch, warmup=args.warmup,
                                     measured=args.healthy_steps)
                runs[name].append(result)
                log(f"  healthy {name} {pair}: {result.step_s * 1000:.1f} ms/step, "
                    f"workers in {result.worker_tree}, {result.restore_events} restore events")
    diffs = [(c.step_s - b.step_s) / b.step_s * 100
             for b, c in zip(runs["baseline"], runs["current"], strict=True)]
    print(f"\n## 3. Healthy step time, 100 MB model, 2 ranks (--global-batch-size {args.batch})"
          f"\n\netcd-ext on its embedded store, 2 nodes of 2:2, {args.pairs} interleaved pairs "
          f"(baseline, current, ...), each {args.warmup} warm-up + {args.healthy_steps} "
          f"measured steps; per run the median interval between `step` events. Baseline: "
          f"commit {BASELINE_COMMIT} (before the hand-off) in a git worktree; each run's agents "
          f"start in their tree with PYTHONPATH set to it (checked: baseline imports "
          f"{where['baseline']} from {baseline_path}, current from {REPO}; the baseline runs "
          f"logged {sum(r.restore_events for r in runs['baseline'])} `restore` events, the "
          f"current ones {sum(r.restore_events for r in runs['current'])}).\n")
    print("| tree | runs | step (ms), median (min-max) | each run in order (ms) |")
    print("|---|---|---|---|")
    for name in ("baseline", "current"):
        print(f"| {name} | {len(runs[name])} | "
              f"{spread([r.step_s * 1000 for r in runs[name]], 1)} | "
              f"{', '.join(f'{r.step_s * 1000:.1f}' for r in runs[name])} |")
    met = "yes" if diffs and statistics.median(diffs) <= 1.0 else "no"
    base = [r.step_s for r in runs["baseline"]]
    noise = (max(base) - min(base)) / statistics.median(base) * 100 if base else 0.0
    print(f"\nCurrent vs baseline, per pair: {spread(diffs, 2)} % (median (min-max); "
          f"pairs: {', '.join(f'{d:+.2f}' for d in diffs)}). Target: at most 1 % slower: "
          f"{met}. The baseline's own runs spread over {noise:.1f} % of their median: the "
          f"machine's noise, far above the target.")
    added = added_work_per_step()
    current = statistics.median(r.step_s for r in runs["current"]) if runs["current"] else 0.0
    share = f", {added / current * 100:.4f} % of a current step" if current else ""
    print(f"\nWhat a healthy step does more, timed alone: the lock around the optimizer and "
          f"scheduler update (`HeldStep.updating`) {added * 1e6:.2f} us per step{share}; the "
          f"step-boundary all-reduce carries one float64 more (the same single collective).")


def added_work_per_step(calls: int = 200_000) -> float:
    """Seconds per step of the bookkeeping the hand-off adds to a healthy step."""
    import torch

    from elastic_ext.worker.snapshot import HeldStep
    from trainer.data import DataPosition

    last = HeldStep(0, DataPosition(), device=torch.device("cpu"))
    position = DataPosition(0, 16)
    started = time.perf_counter()
    for step in range(calls):
        with last.updating(step, position):
            pass
    return (time.perf_counter() - started) / calls


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3, help="runs of each etcd-ext scenario")
    parser.add_argument("--stock-reps", type=int, default=1, help="runs of each stock scenario")
    parser.add_argument("--handoff-reps", type=int, default=None,
                        help="runs of each etcd-ext 100 MB hand-off (default: --reps)")
    parser.add_argument("--only", choices=PARTS, action="append",
                        help="run only this part (repeatable)")
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="seconds after an etcd-ext fault before a run counts as not "
                             "recovered")
    parser.add_argument("--stock-timeout", type=float, default=75.0,
                        help="the same for stock torchrun (it may never recover)")
    parser.add_argument("--steps", type=int, default=150, help="trainer steps (lost work)")
    parser.add_argument("--fault-step", type=int, default=30,
                        help="inject the fault once this step is logged (lost work)")
    parser.add_argument("--step-delay", type=float, default=0.05)
    parser.add_argument("--batch", type=int, default=16,
                        help="--global-batch-size of the 100 MB runs")
    parser.add_argument("--pairs", type=int, default=5, help="baseline/current pairs")
    parser.add_argument("--warmup", type=int, default=5, help="warm-up steps of a healthy run")
    parser.add_argument("--healthy-steps", type=int, default=40,
                        help="measured steps of a healthy run")
    parser.add_argument("--baseline-worktree", default="/tmp/handoff-bench/baseline")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where runs keep their logs and metrics (default: a new "
                             "directory under /tmp/handoff-bench)")
    args = parser.parse_args(argv)
    if args.handoff_reps is None:
        args.handoff_reps = args.reps
    parts = args.only or list(PARTS)
    if args.workdir is None:
        base = Path("/tmp/handoff-bench")
        base.mkdir(parents=True, exist_ok=True)
        args.workdir = Path(tempfile.mkdtemp(prefix="runs-", dir=base))
    root: Path = args.workdir
    started = time.monotonic()
    print("# State hand-off benchmark\n")
    print(header())
    print(f"\nLogs and metrics of every run: {root}")
    for part, run_part in (("lost", part_lost), ("handoff", part_handoff),
                           ("healthy", part_healthy)):
        if part in parts:
            part_started = time.monotonic()
            run_part(args, root)
            print(f"\n({part}: {time.monotonic() - part_started:.0f} s)", flush=True)
    print(f"\nTotal: {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
