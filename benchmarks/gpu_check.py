"""One prepared GPU check: does elastic-ext keep its promises on a real GPU?

The CPU suite cannot reach what only a GPU exercises: NCCL, CUDA tensors in the
snapshot hook (pinned host buffers, non-blocking copies, an event the writer waits
on), CUDA workers forked by the warm-start server, several ranks sharing one GPU. This
script checks each of those once, in a few minutes, on a machine with one GPU, and
prints a Markdown table (check, PASS/FAIL, what was measured, seconds) with the date
and the machine. It exits 1 if any check that ran failed.

1. ``resume``: the bundled trainer under torchrun at world size 1 (``--nnodes=1``,
   etcd-ext on its embedded store, ``--max-restarts=1``, NCCL on ``cuda:0``) commits a
   snapshot every 5 steps; its worker is SIGKILLed a few steps after one, and the
   restarted worker must resume from the newest durable snapshot on disk, train the
   lost steps again and end with the final parameters' sha256 (``params_sha256`` of the
   ``done`` event) of an uninterrupted run (a lone ``python -m trainer``, run alongside).
   On the GPU the agent's log must show NCCL at work (``NCCL_DEBUG=INFO``).
2. ``warm``: in that same job (one job serves both, to save a torchrun start), both
   worker generations must have been forked by the one warm-start server (a worker's
   process is the server's image, its parent the server), and each must hold the GPU
   open (a ``/dev/nvidiaN`` descriptor: CUDA initialised after the fork).
3. ``keep-restore``: in a child process, a ``100mb`` model and AdamW on ``cuda`` after
   three steps are kept with ``Snapshotter.keep_local`` (a ``LocalCopies`` in a temp
   dir) and restored into a fresh model and optimizer on ``cuda``: every tensor of the
   model, the optimizer and the scheduler must be bit-identical and on the same device,
   and one more step must leave both models bit-identical.
4. ``two-agents``: two torchrun agents (``--nnodes=1:2``, one worker each, both on the
   one GPU with ``--device cuda --backend gloo``); the agent that does not host the
   embedded store is SIGKILLed with its workers mid-run; the survivor must train on at
   world size 1 from the state kept in node memory (the ``restore`` event's ``source``
   is ``local`` or ``peer``), lose no completed step, train none twice and finish.
5. ``blocking``: in the same child as 3, how long ``Snapshotter.commit`` holds the loop
   for the ``100mb`` model's state on the GPU (until it returns, and until its copies
   have landed: a ``torch.cuda.synchronize`` after it), against a synchronous
   ``torch.save`` of the same state; medians over 5 commits. The newest snapshot must
   verify and hold the state bit for bit, and the commit with its copies landed must
   take at most 20 % of the save (``benchmarks/snapshot.py``'s target for blocking).

Without a GPU (``torch.cuda.is_available()`` False), or with ``--cpu``, it says so and
runs the same checks on the CPU (``--device cpu``, gloo, the ``small`` model in 3 and
5), in 30-60 s on 2 cores, and lists each GPU check as ``SKIP (no GPU)``:
a skip is not a pass, and only the checks that ran decide the exit status. On the CPU
check 5 has no timing target (a 2 MB state measures fixed costs, and a shared 2-core
machine's timings are noise): it reports the numbers, and passes on the snapshots'
contents. Every job runs on loopback with free ports and the embedded store (no
etcd); every process it starts has a deadline, dies with this script
(``PR_SET_PDEATHSIG``) and is SIGKILLed, descendants included, when its check ends,
passed or not.

    python benchmarks/gpu_check.py [--cpu] [--checks resume,warm,...] [--logs DIR]

Progress, and the logs' tails of failed checks, go to stderr; the table to stdout.

On the project's lent GPU machine (no network; its image lacks ``tenacity``): download a
``tenacity`` wheel into ``.whl`` here first, then run, with ``.whl`` carried, about 450 s::

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && \
    export PYTHONPATH=/tmp/site && python3 -m pip install -q --no-deps \
    --no-build-isolation -e . && python3 benchmarks/gpu_check.py --logs /tmp/gc
"""

from __future__ import annotations

import argparse
import ctypes
import datetime as dt
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elastic_ext.jsonlines import read_json_lines
from elastic_ext.local.job import JobSpec, LocalJob, Node, wait_for_step
from elastic_ext.local.processes import Proc, ProcessSet, wait_until

if str(Path(__file__).resolve().parent) not in sys.path:  # python -m benchmarks.NAME
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cpu_model, terminated_by_sigterm  # noqa: E402  (benchmarks/common.py, a sibling)

HEADER = "| check | result | measured | seconds |"
SKIP = "SKIP (no GPU)"

TRAINER_ARGS: tuple[str, ...] = (
    "--global-batch-size", "14", "--dataset-size", "150", "--seed", "7", "--model-size", "tiny",
    "--progress-every", "0")
"""The job shape of the tests' bit-exact runs (``tests/support/trainer_runs.py``): 14
samples a step, 150 an epoch (10 steps, 10 samples dropped)."""

STARTING = re.compile(r"\[rank \d+\] INFO trainer\.train: rank \d+/\d+ pid (\d+) "
                      r"starting at step \d+")
"""The line each trainer worker logs once restored: which process it is."""

WARM_SERVER = "elastic_ext.warm.server"

DETERMINISM_ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TRAINER_LOG_LEVEL": "INFO",
                   "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
"""One intra-op thread and deterministic cuBLAS workspaces, so that runs compare bit for bit."""

BLOCKING_TARGET = 0.20
"""On the GPU, the most a commit may block, as a share of a synchronous ``torch.save``."""


class CheckFailed(Exception):
    """A check's verdict: FAIL, with what was measured."""


def expect(condition: object, message: str) -> None:
    if not condition:
        raise CheckFailed(message)


# -- processes -------------------------------------------------------------------------------

_PR_SET_PDEATHSIG = 1
try:
    _libc: ctypes.CDLL | None = ctypes.CDLL(None, use_errno=True)
except OSError:
    _libc = None


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when this script dies (even of SIGKILL)."""
    if _libc is not None:
        _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def dying_process_set(log_dir: Path) -> ProcessSet:
    """A ``ProcessSet`` (a session, a tag and a log each; ``cleanup`` SIGKILLs every tagged
    process, workers in sessions of their own included) whose children also die with
    this script."""
    return ProcessSet(log_dir, before_exec=_die_with_parent)


@dataclass
class Context:
    """One group of checks: its working directory, device, deadline and processes."""

    device: str
    workdir: Path
    deadline: float
    """``time.monotonic()`` by which the group must be over."""
    processes: ProcessSet = field(init=False)
    jobs: list[LocalJob] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.processes = dying_process_set(self.workdir / "logs")

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    def left(self) -> float:
        """Seconds left before the deadline (fails once it has passed)."""
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise CheckFailed("ran out of time")
        return remaining

    def start_job(self, spec: JobSpec, name: str, nodes: int) -> LocalJob:
        """A local job (``elastic_ext.local.job``) whose processes die with this script."""
        job = LocalJob(spec, self.workdir / name)
        job.processes = dying_process_set(self.workdir / name / "logs")
        self.jobs.append(job)
        return job.start(nodes)

    def python(self, name: str, args: Sequence[str], **extra_env: str) -> Proc:
        env = {**os.environ, **DETERMINISM_ENV, **extra_env}
        return self.processes.spawn(name, [sys.executable, *args], env=env)

    def procs(self) -> list[Proc]:
        return [*self.processes.procs, *(p for job in self.jobs for p in job.processes.procs)]

    def cleanup(self) -> None:
        errors = []
        cleanups: list[Callable[[], None]] = [*(job.cleanup for job in self.jobs),
                                              self.processes.cleanup]
        for cleanup in cleanups:
            try:
                cleanup()
            except RuntimeError as exc:  # a process survived SIGKILL
                errors.append(str(exc))
        if errors:
            raise CheckFailed("; ".join(errors))


def finished(proc: Proc, ctx: Context, what: str) -> int:
    """``proc``'s exit status, waiting at most until the deadline."""
    try:
        return proc.wait(ctx.left())
    except subprocess.TimeoutExpired:
        raise CheckFailed(f"{what} still running at the deadline") from None


def poll(ctx: Context, predicate: Callable[[], Any], what: str,
         watch: Sequence[Proc] = ()) -> Any:
    """``predicate()``'s first truthy value; fails at the deadline, or as soon as a process
    in ``watch`` has exited."""
    def check() -> Any:
        value = predicate()
        if value:
            return value
        for proc in watch:
            if proc.popen.poll() is not None:
                raise CheckFailed(f"{proc.name} exited with {proc.popen.returncode} before "
                                  f"{what}")
        return None
    try:
        return wait_until(check, timeout=ctx.left(), what=what)
    except TimeoutError as exc:
        raise CheckFailed(str(exc)) from None


def events(path: Path, kind: str | None = None) -> list[dict[str, Any]]:
    return [e for e in read_json_lines(path) if kind is None or e.get("event") == kind]


def trainer_args(steps: int, *extra: str) -> list[str]:
    return ["--steps", str(steps), *TRAINER_ARGS, *extra]


# -- what a process is -----------------------------------------------------------------------

def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def parent(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def gpu_files(pid: int) -> list[str]:
    """The ``/dev/nvidiaN`` devices ``pid`` holds open: it has a CUDA context there."""
    found = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return []
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if re.fullmatch(r"/dev/nvidia\d+", target):
            found.add(target)
    return sorted(found)


@dataclass(frozen=True)
class Worker:
    """A trainer worker, as seen while it ran."""

    generation: int
    pid: int
    image: str
    """Its command line: the warm-start server's when it was forked by it."""
    parent: int | None
    parent_image: str
    gpu: list[str]

    @property
    def forked_by_server(self) -> bool:
        return WARM_SERVER in self.image and WARM_SERVER in self.parent_image


def observe_worker(ctx: Context, node: Node, generation: int | None = None) -> Worker:
    """Worker ``generation`` of ``node`` (None: its latest so far), found by its ``starting
    at step`` line and looked at at once: it is alive (it trains at least a few steps
    more) and its model is on its device."""
    def look() -> int | None:
        found = STARTING.findall(node.proc.output())
        if generation is None:
            return int(found[-1]) if found else None
        return int(found[generation]) if len(found) > generation else None
    pid = poll(ctx, look, f"worker generation {generation}", watch=[node.proc])
    if generation is None:
        generation = len(STARTING.findall(node.proc.output())) - 1
    up = parent(pid)
    return Worker(generation, pid, cmdline(pid), up, cmdline(up) if up else "", gpu_files(pid))


# -- 1 and 2: a worker SIGKILLed and restarted, warm ------------------------------------------

def run_restart(ctx: Context, verdicts: Verdicts) -> None:
    steps = 40
    device = ["--device", ctx.device]
    reference_metrics = ctx.workdir / "reference.jsonl"
    # The uninterrupted run: a lone process (a one-rank group, the same code), alongside.
    reference = ctx.python("reference", ["-m", "trainer", *trainer_args(steps, *device),
                                         "--metrics", str(reference_metrics)])
    snapshots, metrics = ctx.workdir / "snapshots", ctx.workdir / "metrics.jsonl"
    command = ["-m", "trainer", *trainer_args(steps, *device), "--snapshot-dir", str(snapshots),
               "--snapshot-every", "5", "--metrics", str(metrics), "--step-delay", "0.1"]
    env = {**DETERMINISM_ENV, **({"NCCL_DEBUG": "INFO"} if ctx.cuda else {})}
    spec = JobSpec(command=command, store="embedded", nnodes="1", run_id="gpu-check-restart",
                   max_restarts=1, env=env)
    node = ctx.start_job(spec, "job", 1).nodes[0]
    first = observe_worker(ctx, node, 0)
    snap = poll(ctx, lambda: [e for e in events(metrics, "snapshot") if e["step"] >= 10],
                "a snapshot at step 10 or later", watch=[node.proc])[0]
    poll(ctx, lambda: [e for e in events(metrics, "step") if e["step"] >= snap["step"] + 3],
         f"step {snap['step'] + 3}", watch=[node.proc])  # so that steps are lost, trained again
    os.kill(first.pid, signal.SIGKILL)
    second = observe_worker(ctx, node, 1)
    code = finished(node.proc, ctx, "the job")
    reference_code = finished(reference, ctx, "the reference run")
    log = node.proc.output()

    def resume() -> str:
        expect(code == 0, f"the job exited with {code}")
        starts = events(metrics, "start")
        expect([s["restart"] for s in starts] == [0, 1],
               f"start events of restarts {[s['restart'] for s in starts]}, not [0, 1]")
        logged = read_json_lines(metrics)
        killed_at = max(e["step"] for e in logged if e["event"] == "step" and e["restart"] == 0)
        durable = max([e["step"] for e in logged if e["event"] == "snapshot"
                       and e["restart"] == 0 and e["step"] <= killed_at])
        resumed = starts[1]["resumed_from"]
        restore = events(metrics, "restore")[-1]
        # A snapshot durable on disk an instant before the kill may have missed its event.
        expect(resumed is not None and durable <= resumed <= killed_at and resumed % 5 == 0,
               f"resumed from {resumed}; snapshots were durable up to {durable}, the worker "
               f"was killed after step {killed_at}")
        expect(restore["source"] == "disk", f"restored from {restore['source']}, not disk")
        again = [e["step"] for e in logged[logged.index(starts[1]):] if e["event"] == "step"]
        expect(again == list(range(resumed + 1, steps + 1)),
               f"the restarted worker trained steps {again[:3]}..{again[-3:]}")
        nccl = ""
        if ctx.cuda:
            version = re.search(r"NCCL version (\S+)", log)
            expect("NCCL INFO" in log, "no NCCL INFO line in the agent's log: not on NCCL")
            nccl = f"NCCL {version.group(1) if version else '?'}; "
        expect(reference_code == 0, f"the reference run exited with {reference_code}")
        digest = events(metrics, "done")[-1]["params_sha256"]
        wanted = events(reference_metrics, "done")[-1]["params_sha256"]
        expect(digest == wanted, f"params sha256 {digest[:12]} after the restart, "
                                 f"{wanted[:12]} uninterrupted")
        redone = (f"trained {resumed + 1}-{killed_at} again" if resumed < killed_at
                  else "lost no step")
        return (f"{nccl}worker SIGKILLed after step {killed_at}; the restarted one resumed from "
                f"{resumed} (disk) and {redone}; params sha256 {digest[:12]} = uninterrupted "
                f"run's")

    def warm() -> str:
        expect(code == 0, f"the job exited with {code}")
        for worker in (first, second):
            expect(worker.forked_by_server,
                   f"generation {worker.generation}'s worker {worker.pid} started cold: "
                   f"{worker.image[:100]!r}, child of {worker.parent_image[:100]!r}")
        expect(first.parent == second.parent and first.pid != second.pid,
               f"workers {first.pid}, {second.pid} of servers {first.parent}, {second.parent}")
        starts = events(metrics, "start")
        expect(len(starts) == 2, f"{len(starts)} start events")
        gpu = ""
        if ctx.cuda:
            expect(first.gpu and second.gpu,
                   f"a worker held no GPU open: {first.gpu} / {second.gpu}")
            gpu = f"; both held {second.gpu[0]} open"
        launch = " / ".join(f"{s['main_at'] - s['launched_at']:.2f}" for s in starts)
        return (f"both generations forked by server {first.parent}; main {launch}s after "
                f"launch (the first waited for the server's imports){gpu}")

    verdicts.decide("resume", resume)
    verdicts.decide("warm", warm)


# -- 4. two agents, one killed ---------------------------------------------------------------

def run_two_agents(ctx: Context, verdicts: Verdicts) -> None:
    steps = 50
    metrics = ctx.workdir / "metrics.jsonl"
    command = ["-m", "trainer", *trainer_args(steps, "--device", ctx.device, "--backend", "gloo"),
               "--snapshot-dir", str(ctx.workdir / "{node}" / "snapshots"),
               "--snapshot-every", "10", "--metrics", str(metrics), "--step-delay", "0.05"]
    # last_call_timeout=5: two nodes started together form one round even on a slow machine.
    spec = JobSpec(command=command, store="embedded", nnodes="1:2", run_id="gpu-check-two",
                   max_restarts=0, rdzv_conf="last_call_timeout=5", env=dict(DETERMINISM_ENV))
    job = ctx.start_job(spec, "job", 2)
    poll(ctx, lambda: [e for e in events(metrics, "step")
                       if e["world_size"] == 2 and e["step"] >= 10],
         "step 10 at world size 2", watch=[n.proc for n in job.nodes])
    survivor = job.store_host()  # the others exit when the embedded store's host dies
    expect(survivor is not None, "no agent says it hosts the embedded store")
    assert survivor is not None
    victim = next(n for n in job.nodes if n is not survivor)
    victim_rank = victim.group_rank()
    gpu = [observe_worker(ctx, n).gpu for n in job.nodes] if ctx.cuda else []
    fault_at = time.time()
    victim.kill()  # SIGKILL to its agent's process group, its warm-start server and worker
    try:
        first = wait_for_step(metrics, after=fault_at, world_size=1, timeout=ctx.left())
    except TimeoutError:
        raise CheckFailed("no step at world size 1 after the kill") from None
    code = finished(survivor.proc, ctx, "the surviving agent")

    def judge() -> str:
        expect(code == 0, f"the surviving agent exited with {code}")
        last = max(e["step"] for e in events(metrics, "step") if e["world_size"] == 2)
        restores = [e for e in events(metrics, "restore") if e["time"] > fault_at]
        expect(restores and restores[0]["world_size"] == 1,
               f"restores after the kill: {restores}")
        restore = restores[0]
        expect(restore["source"] in ("local", "peer") and restore["bytes"] > 0,
               f"the survivor restored from {restore['source']}, not node memory")
        expect(restore["step"] >= last,
               f"the survivor resumed from step {restore['step']}; {last} was done at world 2")
        steps_logged = [e["step"] for e in events(metrics, "step")]
        twice = len(steps_logged) - len(set(steps_logged))
        expect(twice == 0, f"{twice} steps trained twice")
        # Rank 0 logs a step once the ranks agree on it at the step boundary: a step every
        # rank completed (gradients reduced, optimizer stepped) before the peer died there is
        # kept and resumed from, but never logged. Trained once, not lost.
        unlogged = sorted(set(range(1, steps + 1)) - set(steps_logged))
        expect(set(unlogged) <= set(range(last + 1, restore["step"] + 1)),
               f"steps never trained: {unlogged}")
        done = events(metrics, "done")
        expect(done and done[-1]["step"] == steps, "the survivor did not finish")
        shared = ""
        if ctx.cuda:
            expect(all(gpu), f"a worker held no GPU open: {gpu}")
            shared = f"both workers on {gpu[0][0]}, gloo; "
        gap = (f" (step {', '.join(map(str, unlogged))} done before the fault, not logged)"
               if unlogged else "")
        return (f"{shared}node of group rank {victim_rank} killed after step {last}; world 1 "
                f"trained {first['time'] - fault_at:.1f}s later from step {restore['step']} "
                f"({restore['source']}){gap}; 0 steps trained twice; done at {steps}")

    verdicts.decide("two-agents", judge)


# -- 3 and 5: in a child of their own --------------------------------------------------------

def run_in_process(ctx: Context, verdicts: Verdicts) -> None:
    """Checks 3 and 5 in one child (one import of torch; no CUDA in this process)."""
    result = ctx.workdir / "result.json"
    proc = ctx.python("in-process", [str(Path(__file__).resolve()), "--inner", "--device",
                                     ctx.device, "--workdir", str(ctx.workdir / "inner"),
                                     "--result", str(result)])
    code = finished(proc, ctx, "the in-process checks' child")
    answers: dict[str, Any] = json.loads(result.read_text()) if result.exists() else {}

    def judged(name: str, describe: Callable[[dict[str, Any]], str]) -> Callable[[], str]:
        def judge() -> str:
            answer = answers.get(name)
            expect(answer is not None, f"the child exited with {code} and no result")
            assert answer is not None
            expect("failed" not in answer, answer.get("failed"))
            return describe(answer)
        return judge

    verdicts.decide("keep-restore", judged("keep-restore", describe_keep_restore),
                    answers.get("keep-restore", {}).get("seconds"))
    verdicts.decide("blocking", judged("blocking", lambda r: describe_blocking(r, ctx.cuda)),
                    answers.get("blocking", {}).get("seconds"))


def describe_keep_restore(r: dict[str, Any]) -> str:
    return (f"step {r['step']} from node memory ({r['source']}, {r['bytes'] / 1e6:.1f} MB): "
            f"{r['tensors']} tensors bit-identical on {r['device']}, and after one more step")


def describe_blocking(r: dict[str, Any], cuda: bool) -> str:
    ratio = r["landed"] / r["save"]
    measured = (f"{r['size']} state, {r['bytes'] / 1e6:.1f} MB: commit {r['host'] * 1e3:.1f} ms "
                f"(copies landed {r['landed'] * 1e3:.1f} ms) vs torch.save {r['save'] * 1e3:.1f} "
                f"ms, medians of {r['repeats']}: {ratio:.1%}; the newest snapshot verifies, "
                f"{r['tensors']} tensors bit-identical")
    if not cuda:
        return f"{measured} (no target on the CPU)"
    expect(ratio <= BLOCKING_TARGET, f"{measured}, over the {BLOCKING_TARGET:.0%} target")
    return f"{measured} (target <= {BLOCKING_TARGET:.0%})"


def same_bits(a: Any, b: Any, where: str, devices: bool = True) -> int:
    """How many tensors ``a`` and ``b`` (nested state dicts) hold; fails on any difference:
    a dtype, a shape, a bit, a plain value or (``devices``) a tensor's device type."""
    import torch

    if isinstance(a, torch.Tensor):
        expect(isinstance(b, torch.Tensor) and (a.dtype, a.shape) == (b.dtype, b.shape)
               and (not devices or a.device.type == b.device.type),
               f"{where}: {a.dtype} {tuple(a.shape)} on {a.device} became "
               f"{getattr(b, 'dtype', type(b))} {tuple(getattr(b, 'shape', ()))} on "
               f"{getattr(b, 'device', '-')}")
        bits = [t.detach().cpu().contiguous().flatten().view(torch.uint8) for t in (a, b)]
        expect(torch.equal(*bits), f"{where} differs")
        return 1
    if isinstance(a, Mapping):
        expect(isinstance(b, Mapping) and set(a) == set(b), f"{where}: keys differ")
        return sum(same_bits(a[k], b[k], f"{where}.{k}", devices) for k in a)
    if isinstance(a, (list, tuple)):
        expect(isinstance(b, (list, tuple)) and len(a) == len(b), f"{where}: lengths differ")
        return sum(same_bits(x, y, f"{where}[{i}]", devices)
                   for i, (x, y) in enumerate(zip(a, b, strict=True)))
    expect(a == b, f"{where}: {a!r} != {b!r}")
    return 0


def inner_keep_restore(device_name: str, size_name: str, workdir: Path) -> dict[str, Any]:
    import torch

    from elastic_ext.worker.snapshot import LocalCopies, Snapshotter, Source
    from trainer.model import MODEL_SIZES, SyntheticTask, build_model
    from trainer.train import train_step

    device = torch.device(device_name)
    size = MODEL_SIZES[size_name]
    task = SyntheticTask.make(size, seed=0, dataset_size=64)
    ids = torch.arange(64)

    def build(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer,
                                  torch.optim.lr_scheduler.LRScheduler]:
        model = build_model(size, seed).to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
        return model, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, 2, gamma=0.5)

    model, optimizer, scheduler = build(0)
    for _ in range(3):
        train_step(model, optimizer, scheduler, task, ids, 64, 1, device)
    (workdir / "memory").mkdir(parents=True)
    snapshots = Snapshotter(workdir / "disk", local=LocalCopies(workdir / "memory"))
    kept = snapshots.keep_local(3, {"model": model, "optimizer": optimizer,
                                    "scheduler": scheduler, "data": {"offset": 3}})
    expect(kept is not None, "keep_local kept nothing")
    assert kept is not None
    fresh, fresh_optimizer, fresh_scheduler = build(1)  # other weights: a no-op restore fails
    restored = snapshots.restore({"model": fresh, "optimizer": fresh_optimizer,
                                  "scheduler": fresh_scheduler})
    snapshots.close()
    expect(restored is not None and (restored.step, restored.source) == (3, Source.LOCAL),
           f"restored {restored and (restored.step, restored.source)}, not step 3 from memory")
    assert restored is not None
    expect(restored.state.get("data") == {"offset": 3}, f"data {restored.state.get('data')}")
    tensors = (same_bits(model.state_dict(), fresh.state_dict(), "model")
               + same_bits(optimizer.state_dict(), fresh_optimizer.state_dict(), "optimizer")
               + same_bits(scheduler.state_dict(), fresh_scheduler.state_dict(), "scheduler"))
    expect(all(p.device == device for p in fresh.parameters()), "the restored model moved")
    for m, o, s in ((model, optimizer, scheduler), (fresh, fresh_optimizer, fresh_scheduler)):
        train_step(m, o, s, task, ids, 64, 1, device)
    same_bits(model.state_dict(), fresh.state_dict(), "model after one more step")
    return {"step": restored.step, "source": restored.source, "bytes": kept.size,
            "tensors": tensors, "device": str(device)}


def inner_blocking(device_name: str, size_name: str, workdir: Path,
                   repeats: int) -> dict[str, Any]:
    """Like ``benchmarks/snapshot.py``'s ``measure_blocking``, on ``device``, with the time
    until the copies to host memory have landed as well."""
    import torch

    from elastic_ext.worker.snapshot import Snapshotter, load_payload, verify
    from trainer.model import MODEL_SIZES, SyntheticTask, build_model
    from trainer.train import train_step

    device = torch.device(device_name)
    size = MODEL_SIZES[size_name]
    model = build_model(size, seed=0).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    task = SyntheticTask.make(size, seed=0, dataset_size=64)
    train_step(model, optimizer, scheduler, task, torch.arange(64), 64, 1, device)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler,
             "data": {"epoch": 0, "offset": 0}}

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    directory = workdir / "hook"
    snapshots = Snapshotter(directory, keep=2, local=None)
    host: list[float] = []
    landed: list[float] = []
    size_bytes = 0
    for step in range(repeats + 1):  # the first commit allocates the (pinned) host buffers
        sync()
        began = time.perf_counter()
        future = snapshots.commit(step, state)
        returned = time.perf_counter()
        sync()
        copied = time.perf_counter()
        info = future.result()
        if step > 0 and info is not None:
            host.append(returned - began)
            landed.append(copied - began)
            size_bytes = info.size
    snapshots.close()
    manifest = verify(directory, repeats)
    saved = load_payload(directory / manifest.payload)["state"]  # on the CPU
    tensors = (same_bits(model.state_dict(), saved["model"], "model", devices=False)
               + same_bits(optimizer.state_dict()["state"], saved["optimizer"]["state"],
                           "optimizer", devices=False))
    plain = {k: (v.state_dict() if hasattr(v, "state_dict") else v) for k, v in state.items()}
    saves = []
    for _ in range(repeats):
        sync()
        began = time.perf_counter()
        torch.save(plain, workdir / "sync.pt")
        saves.append(time.perf_counter() - began)
    return {"size": size_name, "bytes": size_bytes, "repeats": repeats, "tensors": tensors,
            "host": statistics.median(host), "landed": statistics.median(landed),
            "save": statistics.median(saves)}


def inner_main(args: argparse.Namespace) -> int:
    """``--inner``: checks 3 and 5 in this process; each one's result, or why it failed, as
    JSON in ``--result``."""
    cuda = args.device == "cuda"
    size = "100mb" if cuda else "small"
    parts: list[tuple[str, Callable[[], dict[str, Any]]]] = [
        ("keep-restore", lambda: inner_keep_restore(args.device, size, args.workdir)),
        ("blocking", lambda: inner_blocking(args.device, size, args.workdir,
                                            repeats=5 if cuda else 9))]
    answers: dict[str, dict[str, Any]] = {}
    for name, part in parts:
        began = time.monotonic()
        try:
            answer = part()
        except CheckFailed as exc:
            answer = {"failed": str(exc)}
        except Exception as exc:
            traceback.print_exc()
            answer = {"failed": f"{type(exc).__name__}: {exc}"}
        answers[name] = {**answer, "seconds": time.monotonic() - began}
        args.result.write_text(json.dumps(answers))
    return 0 if not any("failed" in a for a in answers.values()) else 1


# -- the table -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Check:
    name: str
    gpu_title: str
    cpu_title: str


CHECKS: tuple[Check, ...] = (
    Check("resume", "1. trainer on NCCL, world 1: worker SIGKILLed, bit-exact resume",
          "1. trainer on gloo (CPU), world 1: worker SIGKILLed, bit-exact resume"),
    Check("warm", "2. warm-started CUDA workers over two generations",
          "2. warm-started CPU workers over two generations"),
    Check("keep-restore", "3. keep_local + restore of CUDA state (100mb), bit-exact",
          "3. keep_local + restore of CPU state (small), bit-exact"),
    Check("two-agents", "4. two agents on one GPU (gloo), one SIGKILLed",
          "4. two agents on the CPU (gloo), one SIGKILLed"),
    Check("blocking", "5. snapshot blocking on the GPU (100mb) vs torch.save",
          "5. snapshot blocking on the CPU (small) vs torch.save"),
)


@dataclass(frozen=True)
class Group:
    """Checks decided by one run (one job, or one child process)."""

    name: str
    checks: tuple[str, ...]
    run: Callable[[Context, Verdicts], None]
    gpu_seconds: float
    cpu_seconds: float
    """Budgets: a run that hangs fails at them (a passing one takes a fraction)."""


GROUPS: tuple[Group, ...] = (
    Group("restart", ("resume", "warm"), run_restart, 120, 60),
    Group("two-agents", ("two-agents",), run_two_agents, 100, 50),
    Group("in-process", ("keep-restore", "blocking"), run_in_process, 150, 40),
)


@dataclass
class Verdicts:
    """Each check's result, what it measured, and its seconds (None: its group's)."""

    results: dict[str, tuple[str, str, float | None]] = field(default_factory=dict)

    def decide(self, name: str, judge: Callable[[], str], seconds: float | None = None) -> None:
        try:
            self.results[name] = ("PASS", judge(), seconds)
        except CheckFailed as exc:
            self.results[name] = ("FAIL", str(exc), seconds)
        except Exception as exc:
            traceback.print_exc(file=sys.stderr)
            self.results[name] = ("FAIL", f"{type(exc).__name__}: {exc}", seconds)


@dataclass(frozen=True)
class Row:
    check: str
    result: str
    measured: str
    seconds: float | None


def run_group(group: Group, device: str, root: Path, logs: Path | None) -> dict[str, Row]:
    cuda = device == "cuda"
    workdir = root / f"{group.name}-{device}"
    workdir.mkdir(parents=True)
    budget = group.gpu_seconds if cuda else group.cpu_seconds
    ctx = Context(device=device, workdir=workdir, deadline=time.monotonic() + budget)
    verdicts = Verdicts()
    began = time.monotonic()
    print(f"gpu_check: {group.name} ({', '.join(group.checks)}) on {device} ...",
          file=sys.stderr, flush=True)
    failure = ""
    try:
        group.run(ctx, verdicts)
    except CheckFailed as exc:
        failure = str(exc)
    except Exception as exc:
        traceback.print_exc(file=sys.stderr)
        failure = f"{type(exc).__name__}: {exc}"
    finally:
        try:
            ctx.cleanup()
        except CheckFailed as exc:
            failure = f"{failure}; {exc}" if failure else str(exc)
    seconds = time.monotonic() - began
    titles = {c.name: (c.gpu_title if cuda else c.cpu_title) for c in CHECKS}
    rows = {}
    for name in group.checks:
        result, measured, own = verdicts.results.get(name, ("FAIL", failure, None))
        if failure and result == "PASS":  # decided, then something left running
            result, measured = "FAIL", f"{measured}; {failure}"
        rows[name] = Row(titles[name], result, measured.replace("|", "/").replace("\n", " "),
                         seconds if own is None else own)
        print(f"gpu_check: {result}: {titles[name]}: {measured}", file=sys.stderr, flush=True)
    if any(row.result != "PASS" for row in rows.values()):
        for proc in ctx.procs():
            print(f"----- {proc.name} ({proc.log}) -----\n{proc.output()[-4000:]}",
                  file=sys.stderr, flush=True)
        if logs is not None:
            for log in [*workdir.rglob("*.log"), *workdir.rglob("*.jsonl")]:
                target = logs / log.relative_to(root)
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(log, target)
    return rows


def machine(cuda: bool) -> str:
    import torch

    gpu = "no GPU"
    if cuda:
        props = torch.cuda.get_device_properties(0)
        gpu = (f"{torch.cuda.device_count()} GPU(s), cuda:0 {props.name} "
               f"({props.total_memory / 2**30:.0f} GiB), CUDA {torch.version.cuda}")
    return (f"{os.cpu_count()} CPUs ({cpu_model()}), {gpu}, torch {torch.__version__}, "
            f"Python {platform.python_version()}")


def cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true",
                        help="CPU mode even with a GPU: the checks on the CPU, GPU ones skipped")
    parser.add_argument("--checks", default=",".join(c.name for c in CHECKS),
                        help="comma-separated, of: " + ", ".join(c.name for c in CHECKS)
                             + " (resume and warm share a job, keep-restore and blocking a "
                               "process: naming one runs both)")
    parser.add_argument("--logs", type=Path, default=None, metavar="DIR",
                        help="copy the logs and metrics of failed checks here")
    parser.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--device", default="cpu", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.inner:
        return inner_main(args)
    names = [n.strip() for n in args.checks.split(",") if n.strip()]
    if unknown := sorted(set(names) - {c.name for c in CHECKS}):
        parser.error(f"unknown check(s) {unknown}")

    started = time.monotonic()
    cuda = not args.cpu and cuda_available()
    if not cuda:
        why = "--cpu given" if args.cpu else "torch.cuda.is_available() is False"
        print(f"No GPU ({why}): running the CPU parts (--device cpu, gloo; the small model "
              f"in 3 and 5); the GPU checks are skipped.\n", flush=True)
    found: dict[str, Row] = {}
    with terminated_by_sigterm(), tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        for group in GROUPS:
            if set(group.checks) & set(names):
                found.update(run_group(group, "cuda" if cuda else "cpu", Path(tmp), args.logs))
    rows = [found[c.name] for c in CHECKS if c.name in found]
    if not cuda:
        rows += [Row(c.gpu_title, SKIP, "needs a GPU", None) for c in CHECKS if c.name in found]

    print(f"GPU check, {dt.date.today().isoformat()}: {machine(cuda)}; "
          f"{time.monotonic() - started:.0f}s in all; load average at the end "
          f"{os.getloadavg()[0]:.2f}\n")
    print(HEADER)
    print("| --- | --- | --- | --- |")
    for row in rows:
        seconds = "-" if row.seconds is None else f"{row.seconds:.1f}"
        print(f"| {row.check} | {row.result} | {row.measured} | {seconds} |")
    ran = [r for r in rows if r.result != SKIP]
    return 0 if ran and all(r.result == "PASS" for r in ran) else 1


if __name__ == "__main__":
    sys.exit(main())
