"""Rendezvous at scale: N simulated agents on etcd-ext (etcd and embedded) and stock c10d.

1,024 processes that each import torch do not fit on a small machine, so the agents are
threads: the survivors are spread over worker processes of at most ``--per-process``
threads each, and one agent, the victim, lives alone in a process of its own. Every
worker process imports torch and the rendezvous modules first, says it is ready, and
waits on a start barrier (a pipe the main process closes once all are ready). With
``--forked`` every agent has a process of its own instead, as on real machines: one
process imports torch and the rendezvous modules, then forks one process per agent
(the imports shared copy-on-write: a thousand imports of torch take minutes and
gigabytes), and the CPU they spend is each agent's own. Each
agent then does what torchrun's agent does with ``--nnodes=N-K:N`` (``--kill K``, 1 by
default):

  etcd      etcd-ext on a private etcd (started on loopback for each case, fresh data dir)
  embedded  etcd-ext on its embedded c10d TCPStore (``c10d://127.0.0.1:PORT``), hosted by
            agent 0 (``local_addr`` 127.0.0.1 and ``is_host=true``; the others have
            addresses of their own, 127.0.x.y, and ``is_host=false``)
  stock     torch's own c10d rendezvous (``DynamicRendezvousHandler``), agent 0's process
            hosts the TCPStore (``is_host``), ``last_call_timeout=1`` like etcd-ext's default

Measured, per case (one backend, one N, one repetition):

  round 1    start barrier -> every agent has its rank: building its handler (connecting
             to the store), ``next_rendezvous()`` and (unless ``--no-worker-ranks``) the
             worker rank assignment torchrun's agent does next on the round's store; ranks
             must be a permutation of range(N), world sizes all N
  round 2    SIGKILL of the K victims' processes (right after round 1 completed everywhere)
             -> every survivor has a rank in a round of N-K (ranks a permutation).
             etcd-ext survivors poll ``num_nodes_waiting()`` every 0.1 s from their first
             round on, as torchrun's agent does, and call ``next_rendezvous()`` when it is
             positive: they detect the death themselves. After each round an etcd-ext
             agent records a training step, as its workers would (so survivors do not
             probe their peers as after a round without progress). Stock c10d gives survivors no
             such signal (under torchrun their workers would fail), so they are told to
             call ``next_rendezvous()`` at the kill: this favours stock.
  false deaths  etcd-ext: the distinct agents some agent declared dead (its ``node_dead``
             event) that were alive: any before the kill, any but the victims after it.
             A live agent declared dead is a false death the job pays for with a round
  requests   etcd only: requests etcd received (``grpc_server_msg_received_total`` from its
             ``/metrics``, all methods: unary calls and stream messages such as watch
             creations and lease keep-alives) from the barrier to round 1 seen complete,
             and per second over ``--steady`` seconds after round 2 (N-K agents idle)
  CPU        user+system seconds over the round-1 window of the worker processes (all
             agents; the embedded and stock store run inside agent 0's process) and of etcd;
             per agent: that over N, and over the round change (kill to round 2) over the
             survivors, in ms (with --forked, the agents' own CPU, machine-independent but
             for the machine's speed)

A phase that does not finish within ``--cap`` seconds counts as "no round"; the run goes
on. Every process started here is in a process group of its own and is killed with it.

On some machines every TCPStore connect waits for a reverse-DNS look-up that times out
(5 s); ``--res-options`` sets ``RES_OPTIONS="timeout:1 attempts:1"`` for the worker
processes (the default runs them as they are; the output says which).

Usage: python benchmarks/scale.py [--sizes 8,32,128,256,1024] [--backends etcd,embedded,stock]
       [--reps 3] [--cap 120] [--steady 10] [--per-process 64] [--res-options]
Progress goes to stderr, the table (markdown) to stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime as dt
import gc
import importlib
import json
import logging
import math
import os
import queue
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from elastic_ext.chaos.throttle import DutyCycle
from elastic_ext.local.etcd import received_requests, sent_bytes
from elastic_ext.net import free_ports

if str(Path(__file__).resolve().parent) not in sys.path:  # python -m benchmarks.NAME
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import terminated_by_sigterm  # noqa: E402  (benchmarks/common.py, a sibling)

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous import RendezvousHandler

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[1]
BACKENDS = {"etcd": "etcd-ext on etcd", "embedded": "etcd-ext embedded", "stock": "stock c10d"}
SHORT = {"etcd": "etcd", "embedded": "embedded", "stock": "stock"}
RES_OPTIONS = "timeout:1 attempts:1"
POLL_S = 0.1  # torchrun's --monitor-interval default: how often its agent asks
SETUP_TIMEOUT_S = 300.0  # workers importing torch, before the barrier (not timed)
METRICS_TIMEOUT_S = 120.0  # an etcd that 1,024 agents keep busy answers its /metrics late
ETCD_BIN = shutil.which("etcd") or "/usr/bin/etcd"
_CLK_TCK = os.sysconf("SC_CLK_TCK")
_PR_SET_PDEATHSIG = 1


# -- the worker process ----------------------------------------------------------------------

def agent_addr(index: int) -> str:
    """A loopback address of agent ``index``'s own: agent 0 is 127.0.0.1."""
    return f"127.0.{index // 254}.{index % 254 + 1}"


def assign_worker_ranks(store: Any, rank: int, world: int) -> None:
    """What torchrun's agent does with the round's store before it starts its workers
    (torch's ``SimpleElasticAgent._assign_worker_ranks``, its default path, one worker
    per agent): each agent writes its role, rank 0 waits for every agent's and writes all
    their ranks, each agent waits for its own. The waits are the store's own."""
    store.set(f"torchelastic/role_info/{rank}", f"default:{rank}:1")
    if rank == 0:
        store.multi_get([f"torchelastic/role_info/{i}" for i in range(world)])
        store.multi_set([f"torchelastic/assigned_ranks/{i}" for i in range(world)],
                        [json.dumps([i, world, i, world]) for i in range(world)])
    store.get(f"torchelastic/assigned_ranks/{rank}")


def _worker(spec: dict[str, Any]) -> int:
    """One worker process: import everything, then run its groups of agent threads: the
    one group itself, or each of several in a child forked now (``--forked``: one process
    per agent without a thousand imports of torch). A group waits at the barrier, then
    runs its agents until its process is killed."""
    events = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # stray prints go to the log, never into the event stream
    logging.basicConfig(level=spec["log_level"], stream=sys.stderr,
                        format="%(asctime)s %(process)d %(threadName)s %(name)s: %(message)s")
    lock = threading.Lock()
    me = {"worker": spec["groups"][0][0]}

    def emit(kind: str, **fields: Any) -> None:
        # one write of a short line: the forked children's lines never interleave
        line = json.dumps({"kind": kind, "t": time.monotonic(), **me, **fields})
        with lock:
            events.write(line + "\n")
            events.flush()

    import torch
    from torch.distributed.elastic.rendezvous import (
        RendezvousParameters,
        rendezvous_handler_registry,
    )

    from elastic_ext.agent.control import AgentControl
    from elastic_ext.agent.setup import settings_from_params
    from elastic_ext.rendezvous.agent.handler import EtcdExtRendezvousHandler
    from elastic_ext.rendezvous.stores.open import open_backend

    class Verdicts(logging.Handler):
        """The etcd-ext agents' death verdicts (their ``node_dead`` events), as events."""

        def emit(self, record: logging.LogRecord) -> None:
            found = DEATH_RE.search(record.getMessage())
            if found:
                emit_event("dead", peer=found.group(1))

    emit_event = emit
    events_logger = logging.getLogger("elastic_ext.rendezvous.agent.events")
    events_logger.setLevel(logging.INFO)  # the verdicts, whatever the log level
    events_logger.addHandler(Verdicts())
    events_logger.propagate = logging.getLogger().getEffectiveLevel() <= logging.INFO

    backend: str = spec["backend"]
    warm = {"etcd": "elastic_ext.rendezvous.stores.etcd.backend",
            "embedded": "elastic_ext.rendezvous.stores.c10d.backend",
            "stock": "torch.distributed.elastic.rendezvous.c10d_rendezvous_backend"}[backend]
    try:  # what building a handler imports, so that the timed window holds no imports
        importlib.import_module(warm)
    except ImportError:
        pass
    n: int = spec["n"]
    handlers: list[RendezvousHandler] = []  # kept alive (their heartbeats) until killed
    rejoin = threading.Event()
    controls: dict[int, AgentControl] = {}  # etcd-ext agents' control directories

    def build(index: int) -> RendezvousHandler:
        conf: dict[str, Any] = {}
        if backend != "stock":
            conf.update(item.split("=", 1) for item in spec["conf"].split(",") if item)
        if backend != "etcd":
            conf["is_host"] = "true" if index == 0 else "false"
        if backend == "stock":
            conf["last_call_timeout"] = 1
        params = RendezvousParameters(
            backend="c10d" if backend == "stock" else "etcd-ext", endpoint=spec["endpoint"],
            run_id=spec["run_id"], min_nodes=n - spec["kill"], max_nodes=n,
            local_addr=agent_addr(index),
            **conf)
        if backend == "stock":
            return rendezvous_handler_registry.create_handler(params)
        settings = settings_from_params(params)
        # each agent's control directory in the case's own (torchrun's agent makes one in
        # node memory, and first scans it for abandoned ones: a thousand scans here)
        control = AgentControl(Path(spec["control_dir"]) / f"agent-{index}")
        controls[index] = control
        return EtcdExtRendezvousHandler(settings, open_backend(settings), backend_name="etcd-ext",
                                        control=control)

    def rendezvous(handler: RendezvousHandler, index: int) -> None:
        info = handler.next_rendezvous()
        if spec["worker_ranks"]:
            assign_worker_ranks(info.store, info.rank, info.world_size)
        emit("ranked", agent=index, rank=info.rank, world=info.world_size)
        if index in controls:  # the workers a real agent would start trained a step
            controls[index].record_progress()

    def agent(index: int) -> None:
        try:
            handler = build(index)
            handlers.append(handler)
            node = handler.node_id if isinstance(handler, EtcdExtRendezvousHandler) else None
            emit("connected", agent=index, node=node)
            rendezvous(handler, index)
            if backend == "stock":
                rejoin.wait()
                emit("rejoin", agent=index)
                rendezvous(handler, index)
                return
            while True:  # torchrun's agent loop while its workers are healthy
                time.sleep(POLL_S)
                if handler.num_nodes_waiting() > 0:
                    emit("rejoin", agent=index)
                    rendezvous(handler, index)
        except Exception as exc:
            logger.exception("agent %d failed", index)
            emit("error", agent=index, error=f"{type(exc).__name__}: {exc}"[:300])

    def run_group(worker: int, agents: list[int]) -> None:
        me["worker"] = worker
        signal.signal(signal.SIGUSR1, lambda *_: rejoin.set())  # stock: rejoin now
        emit("ready", torch=torch.__version__, pid=os.getpid())
        while os.read(spec["barrier_fd"], 1):  # EOF: the main process released everyone
            pass
        for index in agents:
            threading.Thread(target=agent, args=(index,), name=f"agent-{index}",
                             daemon=True).start()

    groups: list[tuple[int, list[int]]] = [(w, list(a)) for w, a in spec["groups"]]
    if len(groups) == 1:
        run_group(*groups[0])
    else:
        gc.freeze()  # the imports' objects stay shared with the children, not copied
        for worker, agents in groups:
            if os.fork() == 0:  # one thread here yet: safe
                _die_with_parent()
                run_group(worker, agents)
                while True:
                    signal.pause()  # the agents' threads run until this process is killed
    for _ in sys.stdin:  # EOF: the main process is gone (forked children die with this one)
        pass
    os._exit(0)


# -- processes -------------------------------------------------------------------------------

_libc: ctypes.CDLL | None
try:
    _libc = ctypes.CDLL(None, use_errno=True)
except OSError:
    _libc = None


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the main process dies (killed with SIGKILL)."""
    if _libc is not None:
        _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def spawn(command: list[str], log: Path, *, env: dict[str, str] | None = None,
          pass_fds: tuple[int, ...] = (), pipes: bool = False) -> subprocess.Popen[bytes]:
    """A child in a session (so a process group) of its own, output to ``log``."""
    with open(log, "wb") as out:
        return subprocess.Popen(
            command, stdin=subprocess.PIPE if pipes else subprocess.DEVNULL,
            stdout=subprocess.PIPE if pipes else out, stderr=out, env=env, pass_fds=pass_fds,
            start_new_session=True, preexec_fn=_die_with_parent)


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        logger.warning("process %d did not die", proc.pid)
    for pipe in (proc.stdin, proc.stdout):
        if pipe is not None:
            try:
                pipe.close()
            except OSError:
                pass


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a live process, all its threads."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


_http = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def agent_cores(etcd_core: int) -> set[int]:
    """The CPUs the agents may use when etcd is pinned to ``etcd_core`` (checked in
    ``main``: there is another)."""
    return os.sched_getaffinity(0) - {etcd_core}


class Etcd:
    """A private one-member etcd on loopback."""

    def __init__(self, workdir: Path) -> None:
        self.port, peer = free_ports(2, "127.0.0.1")
        client, peer_url = f"http://127.0.0.1:{self.port}", f"http://127.0.0.1:{peer}"
        self.log = workdir / "etcd.log"
        self.proc = spawn([ETCD_BIN, "--name", "m0", "--data-dir", str(workdir / "etcd"),
                           "--listen-client-urls", client, "--advertise-client-urls", client,
                           "--listen-peer-urls", peer_url,
                           "--initial-advertise-peer-urls", peer_url,
                           "--initial-cluster", f"m0={peer_url}",
                           "--initial-cluster-state", "new", "--log-level", "warn"], self.log)
        deadline = time.monotonic() + 30
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited: {tail(self.log)}")
            try:
                with _http.open(f"{client}/health", timeout=1) as reply:
                    if json.loads(reply.read()).get("health") == "true":
                        return
            except (OSError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"etcd not healthy within 30s: {tail(self.log)}")
            time.sleep(0.1)

    def requests(self) -> Counter[str]:
        """Messages etcd's gRPC server received so far, by method.

        Raises:
            MetricsUnanswered: etcd did not answer within ``METRICS_TIMEOUT_S``.
        """
        with _answered():
            return received_requests(f"http://127.0.0.1:{self.port}",
                                     timeout=METRICS_TIMEOUT_S)

    def sent_bytes(self) -> int:
        """Bytes etcd sent its gRPC clients so far (the JSON gateway among them).

        Raises:
            MetricsUnanswered: etcd did not answer within ``METRICS_TIMEOUT_S``.
        """
        with _answered():
            return sent_bytes(f"http://127.0.0.1:{self.port}", timeout=METRICS_TIMEOUT_S)

    def cpu(self) -> float | None:
        return cpu_seconds(self.proc.pid)


class MetricsUnanswered(Exception):
    """etcd did not answer its ``/metrics`` in time (2,048 thread-packed agents on 2 cores):
    before the start the case goes on without request counts (``_first_count``); later
    the rest of the case has no figures."""


@contextlib.contextmanager
def _answered() -> Iterator[None]:
    try:
        yield
    except OSError as exc:  # requests' errors are OSErrors: a refused or timed-out connect
        raise MetricsUnanswered(f"etcd's /metrics did not answer within "
                                f"{METRICS_TIMEOUT_S:g}s: {type(exc).__name__}") from exc


def tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


# -- one case --------------------------------------------------------------------------------

def layout(n: int, per_process: int, kill: int = 1) -> list[list[int]]:
    """Agent indices per worker process: survivors in even blocks (agent 0 in the first),
    then each of the ``kill`` victims, the last agents, alone."""
    survivors = n - kill
    procs = max(1, math.ceil(survivors / per_process))
    base, extra = divmod(survivors, procs)
    groups, start = [], 0
    for p in range(procs):
        size = base + (1 if p < extra else 0)
        groups.append(list(range(start, start + size)))
        start += size
    return [*groups, *([i] for i in range(survivors, n))]


def describe_layout(n: int, per_process: int, kill: int = 1, forked: bool = False) -> str:
    if forked:
        return f"{n} processes, one per agent, forked from one that imported torch"
    sizes = [len(g) for g in layout(n, per_process, kill)[:-kill]]
    procs = len(sizes)
    threads = f"{max(sizes)}" if min(sizes) == max(sizes) else f"{min(sizes)}-{max(sizes)}"
    victims = "the victim alone" if kill == 1 else f"{kill} victims, each alone"
    return f"{procs + kill} processes: {procs} x {threads} threads + {victims}"


@dataclass
class Outcome:
    """One number of one case, or why there is none (neither: not applicable)."""

    value: float | None = None
    failure: str | None = None


@dataclass
class CaseResult:
    round1: Outcome = field(default_factory=Outcome)
    round2: Outcome = field(default_factory=Outcome)
    requests: Outcome = field(default_factory=Outcome)
    rate: Outcome = field(default_factory=Outcome)
    change_requests: Outcome = field(default_factory=Outcome)  # round 2, per survivor
    change_kb: Outcome = field(default_factory=Outcome)  # round 2, per survivor
    # the same less what an idle agent costs over as long (the keeper's ticks): the
    # rendezvous' own, which should not grow with N (issue 27)
    change_kb_net: Outcome = field(default_factory=Outcome)
    cpu_agents: Outcome = field(default_factory=Outcome)
    cpu_per_agent: Outcome = field(default_factory=Outcome)  # round 1, ms
    cpu_change_per_agent: Outcome = field(default_factory=Outcome)  # round 2, ms per survivor
    cpu_etcd: Outcome = field(default_factory=Outcome)
    idle_cpu_agent: Outcome = field(default_factory=Outcome)  # ms per agent per second
    idle_cpu_etcd: Outcome = field(default_factory=Outcome)  # ms per agent per second
    false_restarts: int = 0
    false_deaths: int | None = None  # live agents declared dead (etcd-ext; distinct nodes)
    notes: list[str] = field(default_factory=list)


class CaseFailure(Exception):
    """An agent failed or a worker process died: the case has no number for this phase."""

    def __init__(self, detail: str, short: str) -> None:
        super().__init__(detail)
        self.short = short  # for the table


DEATH_RE = re.compile(r"node (\S+) declared dead")
"""An etcd-ext agent's death verdict, as its ``node_dead`` event logs it."""


@dataclass
class Agent:
    node: str | None = None  # its etcd-ext node id
    connected: float | None = None
    ranks: list[tuple[float, int, int]] = field(default_factory=list)  # (t, rank, world)
    rejoins: list[float] = field(default_factory=list)
    last: str = ""


@dataclass
class Worker:
    """A process of agents: one started here, or one its ``proc`` forked (``--forked``)."""

    index: int
    agents: list[int]
    proc: subprocess.Popen[bytes]
    log: Path
    forked: bool = False
    pid: int | None = None  # from its ``ready``
    ready: bool = False
    expected_exit: bool = False


class Case:
    def __init__(self, backend: str, n: int, rep: int, args: argparse.Namespace,
                 workdir: Path) -> None:
        self.backend, self.n, self.rep, self.args = backend, n, rep, args
        self.workdir = workdir
        self.cap: float = args.cap
        self.etcd: Etcd | None = None
        self.meter: Etcd | None = None  # the etcd whose request counters are read, if any
        self.workers: list[Worker] = []
        self.agents = [Agent() for _ in range(n)]
        self.events: queue.Queue[tuple[int, dict[str, Any] | None]] = queue.Queue()
        self.verdicts: list[tuple[float, str]] = []  # (t, node declared dead), by anyone
        self.t_kill: float | None = None
        self.throttle: DutyCycle | None = None
        self.torch_version = ""
        self.readers: list[threading.Thread] = []

    def say(self, text: str) -> None:
        print(f"  [{BACKENDS[self.backend]} N={self.n} rep {self.rep + 1}] {text}",
              file=sys.stderr, flush=True)

    def run(self) -> CaseResult:
        self.workdir.mkdir(parents=True)
        result = CaseResult()
        try:
            self._run(result)
        except MetricsUnanswered as exc:
            self.say(str(exc))
            for phase in (result.round1, result.round2):
                if phase.value is None and phase.failure is None:
                    phase.failure = "failed: etcd overloaded"
        finally:
            self.cleanup()
        if self.backend != "stock":
            result.false_deaths = self._false_deaths()
        return result

    def _false_deaths(self) -> int:
        """Distinct agents declared dead that were alive: any before the kill, and after
        it any but the victims."""
        victims = {self.agents[i].node for w in self.workers[-self.args.kill:] for i in w.agents}
        t_kill = self.t_kill if self.t_kill is not None else math.inf
        wrong = {peer for t, peer in self.verdicts if t < t_kill or peer not in victims}
        self.say(f"declared dead: {len({peer for _, peer in self.verdicts})} agent(s), "
                 f"{len(wrong)} of them alive")
        return len(wrong)

    def _first_count(self) -> Counter[str]:
        """etcd's request counters before the start barrier; when etcd does not answer
        them (2,048 agents), the case goes on without request counts."""
        self.meter = self.etcd
        if self.meter is None:
            return Counter()
        try:
            return self.meter.requests()
        except MetricsUnanswered as exc:
            self.say(f"{exc}: the case goes on without etcd's request counts")
            self.meter = None
            return Counter()

    # -- setting up --------------------------------------------------------------------------
    def _start_workers(self) -> int:
        """Start the worker processes; returns the write end of the barrier pipe."""
        if self.backend == "etcd":
            self.etcd = Etcd(self.workdir)
            endpoint = f"127.0.0.1:{self.etcd.port}"
            if self.args.etcd_core is not None:
                os.sched_setaffinity(self.etcd.proc.pid, {self.args.etcd_core})
            if self.args.etcd_throttle is not None:
                pid = self.etcd.proc.pid
                self.throttle = DutyCycle(lambda: [pid], fraction=self.args.etcd_throttle,
                                          name="etcd").start()
        else:
            port = free_ports(1, "127.0.0.1")[0]
            endpoint = f"c10d://127.0.0.1:{port}" if self.backend == "embedded" \
                else f"127.0.0.1:{port}"
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        if self.args.res_options:
            env["RES_OPTIONS"] = RES_OPTIONS
        barrier_read, barrier_write = os.pipe()
        groups = list(enumerate(layout(self.n, 1 if self.args.forked else self.args.per_process,
                                       self.args.kill)))
        # --forked: one process imports, then forks a process per agent
        started = [groups] if self.args.forked else [[group] for group in groups]
        try:
            for mine in started:
                index = mine[0][0]
                spec = {"backend": self.backend, "endpoint": endpoint, "n": self.n,
                        "run_id": f"scale-{self.backend}-{self.n}-{self.rep}", "groups": mine,
                        "barrier_fd": barrier_read, "conf": self.args.conf,
                        "control_dir": str(self.workdir / f"control-{index}"),
                        "log_level": self.args.log_level, "kill": self.args.kill,
                        "worker_ranks": self.args.worker_ranks}
                log = self.workdir / f"worker-{index}.log"
                proc = spawn([sys.executable, str(Path(__file__).resolve()), "--worker",
                              json.dumps(spec)], log, env=env, pass_fds=(barrier_read,),
                             pipes=True)
                if self.args.etcd_core is not None and self.backend == "etcd":
                    # before the imports: its threads and forks inherit it
                    os.sched_setaffinity(proc.pid, agent_cores(self.args.etcd_core))
                self.workers += [Worker(i, agents, proc, log, forked=self.args.forked)
                                 for i, agents in mine]
        except BaseException:
            os.close(barrier_write)
            raise
        finally:
            os.close(barrier_read)
        # Readers only now: ``spawn`` runs code between fork and exec, safe with one thread.
        for worker in self.workers:
            if worker.forked and worker.index != self.workers[0].index:
                continue  # the forked share their starter's stream
            reader = threading.Thread(target=self._read, args=(worker,), daemon=True)
            reader.start()
            self.readers.append(reader)
        return barrier_write

    def _read(self, worker: Worker) -> None:
        stream = worker.proc.stdout
        assert stream is not None
        try:
            for raw in stream:
                try:
                    event = json.loads(raw)
                except ValueError:
                    continue
                if isinstance(event, dict):
                    self.events.put((worker.index, event))
        except (OSError, ValueError):
            pass  # closed at clean-up
        self.events.put((worker.index, None))

    # -- waiting -----------------------------------------------------------------------------
    def collect(self, done: Callable[[], bool], deadline: float) -> bool:
        """Take in events until ``done()`` (True) or ``deadline`` (False).

        Raises:
            CaseFailure: an agent reported an error, or a worker process ended unasked.
        """
        while not done():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                index, event = self.events.get(timeout=min(left, 0.5))
            except queue.Empty:
                continue
            worker = self.workers[event.get("worker", index) if event else index]
            if event is None:
                if not worker.expected_exit:
                    code = worker.proc.wait(timeout=10)
                    raise CaseFailure(f"worker {index} exited ({code}): {tail(worker.log, 5)}",
                                      f"failed: worker exited ({code})")
                continue
            kind, agent = event["kind"], event.get("agent")
            if kind == "dead":
                self.verdicts.append((float(event["t"]), str(event["peer"])))
                continue
            if kind == "ready":
                worker.ready = True
                worker.pid = int(event["pid"])
                self.torch_version = str(event.get("torch", ""))
                continue
            if not isinstance(agent, int):
                continue
            state = self.agents[agent]
            state.last = kind
            if kind == "connected":
                state.connected = float(event["t"])
                state.node = event.get("node")
            elif kind == "ranked":
                state.ranks.append((float(event["t"]), int(event["rank"]), int(event["world"])))
            elif kind == "rejoin":
                state.rejoins.append(float(event["t"]))
            elif kind == "error":
                error = str(event.get("error"))
                raise CaseFailure(f"agent {agent}: {error}", f"failed: {error.split(':')[0]}")
        return True

    def _all_ready(self) -> bool:
        return all(w.ready for w in self.workers)

    def _cpu_agents(self, workers: list[Worker] | None = None) -> float:
        """CPU seconds of the agents' processes so far (of ``workers``, by default all)."""
        return sum(cpu_seconds(w.pid) or 0.0 for w in workers or self.workers
                   if w.pid is not None)

    # -- the case ----------------------------------------------------------------------------
    def _run(self, result: CaseResult) -> None:
        n, cap = self.n, self.cap
        no_round = f"no round within {cap:g}s"
        try:
            barrier = self._start_workers()
        except (OSError, RuntimeError) as exc:
            result.round1.failure = "failed: set-up"
            self.say(f"set-up failed: {exc}")
            return
        try:
            started = time.monotonic()
            if not self.collect(self._all_ready, started + SETUP_TIMEOUT_S):
                raise CaseFailure(f"workers not ready within {SETUP_TIMEOUT_S:g}s",
                                  "failed: set-up")
            self.say(f"{len(self.workers)} workers imported torch in "
                     f"{time.monotonic() - started:.1f}s")
            requests0 = self._first_count()
            cpu0 = self._cpu_agents()
            etcd_cpu0 = self.etcd.cpu() if self.etcd else None
            t_barrier = time.monotonic()
        except BaseException as exc:
            os.close(barrier)
            if isinstance(exc, CaseFailure):
                result.round1.failure = exc.short
                self.say(str(exc))
                return
            raise
        os.close(barrier)  # every worker's read returns: go

        # round 1
        try:
            complete = self.collect(lambda: all(a.ranks for a in self.agents), t_barrier + cap)
        except CaseFailure as exc:
            self.say(f"round 1 failed: {exc}")
            result.round1.failure = exc.short
            return
        if complete:  # the time first: etcd's figures may not come (``MetricsUnanswered``)
            result.round1.value = max(a.ranks[0][0] for a in self.agents) - t_barrier
        requests1 = self.meter.requests() if self.meter else Counter()
        cpu1 = self._cpu_agents() - cpu0
        etcd_cpu = (self.etcd.cpu() or 0.0) - (etcd_cpu0 or 0.0) if self.etcd else None
        used = requests1 - requests0
        load = (f"{sum(used.values())} etcd requests ({self._top(used)}), " if self.meter
                else "") + f"CPU agents {cpu1:.1f}s" + \
            (f" etcd {etcd_cpu:.1f}s" if etcd_cpu is not None else "")
        if not complete:
            ranked = sum(1 for a in self.agents if a.ranks)
            self.say(f"round 1: {no_round} ({ranked} of {n} agents ranked; {load})")
            result.round1.failure = no_round
            return
        first = [a.ranks[0] for a in self.agents]
        if sorted(r for _, r, _ in first) != list(range(n)) or any(w != n for _, _, w in first):
            result.round1.value, result.round1.failure = None, "ranks not a permutation"
            self.say(f"round 1: ranks {[r for _, r, _ in first]} worlds "
                     f"{sorted({w for _, _, w in first})}")
            return
        result.round1.value = max(t for t, _, _ in first) - t_barrier
        connects = [a.connected - t_barrier for a in self.agents if a.connected is not None]
        result.cpu_agents.value = cpu1
        result.cpu_per_agent.value = cpu1 / n * 1000
        if self.meter:
            result.requests.value = sum(used.values())
        if self.etcd:
            result.cpu_etcd.value = etcd_cpu
        self.say(f"round 1 {result.round1.value:.2f}s (handlers built: median "
                 f"{statistics.median(connects):.2f}s, last {max(connects):.2f}s); {load}")

        # round 2: kill the victims
        kill = self.args.kill
        victims, living = self.workers[-kill:], self.workers[:-kill]
        survivors = [i for w in living for i in w.agents]
        for victim in victims:
            victim.expected_exit = True
        self.say("killing agent(s) of round-1 rank "
                 + ", ".join(str(self.agents[i].ranks[0][1]) for w in victims for i in w.agents))
        requests_kill = self.meter.requests() if self.meter else Counter()
        bytes_kill = self.meter.sent_bytes() if self.meter else 0
        cpu_kill = self._cpu_agents(living)
        t_kill = self.t_kill = time.monotonic()
        for victim in victims:
            if victim.forked:
                assert victim.pid is not None
                os.kill(victim.pid, signal.SIGKILL)
            else:
                os.killpg(victim.proc.pid, signal.SIGKILL)
        if self.backend == "stock":
            for worker in living:
                assert worker.pid is not None
                os.kill(worker.pid, signal.SIGUSR1)
        early = sum(1 for a in self.agents if any(t < t_kill for t in a.rejoins))
        result.false_restarts += early

        def formed() -> bool:
            latest = []
            for i in survivors:
                agent = self.agents[i]
                if agent.last != "ranked" or agent.ranks[-1][0] < t_kill \
                        or agent.ranks[-1][2] != n - kill:
                    return False
                latest.append(agent.ranks[-1][1])
            return sorted(latest) == list(range(n - kill))

        try:
            complete = self.collect(formed, t_kill + cap)
        except CaseFailure as exc:
            self.say(f"round 2 failed: {exc}")
            result.round2.failure = exc.short
            return
        if not complete:
            result.round2.failure = no_round
            self.say(f"round 2: {no_round} after the kill; {self._noticed(survivors, t_kill)}")
            return
        result.round2.value = max(self.agents[i].ranks[-1][0] for i in survivors) - t_kill
        result.cpu_change_per_agent.value = \
            (self._cpu_agents(living) - cpu_kill) / len(survivors) * 1000
        if self.meter:
            change = self.meter.requests() - requests_kill
            result.change_requests.value = sum(change.values()) / len(survivors)
            result.change_kb.value = (self.meter.sent_bytes() - bytes_kill) / 1024 / len(survivors)
            self.say(f"round change per survivor: {result.change_requests.value:.1f} requests "
                     f"({self._top(change)}), {result.change_kb.value:.1f} KB from etcd")
        self.say(f"round 2 {result.round2.value:.2f}s after the kill; "
                 f"{self._noticed(survivors, t_kill)}"
                 + (f"; {early} agents saw num_nodes_waiting() > 0 before the kill"
                    if early else ""))

        # steady state (etcd only: the other stores have no request counter)
        if self.meter is None:
            return
        steady_from = time.monotonic()
        before = self.meter.requests()
        bytes_before = self.meter.sent_bytes()
        cpu_idle0 = self._cpu_agents(living)
        etcd_idle0 = self.etcd.cpu() if self.etcd else None
        try:
            self.collect(lambda: False, steady_from + self.args.steady)
        except CaseFailure as exc:
            self.say(f"steady state: {exc}")
            result.rate.failure = "failed"
            return
        used = self.meter.requests() - before
        idle_bytes = self.meter.sent_bytes() - bytes_before
        elapsed = time.monotonic() - steady_from
        late = sum(1 for a in self.agents if any(t >= steady_from for t in a.rejoins))
        result.false_restarts += late
        result.rate.value = sum(used.values()) / elapsed
        per_agent_s = 1000 / elapsed / len(survivors)  # seconds of CPU -> ms per agent per s
        result.idle_cpu_agent.value = (self._cpu_agents(living) - cpu_idle0) * per_agent_s
        etcd_idle1 = self.etcd.cpu() if self.etcd else None
        if etcd_idle0 is not None and etcd_idle1 is not None:
            result.idle_cpu_etcd.value = (etcd_idle1 - etcd_idle0) * per_agent_s
        idle_kb = idle_bytes / 1024 / elapsed / len(survivors)  # per agent per second
        if result.change_kb.value is not None and result.round2.value is not None:
            result.change_kb_net.value = result.change_kb.value - idle_kb * result.round2.value
        self.say(f"steady {result.rate.value:.0f} requests/s over {elapsed:.1f}s "
                 f"({self._top(used)}), {idle_kb:.2f} KB/s per agent from etcd; the round "
                 f"change less that: {result.change_kb_net.value or 0:.1f} KB per agent; "
                 f"idle CPU per agent per second: {result.idle_cpu_agent.value:.2f} ms, etcd's "
                 f"for it {result.idle_cpu_etcd.value or 0:.2f} ms"
                 + (f"; {late} agents restarted while idle" if late else ""))

    def _noticed(self, survivors: list[int], t_kill: float) -> str:
        """When the survivors went back into the rendezvous, from the kill."""
        back = [min(t for t in self.agents[i].rejoins if t >= t_kill) - t_kill
                for i in survivors if any(t >= t_kill for t in self.agents[i].rejoins)]
        if not back:
            return "no survivor went back into the rendezvous"
        how = "told at the kill" if self.backend == "stock" else "noticed"
        return (f"{len(back)} of {len(survivors)} survivors {how} and rejoined after "
                f"{min(back):.2f}s (first) to {max(back):.2f}s (last)")

    @staticmethod
    def _top(counts: Counter[str]) -> str:
        return ", ".join(f"{m} {c}" for m, c in counts.most_common(4) if c) or "none"

    def cleanup(self) -> None:
        if self.throttle is not None:
            self.throttle.stop()
        for proc in {id(w.proc): w.proc for w in self.workers}.values():
            kill_group(proc)  # a forked worker dies with its starter (PR_SET_PDEATHSIG)
        if self.etcd is not None:
            kill_group(self.etcd.proc)
        for reader in self.readers:
            reader.join(timeout=10)


# -- the table -------------------------------------------------------------------------------

def spread(values: list[float], digits: int) -> str:
    median = f"{statistics.median(values):.{digits}f}"
    if len(values) == 1:
        return median
    return f"{median} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def cell(outcomes: list[Outcome], digits: int = 2) -> str:
    values = [o.value for o in outcomes if o.value is not None]
    failures = Counter(o.failure for o in outcomes if o.value is None and o.failure)
    parts = [spread(values, digits)] if values else []
    parts += [f"{why} ({count} of {len(outcomes)})" for why, count in failures.items()]
    return "; ".join(parts) or "n/a"


def table(results: dict[tuple[int, str], list[CaseResult]], sizes: list[int],
          backends: list[str]) -> list[str]:
    columns = ["round 1 (s)", "round 2 (s)", "false deaths", "etcd requests round 1",
               "etcd requests/s idle", "round change per agent: requests, KB (KB less idle)",
               "CPU s round 1", "CPU ms per agent: round 1, round change",
               "idle CPU ms per agent per s: agent, etcd"]
    head = ["N", *(f"{SHORT[b]}: {c}" for b in backends for c in columns)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for n in sizes:
        row = [str(n)]
        for b in backends:
            cases = results.get((n, b), [])
            cpu = cell([c.cpu_agents for c in cases], 2)
            if b == "etcd":
                cpu = f"agents {cpu} + etcd {cell([c.cpu_etcd for c in cases], 2)}"
                requests = cell([c.requests for c in cases], 0)
                rate = cell([c.rate for c in cases], 0)
                change = (f"{cell([c.change_requests for c in cases], 1)}, "
                          f"{cell([c.change_kb for c in cases], 1)} "
                          f"({cell([c.change_kb_net for c in cases], 1)})")
                idle = (f"{cell([c.idle_cpu_agent for c in cases], 2)}, "
                        f"{cell([c.idle_cpu_etcd for c in cases], 2)}")
            else:
                requests = rate = change = idle = "n/a"
            per_agent = (f"{cell([c.cpu_per_agent for c in cases], 1)}, "
                         f"{cell([c.cpu_change_per_agent for c in cases], 1)}")
            deaths = [c.false_deaths for c in cases if c.false_deaths is not None]
            row += [cell([c.round1 for c in cases]), cell([c.round2 for c in cases]),
                    " / ".join(map(str, deaths)) if deaths else "n/a",
                    requests, rate, change, cpu, per_agent, idle]
        lines.append("| " + " | ".join(row) + " |")
    return lines


@contextmanager
def keeping_logs(workdir: Path, keep: Path | None) -> Iterator[None]:
    """Copy the logs under ``workdir`` to ``keep`` at the end, if asked."""
    try:
        yield
    finally:
        if keep is not None:
            for log in workdir.rglob("*.log"):
                target = keep / log.relative_to(workdir)
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(log, target)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="8,32,128,256,1024",
                        help="numbers of agents, comma-separated (each at least 2)")
    parser.add_argument("--backends", default="etcd,embedded,stock",
                        help="comma-separated, of: " + ", ".join(BACKENDS))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--cap", type=float, default=120.0,
                        help="seconds each of round 1 and round 2 may take")
    parser.add_argument("--steady", type=float, default=10.0,
                        help="seconds of idle job over which etcd's request rate is taken")
    parser.add_argument("--per-process", type=int, default=64,
                        help="agent threads per worker process at most")
    parser.add_argument("--forked", action="store_true",
                        help="one process per agent, each forked from one that imported torch "
                             "(--per-process is then 1)")
    parser.add_argument("--res-options", action="store_true",
                        help=f'run the workers with RES_OPTIONS="{RES_OPTIONS}"')
    parser.add_argument("--etcd-core", type=int, metavar="CPU",
                        help="etcd pinned to this CPU, the agents to the others (etcd runs on "
                             "machines of its own in a real job; on a small machine a "
                             "thousand agents leave it almost no CPU)")
    parser.add_argument("--etcd-throttle", type=float, metavar="FRACTION",
                        help="etcd runs this fraction of every 30 ms and is stopped for the "
                             "rest (SIGSTOP/SIGCONT: a starved store, e.g. 0.25)")
    parser.add_argument("--kill", type=int, default=1,
                        help="agents SIGKILLed after round 1 (each alone in its process); "
                             "--nnodes is N-KILL:N")
    parser.add_argument("--conf", default="", metavar="KEY=VALUE,...",
                        help="--rdzv-conf for the etcd-ext agents (e.g. heartbeat_interval=1)")
    parser.add_argument("--logs", type=Path, metavar="DIR",
                        help="keep the workers' and etcd's logs here (default: removed)")
    parser.add_argument("--log-level", default="WARNING",
                        help="of the workers' logs (INFO shows every rendezvous step)")
    parser.add_argument("--worker-ranks", action=argparse.BooleanOptionalAction, default=True,
                        help="after each round, assign worker ranks through the round's store "
                             "as torchrun's agent does (the default; tables before 2026-12-02 "
                             "evening measured without)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return _worker(json.loads(args.worker))
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if any(n < args.kill + 1 for n in sizes) or args.reps < 1 or args.per_process < 1 \
            or args.kill < 1:
        parser.error("sizes need more agents than --kill; --reps, --per-process and --kill "
                     "at least 1")
    if unknown := [b for b in backends if b not in BACKENDS]:
        parser.error(f"unknown backend(s) {unknown}; use {', '.join(BACKENDS)}")
    if args.etcd_core is not None and (args.etcd_core not in os.sched_getaffinity(0)
                                       or len(os.sched_getaffinity(0)) < 2):
        parser.error(f"--etcd-core {args.etcd_core}: not one of this process's CPUs "
                     f"{sorted(os.sched_getaffinity(0))}, or no other CPU left for the agents")
    if "etcd" in backends and not Path(ETCD_BIN).exists():
        parser.error("the etcd server binary is not installed (apt-get install etcd-server)")

    if args.res_options:
        resolver = f'RES_OPTIONS="{RES_OPTIONS}" (--res-options)'
    elif "RES_OPTIONS" in os.environ:
        resolver = f'RES_OPTIONS="{os.environ["RES_OPTIONS"]}" (inherited)'
    else:
        resolver = "RES_OPTIONS unset (as is; --res-options sets it)"
    print(f"resolver for the workers: {resolver}", file=sys.stderr, flush=True)
    results: dict[tuple[int, str], list[CaseResult]] = {}
    torch_version = ""
    started = time.monotonic()
    with terminated_by_sigterm(), tempfile.TemporaryDirectory(prefix="scale-bench-") as tmp, \
            keeping_logs(Path(tmp), args.logs):
        for n in sizes:
            print(f"N={n}: {describe_layout(n, args.per_process, args.kill, args.forked)}",
                  file=sys.stderr, flush=True)
            for rep in range(args.reps):
                for backend in backends:
                    case = Case(backend, n, rep, args, Path(tmp) / f"{backend}-{n}-{rep}")
                    results.setdefault((n, backend), []).append(case.run())
                    torch_version = torch_version or case.torch_version

    etcd_version = ""
    if "etcd" in backends:
        out = subprocess.run([ETCD_BIN, "--version"], capture_output=True, text=True).stdout
        etcd_version = out.split("\n", 1)[0].replace("etcd Version:", "etcd").strip()
    print(f"\nRendezvous at scale, {dt.date.today()}, {os.cpu_count()} CPUs, torch "
          f"{torch_version or '?'}" + (f", {etcd_version}" if etcd_version else "")
          + f"; {time.monotonic() - started:.0f}s in all\n")
    print("- agents: processes forked after the imports, one per agent;" if args.forked else
          "- agents: threads in worker processes that imported torch before the start barrier;")
    for n in sizes:
        print(f"  N={n}: {describe_layout(n, args.per_process, args.kill, args.forked)}")
    print(f"- --nnodes=N-{args.kill}:N for every backend; stock c10d with last_call_timeout=1 "
          f"(etcd-ext's default; stock's own is 30); resolver: {resolver}"
          + (f"; etcd-ext --rdzv-conf {args.conf}" if args.conf else
             "; etcd-ext with its defaults (heartbeat_interval 1 s on etcd, 0.5 s embedded; "
             "heartbeat_timeout 3 s)")
          + (f"; etcd pinned to CPU {args.etcd_core}, the agents to the others"
             if args.etcd_core is not None else "")
          + (f"; etcd throttled: it runs {args.etcd_throttle:g} of every 30 ms "
             "(SIGSTOP/SIGCONT)" if args.etcd_throttle is not None else ""))
    print("- round 1: start barrier -> every agent has its rank (handler built + "
          "next_rendezvous()" + (" + torchrun's worker rank assignment on the round's store"
                                 if args.worker_ranks else "")
          + f"); round 2: SIGKILL of {args.kill} agent(s)' process(es) -> "
          f"every survivor has its rank in a round of N-{args.kill}. etcd-ext survivors find "
          "out themselves (polling num_nodes_waiting() every 0.1 s); stock c10d survivors are "
          "told at the kill (this favours stock)")
    print("- etcd requests: messages etcd's gRPC server received (/metrics, all methods), "
          f"from the barrier to round 1 complete, and per second over {args.steady:g} s of "
          f"idle job after round 2 (N-{args.kill} agents); round change per agent: etcd's "
          "requests and the bytes it sent its clients (etcd_network_client_grpc_sent_bytes_total; "
          "the JSON gateway passes on about 4/3 of them) from the kill to round 2 formed, over "
          "the survivors (in brackets: less the bytes an idle agent receives over as long, its "
          "keeper's ticks, measured over the idle seconds); CPU: user+system seconds in the "
          "round-1 window, of all worker processes (the embedded and stock store included) and "
          "of etcd; CPU per agent: the same over N in ms, and from the kill to round 2 formed "
          "over the survivors")
    false = {n: sum(c.false_restarts for c in results.get((n, "etcd"), [])
                    + results.get((n, "embedded"), [])) for n in sizes}
    if any(false.values()):
        print("- etcd-ext agents that saw num_nodes_waiting() > 0 with no node gone (before the "
              "kill or while idle after round 2), all reps: "
              + ", ".join(f"N={n}: {k}" for n, k in false.items()))
    print(f"- median of {args.reps} run(s) (min-max); cap {args.cap:g} s per round; columns: "
          + ", ".join(f"{SHORT[b]} = {BACKENDS[b]}" for b in backends) + "\n")
    for line in table(results, sizes, backends):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
