"""Doing a scenario's actions to a running :class:`~elastic_ext.local.job.LocalJob`.

Each action returns the :class:`FaultRecord` that goes into the timeline and, for
a fault with a duration, the :class:`Undo` that ends it. Targets are resolved
when the fault fires, from the agents' rendezvous events: ``rank0`` is the node
whose agent last joined a round as group rank 0, ``other`` a live node that is neither that one
nor the embedded store's host nor already frozen or cut off.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from elastic_ext.chaos.invariants import FaultRecord
from elastic_ext.chaos.netns import NetnsLab
from elastic_ext.chaos.scenario import SLOW_FRACTION, SLOW_PERIOD_S, Action, Fault
from elastic_ext.chaos.throttle import DutyCycle
from elastic_ext.local.etcd import EtcdMember
from elastic_ext.local.job import LocalJob, Node
from elastic_ext.local.processes import environ_of

logger = logging.getLogger(__name__)

FILLER = ".chaos-fill"


class InjectionError(RuntimeError):
    """The action cannot be done now (no such node, no etcd leader, ...)."""


@dataclass(frozen=True)
class Undo:
    """Ends a fault that has a duration: due at ``due`` (unix time; ``math.inf``: when the
    scenario ends, for a fault that lasts as long as the job)."""

    due: float
    description: str
    verb: str
    run: Callable[[], str]  # returns a detail for the record


class Injector:
    """Resolves targets and injects faults; remembers what it did for the invariants."""

    def __init__(self, job: LocalJob, *, initial_nodes: int, snapshot_dir: Path,
                 lab: NetnsLab | None = None) -> None:
        self.job = job
        self.initial_nodes = initial_nodes
        self.snapshot_dir = snapshot_dir
        self.lab = lab
        self.killed: set[str] = set()     # nodes SIGKILLed whole: their exit status says nothing
        self.cut_off: set[str] = set()    # nodes cut off their peers: the job may leave them out
        self.impaired: set[str] = set()   # frozen, slowed or cut off right now
        self.slowed: dict[str, DutyCycle] = {}  # node -> the duty cycle that slows it

    # -- targets ---------------------------------------------------------------------------
    def _live(self) -> list[Node]:
        return [n for n in self.job.nodes if n.alive() and n.name not in self.killed]

    def nodes(self, target: str) -> list[Node]:
        live = self._live()
        if target == "all":
            if not live:
                raise InjectionError("no live node")
            return live
        if target.isdigit():
            index = int(target)
            if index >= len(self.job.nodes) or self.job.nodes[index] not in live:
                raise InjectionError(f"node {index} is not running")
            return [self.job.nodes[index]]
        rank0 = next((n for n in live if n.group_rank() == 0), None)
        if target == "rank0":
            if rank0 is None:
                raise InjectionError("no live node reports group rank 0")
            return [rank0]
        host = self.job.store_host()
        for node in live:
            if node is not rank0 and node is not host and node.name not in self.impaired:
                return [node]
        raise InjectionError("no live node other than rank 0 and the store host")

    @staticmethod
    def _describe(nodes: list[Node]) -> str:
        return ", ".join(f"{n.name} (group rank {n.group_rank()})" for n in nodes)

    # -- actions ---------------------------------------------------------------------------
    def inject(self, fault: Fault) -> tuple[FaultRecord, Undo | None]:
        action = fault.action
        handler = getattr(self, "_" + action.verb.replace("-", "_"))
        detail, undo = handler(action)
        record = FaultRecord(time.time(), action.describe(), action.verb, crash=action.crash,
                             detail=detail)
        logger.info("fault: %s (%s)", record.description, detail)
        return record, undo

    def _kill_worker(self, action: Action) -> tuple[str, Undo | None]:
        node = self.nodes(action.target)[0]
        workers = sorted(node.worker_pids())
        if not workers:
            raise InjectionError(f"{node.name} has no worker running")
        with contextlib.suppress(ProcessLookupError):
            os.kill(workers[0], signal.SIGKILL)
        return f"worker pid {workers[0]} of {self._describe([node])}", None

    def _kill_node(self, action: Action) -> tuple[str, Undo | None]:
        nodes = self.nodes(action.target)
        detail = self._describe(nodes)
        for node in nodes:
            self.killed.add(node.name)
            node.kill()
        return detail, None

    def _freeze(self, action: Action) -> tuple[str, Undo | None]:
        node = self.nodes(action.target)[0]
        detail = self._describe([node])
        node.freeze()
        self.impaired.add(node.name)

        def thaw() -> str:
            node.thaw()
            self.impaired.discard(node.name)
            return node.name
        assert action.duration is not None
        return detail, Undo(time.time() + action.duration, f"thaw {node.name}", "thaw", thaw)

    def _slow(self, action: Action) -> tuple[str, Undo | None]:
        """A straggler: the node's workers (its agent spared) stopped and continued in a
        duty cycle (``throttle.py``), looked up again as rounds restart them."""
        node = self.nodes(action.target)[0]
        if node.name in self.slowed:
            raise InjectionError(f"{node.name} is already slowed")
        workers = training_pids(node)
        if not workers:
            raise InjectionError(f"{node.name} has no worker running")
        fraction = action.fraction or SLOW_FRACTION
        period = action.period or SLOW_PERIOD_S
        detail = (f"{self._describe([node])}: worker pid(s) {', '.join(map(str, workers))} run "
                  f"{fraction:.0%} of every {period * 1000:g}ms")
        cycle = DutyCycle(lambda: training_pids(node), fraction=fraction, period=period,
                          name=f"slow-{node.name}").start()
        self.slowed[node.name] = cycle
        self.impaired.add(node.name)

        def speed_up() -> str:
            cycles = cycle.stop()
            self.slowed.pop(node.name, None)
            self.impaired.discard(node.name)
            return f"{node.name} at full speed after {cycles} cycles"
        due = math.inf if action.duration is None else time.time() + action.duration
        return detail, Undo(due, f"speed up {node.name}", "speed-up", speed_up)

    def _partition(self, action: Action) -> tuple[str, Undo | None]:
        return self._cut_network(action, peers_only=False)

    def _cut_peers(self, action: Action) -> tuple[str, Undo | None]:
        return self._cut_network(action, peers_only=True)

    def _drop(self, action: Action) -> tuple[str, Undo | None]:
        return self._cut_network(action, peers_only=False, silently=True)

    def _cut_network(self, action: Action, *, peers_only: bool,
                     silently: bool = False) -> tuple[str, Undo | None]:
        """Take a node's link down (a partition), or only its way to the other nodes, or
        drop everything it sends while its link stays up (``silently``)."""
        if self.lab is None:
            raise InjectionError(f"{action.describe()} needs the nodes in network namespaces")
        lab = self.lab
        node = self.nodes(action.target)[0]
        index = self.job.nodes.index(node)
        detail = f"{self._describe([node])} at {node.host.address}"
        if peers_only:
            lab.cut_peers(index)
            self.cut_off.add(node.name)
            detail += ", store still reachable"
        elif silently:
            lab.drop(index)
            detail += ", everything it sends dropped"
        else:
            lab.cut(index)
        self.impaired.add(node.name)

        def heal() -> str:
            (lab.heal_peers if peers_only else lab.undrop if silently else lab.heal)(index)
            self.impaired.discard(node.name)
            return node.name
        assert action.duration is not None
        return detail, Undo(time.time() + action.duration, f"heal {node.name}", "heal", heal)

    def _preempt(self, action: Action) -> tuple[str, Undo | None]:
        """SIGUSR2 as SLURM's ``--signal=USR2@N`` sends it: to every process of the job
        steps, the etcd-ext agents included (``preempt agents``: to the agents alone)."""
        workers, agents = [], []
        for node in self.nodes("all"):
            if action.target != "agents":
                for pid in node.worker_pids():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGUSR2)
                        workers.append(pid)
            if node.events_file is not None:  # stock torchrun has no handler: it would die
                with contextlib.suppress(ProcessLookupError):
                    os.kill(node.proc.pid, signal.SIGUSR2)
                    agents.append(node.proc.pid)
        if not workers and not agents:
            raise InjectionError("no worker or agent to preempt")
        return f"SIGUSR2 to {len(workers)} worker(s) and {len(agents)} agent(s)", None

    def _notice(self, action: Action) -> tuple[str, Undo | None]:
        """SIGUSR2 to a node's agent and workers, as one node's own SLURM job gets it; to
        every node one after the other over ``duration`` (``notice all over D``)."""
        nodes = self.nodes(action.target)
        gap = (action.duration or 0.0) / max(1, len(nodes) - 1)
        sent = []
        for index, node in enumerate(nodes):
            if index:
                time.sleep(gap)  # the spread is the fault itself, not a wait for something
            for pid in [node.proc.pid, *node.worker_pids()]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGUSR2)
            sent.append(f"{node.name} (group rank {node.group_rank()})")
        return "SIGUSR2 to the agent and workers of " + ", ".join(sent), None

    def _terminate(self, action: Action) -> tuple[str, Undo | None]:
        """SIGTERM to a node's agent alone, as Kubernetes stops a deleted pod."""
        node = self.nodes(action.target)[0]
        detail = self._describe([node])
        with contextlib.suppress(ProcessLookupError):
            os.kill(node.proc.pid, signal.SIGTERM)
        return f"SIGTERM to the agent of {detail}", None

    def _start_node(self, action: Action) -> tuple[str, Undo | None]:
        started = [self.job.add_node().name for _ in range(action.count)]
        return ", ".join(started), None

    def _start_all(self, action: Action) -> tuple[str, Undo | None]:
        started = [self.job.add_node().name for _ in range(self.initial_nodes)]
        return ", ".join(started), None

    def _kill_etcd(self, action: Action) -> tuple[str, Undo | None]:
        cluster = self.job.etcd
        if cluster is None:
            raise InjectionError("this job has no etcd")
        running = [m for m in cluster.members if m.proc is not None and m.proc.popen.poll() is None]
        if action.target == "all":
            victims = running
        else:
            try:
                leader = cluster.leader()
            except RuntimeError as exc:
                raise InjectionError(str(exc)) from None
            if action.target == "leader":
                victims = [leader]
            else:
                victims = [m for m in running if m is not leader][:1]
        if not victims:
            raise InjectionError(f"no etcd {action.target} running")
        for member in victims:
            cluster.stop_member(member)
        names = ", ".join(m.name for m in victims)
        if action.duration is None:
            return names, None

        def restart(members: list[EtcdMember] = victims) -> str:
            for member in members:
                cluster.start_member(member)
            for member in members:
                cluster.wait_healthy(member)
            return ", ".join(m.name for m in members) + " back on their data directories"
        return names, Undo(time.time() + action.duration, f"start etcd {names} again", "etcd-back",
                           restart)

    def _fill_disk(self, action: Action) -> tuple[str, Undo | None]:
        filler = self.snapshot_dir / FILLER
        written = fill(filler)
        detail = f"{written >> 10} KiB filler in {self.snapshot_dir}"
        if action.duration is None:
            return detail, None

        def free() -> str:
            filler.unlink(missing_ok=True)
            return f"removed {filler.name}"
        return detail, Undo(time.time() + action.duration, "free disk", "free-disk", free)


def training_pids(node: Node) -> list[int]:
    """Every process of ``node`` that trains: its agent's workers and, with warm starts
    (where those only relay signals), the workers the warm-start server forked for them,
    as their beacons name them (a fork keeps the server's ``/proc/PID/environ``, so no
    ``RANK`` finds it). Only the node's own processes: a stale beacon's pid may be reused."""
    workers = node.worker_pids()
    controls = {environ_of(pid).get("ELASTIC_EXT_CONTROL_DIR") for pid in workers}
    named: set[int] = set()
    for control in filter(None, controls):
        with contextlib.suppress(OSError):
            for beat in Path(control).glob("beat-*"):
                with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                    named.add(int(json.loads(beat.read_text())["pid"]))
    ours = set(node.proc.pids()) if named else set()
    return sorted(set(workers) | (named & ours))


def fill(path: Path, chunk: int = 1 << 20) -> int:
    """Write ``path`` until its filesystem is full; returns the bytes written."""
    written = 0
    block = b"\0" * chunk
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        size = chunk
        while size >= 512:
            try:
                written += os.write(fd, block[:size])
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                size //= 2
    finally:
        os.close(fd)
    return written
