"""A whole elastic job on this machine: a store, N torchrun nodes, and faults to inject."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elastic_ext.jsonlines import JsonLinesTail, read_json_lines
from elastic_ext.local.etcd import EtcdCluster, call_here, start_cluster
from elastic_ext.local.processes import Proc, ProcessSet, environ_of, wait_until
from elastic_ext.net import free_port
from elastic_ext.rendezvous.agent.events import EventKind

STORES = ("etcd", "embedded", "stock-c10d")


@dataclass(frozen=True)
class JobSpec:
    """What to run: the store, the node range and each node's command after torchrun's flags.

    ``{node}`` in the command becomes each node's name (``node0``, ``node1``...): a
    directory of each node's own, as on machines that share no filesystem.
    """

    command: Sequence[str]
    store: str = "etcd"  # etcd-ext on etcd, etcd-ext on its embedded store, or stock c10d
    nnodes: str = "2:3"
    nproc_per_node: int = 1
    run_id: str = "local-job"
    max_restarts: int = 3
    rdzv_conf: str = ""
    etcd_members: int = 1
    extra_torchrun_args: Sequence[str] = ()
    env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.store not in STORES:
            raise ValueError(f"store must be one of {', '.join(STORES)}, not {self.store!r}")


@dataclass(frozen=True)
class Host:
    """Where a process runs: its address and the command prefix that puts it there.

    Loopback by default; the chaos harness gives each node a network namespace of
    its own (prefix ``ip netns exec NS``) so that one node can be cut off.
    """

    address: str = "127.0.0.1"
    prefix: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()  # e.g. GLOO_SOCKET_IFNAME: gloo would pick loopback


@dataclass
class Node:
    name: str
    proc: Proc
    host: Host = field(default_factory=Host)
    events_file: Path | None = None
    """Where its etcd-ext agent appends its rendezvous events (None on stock c10d)."""

    def kill(self) -> None:
        """SIGKILL the agent and every worker: a machine that died."""
        self.proc.kill()

    def freeze(self) -> None:
        """SIGSTOP the agent and every worker: a machine that hung."""
        self.proc.send(signal.SIGSTOP)

    def thaw(self) -> None:
        self.proc.send(signal.SIGCONT)

    def alive(self) -> bool:
        return self.proc.popen.poll() is None

    def worker_pids(self) -> list[int]:
        """The processes of the agent's live workers: those torchrun gave a ``RANK``. With
        warm start that is each worker's launcher (the agent's child, which relays signals)
        only: the worker the warm-start server forked for it keeps the server's
        ``/proc/PID/environ``, without ``RANK`` (its beacon names it: ``training_pid``,
        ``chaos.inject.training_pids``)."""
        agent = self.proc.pid
        return [pid for pid in self.proc.pids()
                if pid != agent and "RANK" in environ_of(pid) and _alive(pid)]

    def training_pid(self) -> int | None:
        """The pid of one process that trains (local rank 0's): under an etcd-ext agent as
        its beacon names it (with warm starts the agent's child only relays signals to a
        worker forked apart), else the agent's worker itself."""
        pids = self.worker_pids()
        for pid in pids:
            env = environ_of(pid)
            control = env.get("ELASTIC_EXT_CONTROL_DIR")
            if control and env.get("LOCAL_RANK") == "0":
                try:
                    return int(json.loads((Path(control) / "beat-0").read_text())["pid"])
                except (OSError, ValueError, KeyError):
                    return None
        return pids[0] if pids else None

    def events(self, kind: EventKind | None = None) -> list[dict[str, Any]]:
        """The agent's rendezvous events so far (of ``kind``), oldest first."""
        if self.events_file is None:
            return []
        return [e for e in read_json_lines(self.events_file)
                if kind is None or e.get("event") == kind.value]

    def group_rank(self) -> int | None:
        """This node's rank in its latest round: from its etcd-ext agent's events, or on
        stock c10d from ``GROUP_RANK`` in its live workers' environment (None between rounds)."""
        if self.events_file is not None:
            joined = self.events(EventKind.JOINED)
            return int(joined[-1]["rank"]) if joined else None
        for pid in self.worker_pids():
            rank = environ_of(pid).get("GROUP_RANK")
            if rank is not None:
                return int(rank)
        return None

    def hosts_store(self) -> bool:
        """Whether this node's agent hosts the embedded store."""
        return any(e.get("hosts_store") for e in self.events(EventKind.STARTED))

    def workers_store_ports(self) -> set[int]:
        """The ports of the workers' stores of every round this node joined."""
        return {int(e["master_port"]) for e in self.events(EventKind.JOINED)}


class LocalJob:
    def __init__(self, spec: JobSpec, workdir: Path, *,
                 node_host: Callable[[int], Host] | None = None, store_host: Host | None = None,
                 store_call: Callable[[Callable[[], Any]], Any] = call_here) -> None:
        """``node_host(i)`` places the i-th node, ``store_host`` etcd or the embedded store
        (``store_call`` runs the harness's own probes of etcd where etcd can be reached)."""
        self.spec = spec
        self.workdir = workdir
        self.processes = ProcessSet(workdir / "logs")
        self.etcd: EtcdCluster | None = None
        self.nodes: list[Node] = []
        self._endpoint = ""
        self._node_host = node_host or (lambda index: Host())
        self._store_host = store_host or Host()
        self._store_call = store_call

    # -- lifecycle -------------------------------------------------------------------------
    def start(self, nodes: int) -> LocalJob:
        workdir = self.workdir
        workdir.mkdir(parents=True, exist_ok=True)
        store = self._store_host
        if self.spec.store == "etcd":
            self.etcd = start_cluster(self.processes, workdir, size=self.spec.etcd_members,
                                      host=store.address, prefix=store.prefix,
                                      call=self._store_call)
            self._endpoint = self.etcd.endpoints
        elif self.spec.store == "embedded":
            self._endpoint = f"c10d://{store.address}:{free_port()}"
        else:
            self._endpoint = f"{store.address}:{free_port()}"
        for _ in range(nodes):
            self.add_node()
        return self

    def add_node(self) -> Node:
        name = f"node{len(self.nodes)}"
        host = self._node_host(len(self.nodes))
        spec = self.spec
        backend = "c10d" if spec.store == "stock-c10d" else "etcd-ext"
        conf = [spec.rdzv_conf] if spec.rdzv_conf else []
        events_file = None
        if backend == "etcd-ext":
            events_file = self.workdir / "events" / f"{name}.jsonl"
            conf.append(f"events_file={events_file}")
        cmd = [*host.prefix, sys.executable, "-m", "torch.distributed.run",
               f"--nnodes={spec.nnodes}", f"--nproc-per-node={spec.nproc_per_node}",
               f"--rdzv-backend={backend}",
               f"--rdzv-endpoint={self._endpoint}", f"--rdzv-id={spec.run_id}",
               f"--local-addr={host.address}", f"--max-restarts={spec.max_restarts}",
               "--monitor-interval=0.1", *spec.extra_torchrun_args]
        if conf:
            cmd.append(f"--rdzv-conf={','.join(conf)}")
        cmd += [arg.replace("{node}", name) for arg in spec.command]
        env = dict(os.environ)
        env.update({"OMP_NUM_THREADS": "1", "LOGLEVEL": "INFO", **dict(host.env), **spec.env})
        node = Node(name, self.processes.spawn(name, cmd, env=env), host, events_file)
        self.nodes.append(node)
        return node

    @property
    def endpoint(self) -> str:
        """The ``--rdzv-endpoint`` every node was given (set by ``start``)."""
        return self._endpoint

    def store_host(self) -> Node | None:
        """The node whose agent hosts the embedded store (None on etcd and stock c10d)."""
        return next((n for n in self.nodes if n.hosts_store()), None)

    def rank0_node(self) -> Node:
        for node in self.nodes:
            if node.alive() and node.group_rank() == 0:
                return node
        raise LookupError("no live node reports group rank 0")

    def other_node(self, than: Node) -> Node:
        return next(n for n in self.nodes if n is not than and n.alive())

    def wait(self, timeout: float) -> list[int]:
        deadline = time.monotonic() + timeout
        return [n.proc.wait(max(0.1, deadline - time.monotonic())) for n in self.nodes]

    def cleanup(self) -> None:
        self.processes.cleanup()

    def __enter__(self) -> LocalJob:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()


def _alive(pid: int) -> bool:
    """True unless ``pid`` is gone or a zombie (``/proc/PID/stat`` state ``Z``)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_for_step(metrics: Path, *, after: float, world_size: int, timeout: float,
                  poll: float = 0.05) -> dict[str, Any]:
    """The first ``step`` event logged after ``after`` (unix time) at ``world_size``."""
    tail = JsonLinesTail(metrics)

    def found() -> dict[str, Any] | None:
        for event in tail.poll():
            if event.get("event") == "step" and event["time"] > after \
                    and event["world_size"] == world_size:
                return event
        return None
    return wait_until(found, timeout, poll, f"a step at world size {world_size}")
