"""The doctor's checks that need no peer: each returns :class:`Finding` lines.

Pure where it can be (inputs injected: the interfaces, the environment, a GPU counter),
so the rules are tested without a network, GPUs or a full disk.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import logging
import os
import shutil
import socket
import struct
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from elastic_ext.rendezvous.protocol.liveness import LEFT
from elastic_ext.rendezvous.protocol.state import RunState, Status
from elastic_ext.rendezvous.settings import Settings
from elastic_ext.rendezvous.stores.contract import StoreBackend

logger = logging.getLogger(__name__)

OK, FAIL, SKIP = "ok", "FAIL", "skip"
IFNAME_VARS = ("ELASTIC_EXT_IFNAME", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")
MIN_FREE_BYTES = 1 << 30
"""Less free space than this in the snapshot directory is a failure: a snapshot of a large
model would not fit, and a full disk fails the save the job relies on to lose no step."""


@dataclass(frozen=True)
class Finding:
    """One line of the doctor's output: a check, its verdict, and for a failure the fix."""

    check: str
    verdict: str  # OK, FAIL or SKIP (could not be checked here; says why)
    detail: str

    @property
    def failed(self) -> bool:
        return self.verdict == FAIL

    def line(self) -> str:
        return f"{self.verdict:<4}  {self.check}: {self.detail}"


# -- the address the workers' network uses -----------------------------------------------
@dataclass(frozen=True)
class Address:
    """Where this node is reached: the address, its interface (None when not known), and
    how it was chosen (the variable or flag), for the message that names the fix."""

    addr: str
    ifname: str | None
    how: str

    def describe(self) -> str:
        return f"{self.addr} on {self.ifname or 'an unknown interface'} ({self.how})"


def local_interfaces() -> dict[str, str]:
    """Interface name -> its IPv4 address, for the interfaces that have one (Linux ioctl:
    no dependency, and no process of ``ip`` per node)."""
    found: dict[str, str] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            packed = struct.pack("256s", name.encode()[:15])
            try:
                reply = fcntl.ioctl(sock.fileno(), 0x8915, packed)  # SIOCGIFADDR
            except OSError:
                continue  # no IPv4 address
            found[name] = socket.inet_ntoa(reply[20:24])
    return found


def _matches(spec: str, name: str) -> bool:
    """NCCL's rule: an entry is a prefix of the interface's name, or with ``=`` the name."""
    return name == spec[1:] if spec.startswith("=") else name.startswith(spec)


def interface_of(addr: str, interfaces: Mapping[str, str]) -> str | None:
    return next((name for name, a in interfaces.items() if a == addr), None)


def pick_address(env: Mapping[str, str], local_addr: str | None,
                 interfaces: Mapping[str, str],
                 resolve: Callable[[], str]) -> tuple[Address | None, Finding | None]:
    """The address this node's agent and workers will be reached at, as they pick it:
    ``ELASTIC_EXT_LOCAL_ADDR`` or torchrun's ``--local-addr``; else the interface named by
    ``ELASTIC_EXT_IFNAME``, ``NCCL_SOCKET_IFNAME`` or ``GLOO_SOCKET_IFNAME`` (NCCL's list
    syntax: prefixes, ``=exact``, ``^excluded``); else what the hostname resolves to (the
    agent's ``socket.getfqdn()``). A failure is returned as a finding naming the fix."""
    for how, value in (("ELASTIC_EXT_LOCAL_ADDR", env.get("ELASTIC_EXT_LOCAL_ADDR")),
                       ("--local-addr", local_addr)):
        if value:
            return Address(value, interface_of(value, interfaces), how), None
    known = ", ".join(f"{n} {a}" for n, a in sorted(interfaces.items())) or "none"
    for var in IFNAME_VARS:
        spec = env.get(var, "").strip()
        if not spec:
            continue
        entries = [e.strip() for e in spec.lstrip("^").split(",") if e.strip()]
        if spec.startswith("^"):
            names = [n for n in sorted(interfaces)
                     if n != "lo" and not any(_matches(e, n) for e in entries)]
        else:
            names = [n for e in entries for n in sorted(interfaces) if _matches(e, n)]
        if not names:
            return None, Finding("network", FAIL, f"{var}={spec} names no interface with an IPv4 "
                                 f"address on this node (its interfaces: {known}); set {var} "
                                 "to the training network's interface")
        return Address(interfaces[names[0]], names[0], f"{var}={spec}"), None
    try:
        addr = resolve()
    except OSError as exc:
        return None, Finding("network", FAIL, f"this node's hostname does not resolve ({exc}); "
                             "set ELASTIC_EXT_IFNAME to the training network's interface")
    return Address(addr, interface_of(addr, interfaces), "the hostname's address"), None


def resolve_hostname() -> str:
    """What the agent's ``socket.getfqdn()`` resolves to (IPv4 first, as torch dials)."""
    name = socket.getfqdn()
    infos = socket.getaddrinfo(name, None, socket.AF_INET, socket.SOCK_STREAM)
    return str(infos[0][4][0])


def is_loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False


# -- GPUs --------------------------------------------------------------------------------
def count_gpus(env: Mapping[str, str]) -> tuple[int | None, str]:
    """(visible GPUs, how they were counted); None when this node shows no sign of GPUs.
    ``CUDA_VISIBLE_DEVICES`` first, then ``nvidia-smi -L``, then torch's count: a separate
    short process of ours, so CUDA initialised here can break no later fork."""
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        entries = [e for e in visible.split(",") if e.strip()]
        if entries and entries[0].strip() in {"-1", "NoDevFiles"}:
            entries = []
        return len(entries), f"CUDA_VISIBLE_DEVICES={visible}"
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True,
                                 timeout=10, check=False).stdout
            return sum(line.startswith("GPU ") for line in out.splitlines()), "nvidia-smi -L"
        except (OSError, subprocess.SubprocessError) as exc:
            logger.info("nvidia-smi -L failed: %s", exc)
    try:
        import torch
    except ImportError:
        return None, "no GPU tools"
    count = int(torch.cuda.device_count())
    return (count or None), "torch.cuda.device_count()"


def check_gpus(nproc_per_node: str | None, gpus: tuple[int | None, str]) -> Finding:
    count, how = gpus
    if nproc_per_node is None or not nproc_per_node.isdigit():
        return Finding("gpus", OK, f"--nproc-per-node={nproc_per_node or '1'}: torchrun counts "
                       f"the workers itself ({count if count is not None else 'no'} GPUs, {how})")
    if count is None:
        return Finding("gpus", SKIP, f"no GPUs here ({how}): {nproc_per_node} CPU workers")
    wanted = int(nproc_per_node)
    if wanted > count:
        return Finding("gpus", FAIL, f"--nproc-per-node={wanted} but this node sees {count} "
                       f"GPUs ({how}): pass --nproc-per-node={count} or fix "
                       "CUDA_VISIBLE_DEVICES / the job's GPU request (--gpus-per-node)")
    return Finding("gpus", OK, f"{wanted} workers on {count} GPUs ({how})")


# -- the snapshot directory --------------------------------------------------------------
def check_snapshot_dir(path: Path, min_free: int = MIN_FREE_BYTES) -> Finding:
    """Writable (a file written, synced and removed: a read-only mount fails here, not at
    the first save) with ``min_free`` bytes free. A directory that does not exist yet is
    checked at its nearest existing parent, where the trainer will create it."""
    where = path
    while not where.exists() and where != where.parent:
        where = where.parent
    if not where.is_dir():
        return Finding("snapshot dir", FAIL, f"{path}: {where} is not a directory; give "
                       "--snapshot-dir a directory path")
    probe = where / f".elastic-ext-doctor-{socket.gethostname()}-{os.getpid()}"
    try:
        with open(probe, "wb") as handle:
            handle.write(b"\0" * 4096)
            handle.flush()
            os.fsync(handle.fileno())
    except OSError as exc:
        return Finding("snapshot dir", FAIL, f"{path}: cannot write in {where} ({exc.strerror}); "
                       "give the job a directory it can write (--snapshot-dir), or fix its "
                       "permissions or mount")
    finally:
        with contextlib.suppress(OSError):
            probe.unlink()
    stat = os.statvfs(where)
    free = stat.f_bavail * stat.f_frsize
    if free < min_free:
        return Finding("snapshot dir", FAIL, f"{path}: only {free / 2**20:.0f} MiB free (less "
                       f"than {min_free / 2**20:.0f} MiB); free space there or point "
                       "--snapshot-dir at a larger filesystem")
    return Finding("snapshot dir", OK, f"{path}: writable, {free / 2**30:.1f} GiB free")


# -- the rendezvous id -------------------------------------------------------------------
def check_run_id(backend: StoreBackend, settings: Settings,
                 clock: Callable[[], float] = time.monotonic,
                 pause: Callable[[float], object] = time.sleep) -> Finding:
    """Whether ``--rdzv-id`` is free: no state, a finished run, or one whose agents are all
    gone (a requeued job: a new generation starts) are fine; a run with a live heartbeat is
    another job's, and a run closed by an operator ends every new agent at once.

    A heartbeat key that is there is not yet a live agent (a job killed a moment ago):
    written heartbeats must move, and leased ones must outlive their lease, within
    ``heartbeat_timeout``, as the rendezvous itself judges them."""
    current = backend.get_state()
    if current is None:
        return Finding("run id", OK, f"{settings.run_id}: no run under {settings.run_prefix}")
    state = RunState.from_bytes(current[0])
    if state.status is Status.CLOSED:
        return Finding("run id", FAIL, f"{settings.run_id}: the run under {settings.run_prefix} "
                       "was closed for good by an operator, so every new agent would exit at "
                       f"once; use another --rdzv-id, or delete the keys under "
                       f"{settings.run_prefix}")
    if state.status is Status.FINISHED:
        return Finding("run id", OK, f"{settings.run_id}: a finished run (a new job starts over)")
    nodes = sorted(state.known_nodes())
    first = backend.read_beats(nodes)
    present = {n: v for n, v in first.items() if v is not None and v != LEFT}
    live: set[str] = set()
    deadline = clock() + settings.timeouts.heartbeat + settings.timeouts.heartbeat_interval
    while present and not live:
        if clock() >= deadline:
            if backend.heartbeats_expire:  # still there after a lease's life: renewed
                live = set(present)
            break
        pause(min(settings.timeouts.heartbeat_interval / 2, max(0.0, deadline - clock())))
        now = backend.read_beats(sorted(present))
        if backend.heartbeats_expire:
            present = {n: v for n, v in now.items() if v is not None and v != LEFT}
        else:
            live = {n for n, v in now.items() if v is not None and v != present[n]}
    if live:
        return Finding("run id", FAIL, f"{settings.run_id} is in use by a live job: "
                       f"{len(live)} agent(s) with live heartbeats ({', '.join(sorted(live))}); "
                       "use another --rdzv-id, or stop that job first")
    return Finding("run id", OK, f"{settings.run_id}: a previous job's run, its agents gone "
                   f"(round {state.round}): the job starts a new generation")


# -- launch mistakes torchrun with etcd-ext cannot make -----------------------------------
IGNORED_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK",
               "GROUP_RANK")


def check_launch(env: Mapping[str, str], flags: Iterable[str]) -> Finding:
    """The seeds' launch mistakes (ranks mis-set, ``MASTER_ADDR`` wrong) cannot happen here:
    the rendezvous assigns ranks and the master. Say so when the line or the environment
    sets them, so nobody debugs them."""
    given = [f"${k}" for k in IGNORED_ENV if k in env]
    given += [f for f in flags if f in {"--node-rank", "--node_rank", "--master-addr",
                                        "--master_addr", "--master-port", "--master_port"}]
    if given:
        return Finding("launch", OK, f"{', '.join(given)} set, and ignored: with etcd-ext the "
                       "rendezvous assigns every rank and the workers' master "
                       "(docs/doctor.md#launch-mistakes)")
    return Finding("launch", OK, "ranks and the workers' master come from the rendezvous")


def summary(findings: Sequence[Finding]) -> str:
    failed = [f for f in findings if f.failed]
    if not failed:
        return "doctor: every check passed"
    return f"doctor: {len(failed)} check(s) failed: " + ", ".join(f.check for f in failed)
