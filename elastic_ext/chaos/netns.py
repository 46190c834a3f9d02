"""Network namespaces for a partition: each node gets an address of its own that can be cut.

Layout (one lab per chaos run, ``LAB`` = ``eec<X>``)::

    root namespace:  blackhole route 10.201.X.0/24   (added first, removed last)
    LAB-sw:          bridge br0 = 10.201.X.1 (etcd listens here)
    LAB-n<i>:        eth0 = 10.201.X.(10+i), a veth whose other end is in br0

Safety: the test range is routed to a blackhole in the root namespace *before* any
namespace exists, so a stray packet for it can never take the default route out of
the machine; the addresses exist only inside namespaces this module creates; the
namespaces have no default route; and the harness itself reaches etcd only from a
thread that has joined the switch namespace (:func:`call_in`), never from the root
namespace. A partition takes a node's ``eth0`` down (this kernel has no ``tc netem``;
a link down needs nothing but iproute2); cutting a node off its peers only adds
blackhole routes for the other nodes' addresses inside its namespace, so its packets
to them, its answers included, are dropped while the store stays reachable; a silent
drop routes the whole range to a blackhole there, the store included.

Every command needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN); :func:`unavailable` says
why when this machine cannot do it, so the caller can skip with that reason.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import logging
import os
import shutil
import signal
import subprocess
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from elastic_ext.chaos.invariants import listening_ports
from elastic_ext.local.job import Host
from elastic_ext.procinfo import pid_alive

logger = logging.getLogger(__name__)

T = TypeVar("T")

NETWORK = "10.201"  # 10.201.X.0/24, one X per lab; the SLURM lab in shared/notes uses 10.200
PREFIX = "eec"
STATE_DIR = Path("/run/elastic-ext-chaos")
_CLONE_NEWNET = 0x40000000
# .8 to .255 of a lab's /24: every node address, never the switch's .1 (the store)
_PEER_BLOCKS = ("8/29", "16/28", "32/27", "64/26", "128/25")
# the whole /24, store included, as two halves more specific than the link's own route
_ALL_BLOCKS = ("0/25", "128/25")


class NetnsError(RuntimeError):
    """A namespace command failed."""


@dataclass(frozen=True)
class LabPlan:
    """Names and addresses of one lab; pure, so the layout can be tested without root."""

    index: int  # X in 10.201.X.0/24, 1..254

    def __post_init__(self) -> None:
        if not 1 <= self.index <= 254:
            raise ValueError(f"lab index {self.index} is outside 1..254")

    @property
    def name(self) -> str:
        return f"{PREFIX}{self.index}"

    @property
    def subnet(self) -> str:
        return f"{NETWORK}.{self.index}.0/24"

    @property
    def switch(self) -> str:
        return f"{self.name}-sw"

    @property
    def store_address(self) -> str:
        return f"{NETWORK}.{self.index}.1"

    def node_ns(self, node: int) -> str:
        return f"{self.name}-n{node}"

    def node_address(self, node: int) -> str:
        if not 0 <= node <= 200:
            raise ValueError(f"node index {node} is outside 0..200")
        return f"{NETWORK}.{self.index}.{10 + node}"

    def namespaces(self, nodes: int) -> list[str]:
        return [self.switch, *(self.node_ns(i) for i in range(nodes))]


def exec_prefix(namespace: str) -> tuple[str, ...]:
    """The command prefix that runs a program inside ``namespace`` (it keeps the pid: ip execs)."""
    return ("ip", "netns", "exec", namespace)


def unavailable() -> str | None:
    """Why this machine cannot build a lab (None when it can): a reason to skip with."""
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN and CAP_SYS_ADMIN)"
    if shutil.which("ip") is None:
        return "the 'ip' command (iproute2) is not installed"
    probe = f"{PREFIX}probe{os.getpid()}"
    try:
        _ip("netns", "add", probe)
    except NetnsError as exc:
        return f"cannot create a network namespace here: {exc}"
    finally:
        with contextlib.suppress(NetnsError):
            _ip("netns", "del", probe)
    return None


def _ip(*args: str) -> str:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=False)
    if result.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)}: {result.stderr.strip() or result.returncode}")
    return result.stdout


def call_in(namespace: str, fn: Callable[[], T]) -> T:
    """Run ``fn`` in a thread that has joined ``namespace``; this process stays where it was.

    A network namespace belongs to a thread, so the sockets ``fn`` opens live in
    ``namespace`` while every other thread keeps the root namespace.
    """
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = os.open(f"/run/netns/{namespace}", os.O_RDONLY)
            try:
                if libc.setns(fd, _CLONE_NEWNET) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"setns into {namespace}: {os.strerror(err)}")
            finally:
                os.close(fd)
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=target, name=f"netns-{namespace}", daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def read_tcp_tables() -> str:
    """The TCP tables of the calling thread's network namespace, for ``listening_ports``."""
    texts = []
    for name in ("tcp", "tcp6"):
        with contextlib.suppress(OSError):
            texts.append(Path(f"/proc/thread-self/net/{name}").read_text())
    return "\n".join(texts)


def _owner_alive(path: Path) -> bool:
    try:
        pid = int(path.read_text().strip())
    except (OSError, ValueError):
        return False
    return pid_alive(pid)


@contextlib.contextmanager
def _allocation_lock() -> Iterator[None]:
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    with open(STATE_DIR / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


class NetnsLab:
    """One lab: creates the namespaces, cuts and heals links, and removes every trace."""

    def __init__(self, plan: LabPlan) -> None:
        self.plan = plan
        self.nodes: list[int] = []
        self._up = False

    # -- allocation ------------------------------------------------------------------------
    @classmethod
    def allocate(cls) -> NetnsLab:
        """A lab on a free /24; labs left by a dead harness are removed first."""
        with _allocation_lock():
            for owner in STATE_DIR.glob(f"{PREFIX}*.owner"):
                if not _owner_alive(owner):
                    index = int(owner.stem[len(PREFIX):])
                    logger.warning("removing lab %s left by a harness that is gone", owner.stem)
                    cls(LabPlan(index)).down()
            routed = {line.split()[1] if line.split()[0] in ("blackhole", "unreachable", "prohibit")
                      else line.split()[0]
                      for line in _ip("route", "show", "table", "all").splitlines()
                      if line.split()}
            taken = ({int(p.name[len(PREFIX):].split("-")[0])
                      for p in Path("/run/netns").glob(f"{PREFIX}*-sw")
                      if p.name[len(PREFIX):].split("-")[0].isdigit()}
                     if Path("/run/netns").exists() else set())
            for index in range(1 + os.getpid() % 254, 255):
                plan = LabPlan(index)
                if index in taken or plan.subnet in routed:
                    continue
                (STATE_DIR / f"{plan.name}.owner").write_text(str(os.getpid()))
                lab = cls(plan)
                try:
                    lab.up()
                except BaseException:
                    lab.down()
                    raise
                return lab
        raise NetnsError(f"no free /24 in {NETWORK}.0.0/16")

    # -- building ----------------------------------------------------------------------------
    def up(self) -> None:
        plan = self.plan
        # First of all: nothing for the test range may ever take the default route out.
        _ip("route", "replace", "blackhole", plan.subnet)
        self._up = True
        _ip("netns", "add", plan.switch)
        _ip("-n", plan.switch, "link", "set", "lo", "up")
        _ip("-n", plan.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", plan.switch, "addr", "add", f"{plan.store_address}/24", "dev", "br0")
        _ip("-n", plan.switch, "link", "set", "br0", "up")
        logger.info("lab %s: %s behind a blackhole route, switch %s", plan.name, plan.subnet,
                    plan.switch)

    @property
    def store_host(self) -> Host:
        return Host(self.plan.store_address, exec_prefix(self.plan.switch))

    def node_host(self, node: int) -> Host:
        """Create node ``node``'s namespace and link (idempotent) and say where it runs."""
        plan = self.plan
        ns = plan.node_ns(node)
        if node not in self.nodes:
            _ip("netns", "add", ns)
            self.nodes.append(node)
            _ip("-n", plan.switch, "link", "add", f"v{node}", "type", "veth", "peer", "name",
                "eth0", "netns", ns)
            _ip("-n", plan.switch, "link", "set", f"v{node}", "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{plan.node_address(node)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        # gloo binds to the address of the hostname (loopback here) unless told the interface
        return Host(plan.node_address(node), exec_prefix(ns), env=(("GLOO_SOCKET_IFNAME", "eth0"),))

    # -- faults ------------------------------------------------------------------------------
    def cut(self, node: int) -> None:
        _ip("-n", self.plan.node_ns(node), "link", "set", "eth0", "down")

    def heal(self, node: int) -> None:
        _ip("-n", self.plan.node_ns(node), "link", "set", "eth0", "up")

    def cut_peers(self, node: int) -> None:
        """Drop what ``node`` sends to the other nodes, and so its answers to them; the
        store (``.1``) stays reachable. Node addresses start at ``.10``."""
        self._blackhole(node, _PEER_BLOCKS)

    def heal_peers(self, node: int) -> None:
        self._unblackhole(node, _PEER_BLOCKS)

    def drop(self, node: int) -> None:
        """Drop everything ``node`` sends, the store included, without a word: its link stays
        up and its kernel takes connections in, but no answer comes back (a machine that
        vanished, a switch port dead). Others' connects to it time out, never refused."""
        self._blackhole(node, _ALL_BLOCKS)

    def undrop(self, node: int) -> None:
        self._unblackhole(node, _ALL_BLOCKS)

    def _blackhole(self, node: int, blocks: tuple[str, ...]) -> None:
        for block in blocks:
            _ip("-n", self.plan.node_ns(node), "route", "add", "blackhole",
                f"{NETWORK}.{self.plan.index}.{block}")

    def _unblackhole(self, node: int, blocks: tuple[str, ...]) -> None:
        for block in blocks:
            with contextlib.suppress(NetnsError):
                _ip("-n", self.plan.node_ns(node), "route", "del", "blackhole",
                    f"{NETWORK}.{self.plan.index}.{block}")

    def call_in_store(self, fn: Callable[[], T]) -> T:
        return call_in(self.plan.switch, fn)

    def listening(self) -> dict[str, set[int]]:
        """Ports in LISTEN state inside each of the lab's namespaces (all ours)."""
        found = {}
        for ns in [self.plan.switch, *(self.plan.node_ns(i) for i in self.nodes)]:
            ports = call_in(ns, lambda: listening_ports(read_tcp_tables()))
            if ports:
                found[ns] = ports
        return found

    def pids(self) -> list[int]:
        pids = []
        for ns in [self.plan.switch, *(self.plan.node_ns(i) for i in self.nodes)]:
            with contextlib.suppress(NetnsError):
                pids += [int(p) for p in _ip("netns", "pids", ns).split()]
        return pids

    # -- teardown ----------------------------------------------------------------------------
    def down(self) -> None:
        """Kill what still runs in the lab's namespaces, delete them, then drop the route."""
        plan = self.plan
        present = [p.name for p in Path("/run/netns").glob(f"{plan.name}-*")] \
            if Path("/run/netns").exists() else []
        for ns in present:
            with contextlib.suppress(NetnsError):
                for pid in _ip("netns", "pids", ns).split():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(pid), signal.SIGKILL)
        for ns in present:
            try:
                _ip("netns", "del", ns)
            except NetnsError as exc:
                logger.warning("lab %s: %s", plan.name, exc)
        # the route goes last: while any namespace could exist, the range stays blackholed
        with contextlib.suppress(NetnsError):
            _ip("route", "del", "blackhole", plan.subnet)
        with contextlib.suppress(OSError):
            (STATE_DIR / f"{plan.name}.owner").unlink()
        self._up = False
