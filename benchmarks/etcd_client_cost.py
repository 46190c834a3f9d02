"""What one agent's etcd client costs in CPU: our JSON-gateway client against ``aetcd``.

Issue 27 asks whether the hand-written client of etcd's HTTP/JSON gateway (``etcd/transport.py``,
``etcd/client.py``, ``etcd/lease.py``, ``etcd/watch.py``) holds an agent's streams cheaply enough (a
lease kept alive, watches open), or whether a maintained gRPC client should replace it
behind the same ``StoreBackend`` contract. This decides it by measurement: the client-side
CPU time per operation, on a private etcd on loopback (``elastic_ext.local.etcd``, fresh
temporary data dir), of

  keep-alive   gateway: ``EtcdClient.lease_keepalive``, what ``AgentLease`` sends per
               keep-alive (one POST /v3/lease/keepalive: the gateway holds no keep-alive
               stream). aetcd: one LeaseKeepAliveRequest written and its reply read on ONE
               held ``LeaseKeepAlive`` stream (aetcd's own stub and messages: aetcd 1.0 has
               no held keep-alive stream in its API), called from the agent's thread; also
               aetcd's own API, ``Lease.refresh()`` (a new stream per keep-alive), and the
               held stream driven inside the event loop (no thread hop)
  watch event  one PUT of a small key received: gateway ``WatchedKeys`` (``etcd/watch.py``,
               one HTTP stream); aetcd ``Client.watch`` (its one gRPC Watch stream), the
               events handed to the agent's threads as ``WatchedKeys`` does. This script
               writes the key (gateway PUTs, paced ``--interval`` apart so that each
               event comes alone); only the receiving process is measured
  GET, PUT     one key: gateway ``EtcdClient.get`` / ``put``; aetcd ``Client.get`` / ``put``
  idle         CPU ms per second of the client connected and holding nothing
               (``--idle``/2 s), then holding one watch stream open (no events) and one
               lease kept alive at an agent's rate (TTL ``lease_ttl(3)``: 2 s, renewed
               every third of it) for ``--idle`` s. gateway: ``AgentLease`` +
               ``WatchedKeys``; aetcd: a keep-alive task on a held stream +
               ``Client.watch``. All clients' processes idle at the same time
  import       CPU seconds of ``import elastic_ext.rendezvous.stores.etcd.client`` against
               ``import aetcd`` in a fresh interpreter, and after
               ``torch.distributed.elastic.rendezvous`` (which torchrun's agent has
               imported, and which ``etcd/client.py`` imports through ``errors``): every
               agent pays it once

aetcd is asyncio-only; it is used as a synchronous agent (torchrun's) would use it: one
event loop running in a thread of its own, each call handed to it with
``asyncio.run_coroutine_threadsafe(...).result()``.

Each client runs in a process of its own (one per client and repetition, own process
group, killed on exit), which measures its own CPU time (``getrusage(RUSAGE_SELF)``: all
its threads, gRPC's included; never the writer's): CPU time, not wall time, because the
machine may be shared. Wall time per operation and etcd's CPU per operation (from
``/proc``, 10 ms ticks) are printed for information. ``--reps`` repetitions, the clients
alternating; median and range.

Usage: python benchmarks/etcd_client_cost.py [--reps 5] [--ops 500] [--events 300]
       [--interval 0.003] [--idle 10] [--import-reps 3]
Needs the ``etcd`` binary and ``pip install aetcd==1.0.0``. Progress goes to stderr, the
tables (markdown) to stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import datetime as dt
import importlib
import importlib.metadata
import json
import logging
import os
import resource
import select
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, Protocol, TypeVar

from common import cell, cpu_model, private_etcd

from elastic_ext.local.processes import TAG_ENV, Proc, ProcessSet

logger = logging.getLogger("etcd_client_cost")

T = TypeVar("T")
CLIENTS = ("gateway", "aetcd")
_CLK_TCK = os.sysconf("SC_CLK_TCK")
_PR_SET_PDEATHSIG = 1
HEARTBEAT_TIMEOUT_S = 3.0  # etcd-ext's default heartbeat_timeout: the idle lease's TTL
REPLY_TIMEOUT_S = 120.0
IMPORTS = {"gateway": "elastic_ext.rendezvous.stores.etcd.client", "aetcd": "aetcd"}
AGENT_PRELOAD = "torch.distributed.elastic.rendezvous"  # what torchrun's agent has imported
IMPORT_CASES = {"fresh": None, "agent": AGENT_PRELOAD}


# -- CPU clocks ------------------------------------------------------------------------------

def own_cpu() -> float:
    """User+system seconds of this process, all its threads."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def process_cpu(pid: int) -> float:
    """User+system seconds of ``pid`` (``/proc``, in clock ticks)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


class Window:
    """One measured window: this process's CPU, wall time and etcd's CPU."""

    def __init__(self, etcd_pid: int) -> None:
        self._etcd_pid = etcd_pid
        self._etcd0 = process_cpu(etcd_pid)
        self._wall0 = time.perf_counter()
        self._cpu0 = own_cpu()

    def close(self, ops: int, wall_end: float | None = None) -> dict[str, float]:
        cpu = own_cpu() - self._cpu0
        wall = (wall_end if wall_end is not None else time.perf_counter()) - self._wall0
        return {"ops": ops, "cpu": cpu, "wall": wall,
                "etcd": process_cpu(self._etcd_pid) - self._etcd0}


# -- the two clients, as an agent holds them -------------------------------------------------

class EventCounter:
    """Counts the watch events past ``armed`` (called on the client's watch thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.armed: int | None = None
        self.target = 0
        self.count = 0
        self.done = threading.Event()
        self.done_at = 0.0

    def arm(self, revision: int, target: int) -> None:
        with self._lock:
            self.armed, self.target, self.count = revision, target, 0
            self.done.clear()

    def __call__(self, revision: int) -> None:
        with self._lock:
            if self.armed is None or revision <= self.armed:
                return
            self.count += 1
            if self.count == self.target:
                self.done_at = time.perf_counter()
                self.done.set()


class Agent(Protocol):
    """What this benchmark does with a client."""

    def keepalive(self) -> None: ...
    def get(self, key: str) -> bytes | None: ...
    def put(self, key: str, value: bytes) -> None: ...
    def watch_open(self, key: str, on_event: Callable[[int], None]) -> None: ...
    def watch_seen(self, revision: int, timeout: float) -> bool: ...
    def watch_close(self) -> None: ...
    def hold_open(self, key: str) -> None: ...
    def hold_close(self) -> None: ...
    def extra(self, op: str, n: int) -> Callable[[], None]: ...


class GatewayAgent:
    """Our client: ``EtcdClient`` (http.client per thread), ``AgentLease``, ``WatchedKeys``."""

    def __init__(self, endpoint: str) -> None:
        from elastic_ext.rendezvous.settings import parse_settings
        from elastic_ext.rendezvous.stores.etcd.client import EtcdClient

        self.client = EtcdClient(parse_settings(endpoint=endpoint, run_id="bench", min_nodes=1,
                                                max_nodes=1, conf={}))
        self.client.server_version()
        self.lease_id = self.client.lease_grant(60)[0]
        self._feed: Any = None
        self._hold: tuple[Any, Any] | None = None

    def keepalive(self) -> None:
        if self.client.lease_keepalive(self.lease_id) <= 0:
            raise RuntimeError("the lease is gone")

    def get(self, key: str) -> bytes | None:
        kv = self.client.get(key)
        return kv.value if kv else None

    def put(self, key: str, value: bytes) -> None:
        self.client.put(key, value)

    def watch_open(self, key: str, on_event: Callable[[int], None]) -> None:
        from elastic_ext.rendezvous.stores.etcd.watch import WatchedKeys

        feed = WatchedKeys(self.client, key)

        def listener() -> None:  # on the watch's thread, right after the change it tells of
            latest = feed.wait_past(None, 0)
            if latest is not None:
                on_event(latest[0])
        feed.add_listener(listener)
        feed.current(10.0)
        self._feed = feed

    def watch_seen(self, revision: int, timeout: float) -> bool:
        return self._feed.wait_past(revision - 1, timeout) is not None

    def watch_close(self) -> None:
        self._feed.close()

    def hold_open(self, key: str) -> None:
        from elastic_ext.rendezvous.stores.etcd.lease import AgentLease, lease_ttl
        from elastic_ext.rendezvous.stores.etcd.watch import WatchedKeys

        lease = AgentLease(self.client, key + "/hb/",
                           lease_ttl(HEARTBEAT_TIMEOUT_S, is_heartbeat=True),
                           HEARTBEAT_TIMEOUT_S)
        lease.ensure("node", None, put_beat=False)
        feed = WatchedKeys(self.client, key)
        feed.current(10.0)
        self._hold = (lease, feed)

    def hold_close(self) -> None:
        assert self._hold is not None
        lease, feed = self._hold
        feed.close()
        lease_id = lease.end()
        if lease_id is not None:
            self.client.lease_revoke(lease_id)

    def extra(self, op: str, n: int) -> Callable[[], None]:
        raise ValueError(f"gateway has no {op}")


class AetcdAgent:
    """aetcd 1.0 on an event loop in a thread of its own; each call handed to it."""

    def __init__(self, endpoint: str) -> None:
        self.aetcd: Any = importlib.import_module("aetcd")
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="aetcd-loop",
                                        daemon=True)
        self._thread.start()
        host, port = endpoint.rsplit(":", 1)
        self.client: Any = self.run(self._connect(host, int(port)))
        self.lease: Any = self.run(self.client.lease(60))
        self._stream: Any = self.run(self._open_stream())
        self._watch: Any = None
        self._pump: Any = None
        self._changed = threading.Condition()
        self._latest = 0
        self._keys: dict[bytes, bytes] = {}
        self._hold: list[Any] = []

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(REPLY_TIMEOUT_S)

    async def _connect(self, host: str, port: int) -> Any:
        client = self.aetcd.Client(host=host, port=port, timeout=10)
        await client.connect()
        return client

    async def _open_stream(self) -> Any:
        """One ``LeaseKeepAlive`` stream, held (aetcd's stub; ``Lease.refresh`` opens one per
        call)."""
        return self.client.leasestub.LeaseKeepAlive(metadata=self.client.metadata)

    async def _keepalive(self, stream: Any, lease_id: int) -> int:
        await stream.write(self.aetcd.rpc.LeaseKeepAliveRequest(ID=lease_id))
        reply = await stream.read()
        return int(reply.TTL)

    def keepalive(self) -> None:
        if self.run(self._keepalive(self._stream, self.lease.id)) <= 0:
            raise RuntimeError("the lease is gone")

    def refresh(self) -> None:
        if self.run(self.lease.refresh()).TTL <= 0:
            raise RuntimeError("the lease is gone")

    async def _keepalives(self, n: int) -> None:
        for _ in range(n):
            if await self._keepalive(self._stream, self.lease.id) <= 0:
                raise RuntimeError("the lease is gone")

    def extra(self, op: str, n: int) -> Callable[[], None]:
        if op == "refresh":
            def refreshes() -> None:
                for _ in range(n):
                    self.refresh()
            return refreshes
        if op == "keepalive_in_loop":
            return lambda: self.run(self._keepalives(n))
        raise ValueError(f"aetcd has no {op}")

    def get(self, key: str) -> bytes | None:
        got = self.run(self.client.get(key.encode()))
        return None if got is None else bytes(got.value)

    def put(self, key: str, value: bytes) -> None:
        self.run(self.client.put(key.encode(), value))

    def _publish(self, key: bytes, value: bytes, revision: int,
                 on_event: Callable[[int], None] | None) -> None:
        """As ``WatchedKeys._publish``: the change kept and the agent's threads woken."""
        with self._changed:
            self._keys[key] = value
            self._latest = max(self._latest, revision)
            self._changed.notify_all()
        if on_event is not None:
            on_event(revision)

    async def _open_watch(self, key: str, on_event: Callable[[int], None] | None
                          ) -> tuple[Any, asyncio.Task[None]]:
        watch = await self.client.watch(key.encode())

        async def pump() -> None:
            async for event in watch:
                kv = event.kv
                self._publish(kv.key, kv.value, kv.mod_revision, on_event)
        return watch, asyncio.get_running_loop().create_task(pump())

    async def _close_watch(self, watch: Any, pump: asyncio.Task[None]) -> None:
        await watch.cancel()
        pump.cancel()

    def watch_open(self, key: str, on_event: Callable[[int], None]) -> None:
        self._watch, self._pump = self.run(self._open_watch(key, on_event))

    def watch_seen(self, revision: int, timeout: float) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: self._latest >= revision, timeout)

    def watch_close(self) -> None:
        self.run(self._close_watch(self._watch, self._pump))

    async def _hold_open(self, key: str) -> list[Any]:
        from elastic_ext.rendezvous.stores.etcd.lease import lease_ttl

        ttl = lease_ttl(HEARTBEAT_TIMEOUT_S, is_heartbeat=True)
        lease = await self.client.lease(ttl)
        stream = self.client.leasestub.LeaseKeepAlive(metadata=self.client.metadata)

        async def renew() -> None:  # as AgentLease: every third of the TTL
            while True:
                await asyncio.sleep(ttl / 3)
                if await self._keepalive(stream, lease.id) <= 0:
                    raise RuntimeError("the idle lease is gone")
        renewer = asyncio.get_running_loop().create_task(renew())
        watch, pump = await self._open_watch(key, None)
        return [lease, stream, renewer, watch, pump]

    async def _hold_close(self, hold: list[Any]) -> None:
        lease, stream, renewer, watch, pump = hold
        renewer.cancel()
        await self._close_watch(watch, pump)
        stream.cancel()
        await lease.revoke()

    def hold_open(self, key: str) -> None:
        self._hold = self.run(self._hold_open(key))

    def hold_close(self) -> None:
        self.run(self._hold_close(self._hold))


# -- the child process: one client, commands on stdin, replies on stdout ----------------------

def ops_of(agent: Agent, key: str, op: str, n: int) -> Callable[[], None]:
    """``n`` operations ``op`` of ``agent`` on ``key``, back to back."""
    def keepalives() -> None:
        for _ in range(n):
            agent.keepalive()

    def gets() -> None:
        for _ in range(n):
            if agent.get(key) is None:
                raise RuntimeError(f"{key} not found")

    def puts() -> None:
        value = b"x" * 32
        for _ in range(n):
            agent.put(key, value)

    plain = {"keepalive": keepalives, "get": gets, "put": puts}
    return plain[op] if op in plain else agent.extra(op, n)


def child_main(kind: str, endpoint: str, etcd_pid: int) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)  # never outlive the benchmark
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # stray prints go to the log, never into the replies
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)

    def reply(**fields: Any) -> None:
        replies.write(json.dumps(fields) + "\n")

    agent: Agent = GatewayAgent(endpoint) if kind == "gateway" else AetcdAgent(endpoint)
    key = f"/bench/{kind}/{os.getpid()}"
    for _ in range(20):  # warm: connections open, first-call paths taken
        agent.keepalive()
        agent.put(key, b"warm")
        agent.get(key)
    counter = EventCounter()
    window: Window | None = None
    reply(ready=True, pid=os.getpid())
    for line in sys.stdin:
        cmd = json.loads(line)
        op, n = cmd["op"], int(cmd.get("n", 0))
        if op == "quit":
            break
        if op in ("keepalive", "get", "put", "refresh", "keepalive_in_loop"):
            body = ops_of(agent, key, op, n)
            window = Window(etcd_pid)
            body()
            reply(**window.close(n))
        elif op == "watch_open":
            agent.watch_open(cmd["key"], counter)
            reply(ok=True)
        elif op == "watch_arm":  # the writer's first put seen: every stream is up
            if not agent.watch_seen(int(cmd["rev"]), 30.0):
                raise RuntimeError("the warm-up event did not arrive")
            counter.arm(int(cmd["rev"]), n)
            window = Window(etcd_pid)
            reply(ok=True)
        elif op == "watch_result":
            if not counter.done.wait(60.0):
                raise RuntimeError(f"{counter.count} of {counter.target} events arrived")
            assert window is not None
            result = window.close(counter.target, counter.done_at)
            agent.watch_close()
            reply(**result)
        elif op == "idle":
            seconds = float(cmd["seconds"])
            window = Window(etcd_pid)  # first the client alone, connected: no stream, no lease
            time.sleep(seconds / 2)
            bare = window.close(0)
            agent.hold_open(f"/bench/idle/{kind}/{os.getpid()}")
            time.sleep(1.0)  # settled: the first keep-alives sent
            window = Window(etcd_pid)
            time.sleep(seconds)
            hold = window.close(0)
            agent.hold_close()
            reply(bare=bare, hold=hold)
        else:
            raise ValueError(f"unknown command {op!r}")
    return 0


# -- the parent: etcd, the children, the writer, the tables ---------------------------------

class Child:
    """One spawned client process (own session, tagged for ``ProcessSet.cleanup``)."""

    def __init__(self, procs: ProcessSet, name: str, cmd: list[str]) -> None:
        tag = uuid.uuid4().hex
        env = {**os.environ, TAG_ENV: tag, "PYTHONUNBUFFERED": "1"}
        log = procs.log_dir / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as err:
            popen = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=err,
                                     start_new_session=True)
        self.proc = Proc(name, popen, tag, log)
        procs.procs.append(self.proc)
        self._buffer = b""

    def send(self, **cmd: Any) -> None:
        stdin = self.proc.popen.stdin
        assert stdin is not None
        stdin.write((json.dumps(cmd) + "\n").encode())
        stdin.flush()

    def receive(self, timeout: float = REPLY_TIMEOUT_S) -> dict[str, Any]:
        stdout = self.proc.popen.stdout
        assert stdout is not None
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self.proc.name}: no reply within {timeout:g}s:\n"
                                   f"{self.proc.output()[-3000:]}")
            ready, _, _ = select.select([stdout.fileno()], [], [], left)
            if ready:
                chunk = os.read(stdout.fileno(), 65536)
                if not chunk:
                    raise RuntimeError(f"{self.proc.name} exited:\n"
                                       f"{self.proc.output()[-3000:]}")
                self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return dict(json.loads(line))

    def ask(self, **cmd: Any) -> dict[str, Any]:
        self.send(**cmd)
        return self.receive()


IMPORT_PROBE = """\
import importlib, json, resource, sys, time
def cpu():
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime
for name in sys.argv[2:]:  # what the agent has imported already: not measured
    importlib.import_module(name)
c0, w0 = cpu(), time.perf_counter()
importlib.import_module(sys.argv[1])
print(json.dumps({"cpu": cpu() - c0, "wall": time.perf_counter() - w0}))
"""


def measure_import(procs: ProcessSet, kind: str, rep: int, preload: str | None
                   ) -> dict[str, float]:
    """CPU and wall seconds of importing ``kind``'s client module in a fresh interpreter,
    after ``preload`` (not measured) if given."""
    child = Child(procs, f"import-{kind}-{rep}-{preload}",
                  [sys.executable, "-c", IMPORT_PROBE, IMPORTS[kind],
                   *([preload] if preload else [])])
    got = child.receive(60.0)
    child.proc.popen.wait(timeout=30)
    return {"cpu": float(got["cpu"]), "wall": float(got["wall"])}


Results = dict[str, dict[str, list[dict[str, float]]]]  # op -> client -> windows
Imports = dict[str, dict[str, list[dict[str, float]]]]  # case -> client -> probes


def run_ops(child: Child, kind: str, args: argparse.Namespace, writer: Any,
            results: Results) -> None:
    def keep(op: str, got: dict[str, Any]) -> None:
        results.setdefault(op, {}).setdefault(kind, []).append(
            {k: float(got[k]) for k in ("ops", "cpu", "wall", "etcd")})

    keep("keepalive", child.ask(op="keepalive", n=args.ops))
    if kind == "aetcd":
        keep("keepalive_in_loop", child.ask(op="keepalive_in_loop", n=args.ops))
        keep("refresh", child.ask(op="refresh", n=max(1, args.ops // 2)))
    keep("get", child.ask(op="get", n=args.ops))
    keep("put", child.ask(op="put", n=args.ops))
    key = f"/bench/watched/{kind}/{child.proc.pid}"
    child.ask(op="watch_open", key=key)
    rev = writer.put(key, b"warm")
    child.ask(op="watch_arm", rev=rev, n=args.events)
    next_at = time.monotonic()
    for i in range(args.events):
        next_at += args.interval
        time.sleep(max(0.0, next_at - time.monotonic()))
        writer.put(key, b"v%05d" % i)
    keep("watch", child.ask(op="watch_result"))


def ratio(gateway: list[float], other: list[float]) -> str:
    if not gateway or not other or statistics.median(other) <= 0:
        return "n/a"
    return f"{statistics.median(gateway) / statistics.median(other):.1f}×"


ROWS = [  # (label, gateway op, aetcd op)
    ("lease keep-alive (aetcd: held LeaseKeepAlive stream, called from the agent's thread)",
     "keepalive", "keepalive"),
    ("lease keep-alive (aetcd: `Lease.refresh()`, its API: a new stream each)",
     "keepalive", "refresh"),
    ("lease keep-alive (aetcd: held stream, driven inside the event loop)",
     "keepalive", "keepalive_in_loop"),
    ("watch event received (small key, one per response)", "watch", "watch"),
    ("GET one key", "get", "get"),
    ("PUT one key (32 B)", "put", "put"),
]


IDLE_ROWS = [
    ("bare", "idle: the client connected, nothing held (half the idle time)"),
    ("hold", "idle: one watch open + one lease kept alive (TTL 2 s, every 0.67 s)"),
]
IMPORT_ROWS = [
    ("fresh", f"import `{IMPORTS['gateway']}` vs `aetcd`, fresh interpreter"),
    ("agent", f"import, after `{AGENT_PRELOAD}` (as in torchrun's agent)"),
]


def per_op(results: Results, op: str, kind: str, field: str) -> list[float]:
    return [1e6 * w[field] / w["ops"] for w in results.get(op, {}).get(kind, [])]


def print_tables(args: argparse.Namespace, results: Results,
                 idle: dict[str, dict[str, list[float]]], imports: Imports,
                 etcd_version: str) -> None:
    aetcd_version = importlib.metadata.version("aetcd")
    import grpc

    print(f"\n{dt.date.today()}, {os.cpu_count()} cores ({cpu_model()}), Python "
          f"{sys.version.split()[0]}, etcd {etcd_version} on loopback, aetcd {aetcd_version} "
          f"(grpcio {grpc.__version__}, protobuf {importlib.metadata.version('protobuf')}); "
          f"{args.reps} reps of {args.ops} ops ({args.ops // 2} for refresh, {args.events} "
          f"watch events {args.interval * 1e3:g} ms apart), idle {args.idle:g} s; "
          "client process CPU (user+system, all threads), median (range)\n")
    print("| operation | gateway CPU µs/op | aetcd CPU µs/op | ratio gateway/aetcd |")
    print("|---|---|---|---|")
    for label, gop, aop in ROWS:
        g, a = per_op(results, gop, "gateway", "cpu"), per_op(results, aop, "aetcd", "cpu")
        print(f"| {label} | {cell(g, 1)} | {cell(a, 1)} | {ratio(g, a)} |")
    for case, label in IDLE_ROWS:
        g, a = idle.get(case, {}).get("gateway", []), idle.get(case, {}).get("aetcd", [])
        print(f"| {label}, CPU **ms per s** | {cell(g, 3)} | {cell(a, 3)} | {ratio(g, a)} |")
    for case, label in IMPORT_ROWS:
        gi = [r["cpu"] for r in imports.get(case, {}).get("gateway", [])]
        ai = [r["cpu"] for r in imports.get(case, {}).get("aetcd", [])]
        print(f"| {label}, CPU **s** | {cell(gi, 3)} | {cell(ai, 3)} | {ratio(gi, ai)} |")

    print("\nFor information: wall µs/op (a shared machine: noisy) and etcd's CPU µs/op "
          "(10 ms ticks; the watch row includes the writer's gateway PUT, the same for both)\n")
    print("| operation | gateway wall | aetcd wall | gateway etcd CPU | aetcd etcd CPU |")
    print("|---|---|---|---|---|")
    for label, gop, aop in ROWS:
        print(f"| {label} | {cell(per_op(results, gop, 'gateway', 'wall'), 0)} "
              f"| {cell(per_op(results, aop, 'aetcd', 'wall'), 0)} "
              f"| {cell(per_op(results, gop, 'gateway', 'etcd'), 0)} "
              f"| {cell(per_op(results, aop, 'aetcd', 'etcd'), 0)} |")
    for case, label in IMPORT_ROWS:
        gw = [1e3 * r["wall"] for r in imports.get(case, {}).get("gateway", [])]
        aw = [1e3 * r["wall"] for r in imports.get(case, {}).get("aetcd", [])]
        print(f"| {label}, wall **ms** | {cell(gw, 0)} | {cell(aw, 0)} | | |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--ops", type=int, default=500, help="keep-alives, GETs, PUTs per rep")
    parser.add_argument("--events", type=int, default=300, help="watch events per rep")
    parser.add_argument("--interval", type=float, default=0.003,
                        help="seconds between the writer's PUTs")
    parser.add_argument("--idle", type=float, default=10.0, help="seconds held idle")
    parser.add_argument("--import-reps", type=int, default=3)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--endpoint", help=argparse.SUPPRESS)
    parser.add_argument("--etcd-pid", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child_main(args.child, args.endpoint, args.etcd_pid)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(message)s")
    try:
        importlib.import_module("aetcd")
    except ImportError:
        logger.error("aetcd is not installed: pip install aetcd==1.0.0")
        return 2

    results: Results = {}
    idle: dict[str, dict[str, list[float]]] = {}
    imports: Imports = {}
    began = time.monotonic()
    with private_etcd("etcd-client-cost-") as (procs, member, writer):
        assert member.proc is not None
        etcd_pid = member.proc.pid
        etcd_version = writer.server_version()
        logger.info("etcd %s at %s (pid %d)", etcd_version, member.endpoint, etcd_pid)
        for rep in range(args.import_reps):
            for case, preload in IMPORT_CASES.items():
                for kind in CLIENTS if rep % 2 == 0 else CLIENTS[::-1]:
                    imports.setdefault(case, {}).setdefault(kind, []).append(
                        measure_import(procs, kind, rep, preload))
        logger.info("imports, CPU s: %s", {c: {k: [round(r["cpu"], 3) for r in v]
                                               for k, v in got.items()}
                                           for c, got in imports.items()})
        children: list[tuple[str, Child]] = []
        for rep in range(args.reps):
            for kind in CLIENTS if rep % 2 == 0 else CLIENTS[::-1]:
                child = Child(procs, f"{kind}-{rep}",
                              [sys.executable, str(Path(__file__).resolve()),
                               "--child", kind, "--endpoint", member.endpoint,
                               "--etcd-pid", str(etcd_pid)])
                child.receive(60.0)
                run_ops(child, kind, args, writer, results)
                children.append((kind, child))
                logger.info("rep %d %s: %s", rep + 1, kind, {
                    op: round(per_op(results, op, kind, "cpu")[-1], 1)
                    for op in results if kind in results[op]})
        logger.info("idle: %d clients together, %g s", len(children), args.idle)
        for _, child in children:
            child.send(op="idle", seconds=args.idle)
        for kind, child in children:
            got = child.receive(1.5 * args.idle + 60.0)
            for case in ("bare", "hold"):
                idle.setdefault(case, {}).setdefault(kind, []).append(
                    1e3 * float(got[case]["cpu"]) / float(got[case]["wall"]))
        for _, child in children:
            child.send(op="quit")
        for _, child in children:
            child.proc.popen.wait(timeout=30)
    logger.info("done in %.0f s", time.monotonic() - began)
    print_tables(args, results, idle, imports, etcd_version)
    return 0


if __name__ == "__main__":
    sys.exit(main())
