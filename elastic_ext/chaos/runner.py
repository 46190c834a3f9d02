"""Play a scenario against a real local job and collect what the invariants judge.

The runner starts the store and the nodes (:class:`~elastic_ext.local.job.LocalJob`,
in network namespaces when the scenario partitions), then polls: it tails the
metrics file, notes each snapshot manifest as it appears, ends faults whose time is
up, and fires the next fault once its trigger holds. When every fault has fired and
every node has exited it checks that nothing is left running or listening, stops
etcd, and hands an :class:`~elastic_ext.chaos.invariants.Observation` to
:func:`~elastic_ext.chaos.invariants.check`. Whatever happens, every process it
started is killed and every namespace and mount removed before it returns.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import subprocess
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elastic_ext.chaos import netns
from elastic_ext.chaos.inject import InjectionError, Injector, Undo
from elastic_ext.chaos.invariants import (
    FaultRecord,
    NodeOutcome,
    Observation,
    Verdict,
    check,
    listening_ports,
)
from elastic_ext.chaos.reference import ReferenceError, reference_sha, trainer_args
from elastic_ext.chaos.scenario import Scenario, Trigger
from elastic_ext.jsonlines import JsonLinesTail
from elastic_ext.local.etcd import call_here
from elastic_ext.local.job import JobSpec, LocalJob
from elastic_ext.local.processes import Proc
from elastic_ext.ops.runlog import split_segments
from elastic_ext.worker.snapshot.layout import parse_name

logger = logging.getLogger(__name__)

TICK = 0.1  # seconds between two looks at the job


@dataclass(frozen=True)
class RunOptions:
    """How to run a scenario, beyond the scenario itself."""

    workdir: Path
    # any module (or PATH.py script) that speaks the trainer's CLI and metrics contract
    module: str = "trainer"
    trainer_extra: tuple[str, ...] = ()
    reference: bool = True             # run (or reuse) the uninterrupted run for the params check
    reference_cache: Path | None = None
    run_id: str = "chaos"


@dataclass(frozen=True)
class RunResult:
    scenario: Scenario
    workdir: Path
    started: float
    ended: float
    verdict: Verdict | None = None
    observation: Observation | None = None
    skipped: str | None = None
    logs: Mapping[str, Path] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.skipped is not None or (self.verdict is not None and self.verdict.ok)


# ------------------------------------------------------------------------------ pure parts
def trigger_met(trigger: Trigger, events: Iterable[Mapping[str, Any]], since: float, now: float,
                stopped: bool) -> bool:
    """Whether ``trigger`` holds, counting only what happened after ``since`` (unix time)."""
    if trigger.kind == "after":
        return now >= since + trigger.value
    if trigger.kind == "stopped":
        return stopped
    round_start = float("-inf")
    for event in events:
        kind = event.get("event")
        if kind == "start":
            round_start = float(event["time"])
            continue
        if kind != "step" or float(event["time"]) < since:
            continue
        if trigger.kind == "step" and int(event["step"]) >= trigger.value:
            return True
        if trigger.kind == "world" and int(event["world_size"]) == trigger.value:
            return True
        if trigger.kind == "recovered" and round_start >= since:
            return True
    return False


# --------------------------------------------------------------------------- side effects
def _describe_pid(pid: int, owner: str) -> str:
    try:
        cmd = (Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
               .decode(errors="replace"))
    except OSError:
        cmd = "?"
    return f"pid {pid} of {owner}: {cmd.strip()[:160]}"


def _stop(proc: Proc, timeout: float = 15.0) -> None:
    """SIGTERM, then SIGKILL: how an operator stops a service."""
    if proc.popen.poll() is None:
        proc.popen.send_signal(signal.SIGTERM)
        try:
            proc.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.popen.wait(10)


class _Tmpfs:
    """A small tmpfs on the snapshot directory, so that 'fill disk' fills it in milliseconds."""

    def __init__(self, path: Path, size: str) -> None:
        self.path = path
        self.size = size
        self.mounted = False

    def mount(self) -> str | None:
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.size}",
                                 "elastic-ext-chaos", str(self.path)],
                                capture_output=True, text=True, timeout=30, check=False)
        if result.returncode != 0:
            return f"cannot mount a tmpfs on the snapshot directory: {result.stderr.strip()}"
        self.mounted = True
        return None

    def unmount(self) -> None:
        if self.mounted:
            result = subprocess.run(["umount", str(self.path)], capture_output=True, text=True,
                                    timeout=30, check=False)
            if result.returncode != 0:
                logger.warning("umount %s: %s; detaching it", self.path, result.stderr.strip())
                subprocess.run(["umount", "-l", str(self.path)], capture_output=True, timeout=30,
                               check=False)
            self.mounted = False


class ScenarioRun:
    """One run of one scenario; use :func:`run_scenario`."""

    def __init__(self, scenario: Scenario, options: RunOptions) -> None:
        self.scenario = scenario
        self.options = options
        self.workdir = options.workdir
        self.metrics = self.workdir / "metrics.jsonl"
        self.snapshot_dir = self.workdir / "snapshots"
        self.tail = JsonLinesTail(self.metrics)
        self.snapshots_seen: dict[int, float] = {}
        self.records: list[FaultRecord] = []
        self.errors: list[str] = []
        s = scenario.settings
        self.args = trainer_args(module=options.module, steps=s.steps,
                                 global_batch_size=s.global_batch_size, seed=s.seed,
                                 snapshot_every=s.snapshot_every, model_size=s.model_size,
                                 step_delay=s.step_delay, metrics=self.metrics,
                                 snapshot_dir=self.snapshot_dir, extra=options.trainer_extra)

    # -- the loop ---------------------------------------------------------------------------
    def _look(self) -> None:
        self.tail.poll()
        with contextlib.suppress(OSError):
            for entry in self.snapshot_dir.iterdir():
                # a manifest exists only once its snapshot is durable
                parsed = parse_name(entry.name)
                if parsed is not None and parsed[1] == "json":
                    self.snapshots_seen.setdefault(parsed[0], time.time())

    def _undo(self, undo: Undo) -> None:
        try:
            detail = undo.run()
        except Exception as exc:  # noqa: BLE001 - the job is judged anyway; say what went wrong
            self.errors.append(f"could not {undo.description}: {exc}")
            detail = f"failed: {exc}"
        self.records.append(FaultRecord(time.time(), undo.description, undo.verb, restore=True,
                                        detail=detail))
        logger.info("undo: %s (%s)", undo.description, detail)

    def _play(self, job: LocalJob, injector: Injector) -> None:
        settings = self.scenario.settings
        faults = list(self.scenario.faults)
        since = time.time()
        deadline = since + settings.timeout
        pending: list[Undo] = []
        index = 0
        try:
            while True:
                now = time.time()
                self._look()
                for undo in sorted((u for u in pending if u.due <= now), key=lambda u: u.due):
                    pending.remove(undo)
                    self._undo(undo)
                stopped = not any(node.alive() for node in job.nodes)
                if index < len(faults):
                    fault = faults[index]
                    if trigger_met(fault.trigger, self.tail.events, since, now, stopped):
                        try:
                            record, ending = injector.inject(fault)
                        except InjectionError as exc:
                            self.errors.append(f"line {fault.line} '{fault.describe()}': {exc}")
                            return
                        self.records.append(record)
                        since = record.time
                        index += 1
                        if ending is not None:
                            pending.append(ending)
                        continue
                    if stopped and fault.trigger.kind not in ("stopped", "after"):
                        self.errors.append(f"every node exited before line {fault.line} "
                                           f"'{fault.describe()}' could fire")
                        return
                elif stopped and all(u.due == math.inf for u in pending):
                    return  # the finally undoes what lasts as long as the job
                if now > deadline:
                    waiting = (f"line {faults[index].line} '{faults[index].describe()}' to fire"
                               if index < len(faults) else
                               "every node to exit" if not stopped or not pending else
                               min(pending, key=lambda u: u.due).description)
                    self.errors.append(f"timed out after {settings.timeout:g}s "
                                       f"waiting for {waiting}")
                    return
                time.sleep(TICK)
        finally:
            for undo in sorted(pending, key=lambda u: u.due):
                self._undo(undo)
            self._look()

    # -- after the job --------------------------------------------------------------------------
    def _leftovers(self, job: LocalJob, lab: netns.NetnsLab | None) -> tuple[list[str], list[int]]:
        """Processes of the job still alive, and the job's ports still listening, etcd excluded."""
        leftovers = []
        for node in job.nodes:
            for pid in node.proc.pids():
                leftovers.append(_describe_pid(pid, node.name))
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(node.proc.pid, 0)
                if not node.proc.pids():
                    leftovers.append(f"process group {node.proc.pid} of {node.name} is not empty")
        etcd_ports = {p for m in (job.etcd.members if job.etcd else [])
                      for p in (m.client_port, m.peer_port)}
        if lab is not None:
            bound = [port for ns, ports in lab.listening().items() for port in ports
                     if not (ns == lab.plan.switch and port in etcd_ports)]
        else:
            known = {port for node in job.nodes for port in node.workers_store_ports()}
            endpoint = job.endpoint.rsplit(":", 1)[-1]
            if job.spec.store == "embedded" and endpoint.isdigit():
                known.add(int(endpoint))
            bound = sorted(known & listening_ports(netns.read_tcp_tables()))
        return leftovers, bound

    def _stop_etcd(self, job: LocalJob, lab: netns.NetnsLab | None) -> tuple[list[str], list[int]]:
        if job.etcd is None:
            return [], []
        for member in job.etcd.members:
            if member.proc is not None:
                _stop(member.proc)
        leftovers = [_describe_pid(pid, f"etcd {m.name}") for m in job.etcd.members
                     if m.proc is not None for pid in m.proc.pids()]
        ports = {p for m in job.etcd.members for p in (m.client_port, m.peer_port)}
        if lab is not None:
            listening = netns.call_in(lab.plan.switch,
                                      lambda: listening_ports(netns.read_tcp_tables()))
        else:
            listening = listening_ports(netns.read_tcp_tables())
        return leftovers, sorted(ports & listening)

    # -- everything -------------------------------------------------------------------------------
    def run(self) -> RunResult:
        scenario, settings = self.scenario, self.scenario.settings
        started = time.time()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.snapshot_dir.mkdir(parents=True, exist_ok=True)
        if scenario.network == "netns":
            reason = netns.unavailable()
            if reason is not None:
                return RunResult(scenario, self.workdir, started, time.time(), skipped=reason)
        tmpfs = _Tmpfs(self.snapshot_dir, settings.disk_size)
        lab: netns.NetnsLab | None = None
        nodes: list[NodeOutcome] = []
        leftovers: list[str] = []
        bound: list[int] = []
        logs: dict[str, Path] = {}
        try:
            if scenario.needs_tmpfs:
                reason = tmpfs.mount()
                if reason is not None:
                    return RunResult(scenario, self.workdir, started, time.time(), skipped=reason)
            if scenario.network == "netns":
                lab = netns.NetnsLab.allocate()
            spec = JobSpec(command=self.args, store=settings.store, nnodes=settings.nnodes,
                           nproc_per_node=settings.nproc_per_node, run_id=self.options.run_id,
                           max_restarts=settings.max_restarts, rdzv_conf=settings.rdzv_conf,
                           etcd_members=settings.etcd_members, env={"TRAINER_LOG_LEVEL": "INFO"})
            job = LocalJob(spec, self.workdir, node_host=lab.node_host if lab else None,
                           store_host=lab.store_host if lab else None,
                           store_call=lab.call_in_store if lab else call_here)
            injector = Injector(job, initial_nodes=settings.nodes, snapshot_dir=self.snapshot_dir,
                                lab=lab)
            try:
                job.start(settings.nodes)
                self._play(job, injector)
                stopped = not any(node.alive() for node in job.nodes)
                nodes = [NodeOutcome(n.name, n.proc.popen.poll(), n.name in injector.killed,
                                     left_out=n.name in injector.cut_off)
                         for n in job.nodes]
                if stopped:
                    leftovers, bound = self._leftovers(job, lab)
                    more, more_bound = self._stop_etcd(job, lab)
                    leftovers += more
                    bound += more_bound
            finally:
                logs = {p.name: p.log for p in job.processes.procs}
                try:
                    job.cleanup()
                except RuntimeError as exc:
                    leftovers.append(str(exc))
        finally:
            tmpfs.unmount()
            if lab is not None:
                lab.down()
        self._look()
        reference, note = self._reference()
        observation = Observation(
            events=tuple(self.tail.events), steps=settings.steps, faults=tuple(self.records),
            snapshots_seen=tuple(sorted(self.snapshots_seen.items())), nodes=tuple(nodes),
            leftovers=tuple(leftovers), bound_ports=tuple(bound), reference_sha=reference,
            reference_note=note, errors=tuple(self.errors))
        verdict = check(observation)
        return RunResult(scenario, self.workdir, started, time.time(), verdict, observation,
                         logs=logs)

    def _reference(self) -> tuple[str | None, str]:
        segments, _ = split_segments(self.tail.events)
        worlds = {s.world_size for s in segments}
        if not self.options.reference:
            return None, "the reference run was turned off"
        if len(worlds) != 1 or not any(e.get("event") == "done" for e in self.tail.events):
            return None, "not needed"
        try:
            return reference_sha(self.args, worlds.pop(), self.workdir,
                                 cache_dir=self.options.reference_cache), "ok"
        except ReferenceError as exc:
            self.errors.append(str(exc))
            return None, "the reference run failed"


def run_scenario(scenario: Scenario, options: RunOptions) -> RunResult:
    """Run ``scenario`` under ``options``; never leaves a process, namespace or mount behind."""
    return ScenarioRun(scenario, options).run()

