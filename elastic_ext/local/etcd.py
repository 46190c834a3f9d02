"""Real etcd servers on loopback: one member or a cluster, on free ports, own data dirs."""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import requests

from elastic_ext.local.processes import Proc, ProcessSet, wait_until
from elastic_ext.net import free_ports

ETCD_BIN = shutil.which("etcd") or "/usr/bin/etcd"

T = TypeVar("T")


def call_here(fn: Callable[[], T]) -> T:
    """Run ``fn`` in this process's network namespace (the default for ``EtcdCluster.call``)."""
    return fn()


@dataclass
class EtcdMember:
    name: str
    client_port: int
    peer_port: int
    data_dir: Path
    extra_args: list[str] = field(default_factory=list)
    scheme: str = "http"
    proc: Proc | None = None
    host: str = "127.0.0.1"
    prefix: Sequence[str] = ()  # a command prefix that places the member, e.g. ``ip netns exec NS``

    @property
    def client_url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.client_port}"

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://{self.host}:{self.peer_port}"


@dataclass
class EtcdCluster:
    processes: ProcessSet
    members: list[EtcdMember]
    session: requests.Session = field(default_factory=requests.Session)
    # Runs the cluster's own HTTP probes; a member in another network namespace needs
    # them run inside it (see elastic_ext.chaos.netns).
    call: Callable[[Callable[[], Any]], Any] = call_here

    @property
    def endpoints(self) -> str:
        return ",".join(m.endpoint for m in self.members)

    def start_member(self, member: EtcdMember, new: bool = True) -> None:
        """Start (or start again: etcd then ignores the initial-cluster flags) on the member's
        data dir."""
        initial = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        cmd = [*member.prefix, ETCD_BIN, "--name", member.name, "--data-dir", str(member.data_dir),
               "--listen-client-urls", member.client_url,
               "--advertise-client-urls", member.client_url,
               "--listen-peer-urls", member.peer_url,
               "--initial-advertise-peer-urls", member.peer_url,
               "--initial-cluster", initial,
               "--initial-cluster-token", f"tok-{self.members[0].client_port}",
               "--initial-cluster-state", "new", "--log-level", "warn", *member.extra_args]
        member.proc = self.processes.spawn(f"etcd-{member.name}", cmd)

    def wait_healthy(self, member: EtcdMember, timeout: float = 30.0) -> None:
        def healthy() -> bool:
            if member.proc is not None and member.proc.popen.poll() is not None:
                raise RuntimeError(f"etcd {member.name} exited:\n{member.proc.output()[-3000:]}")
            try:
                r = self.call(lambda: self.session.get(f"http://{member.host}:{member.client_port}/health",
                                                       timeout=1))
                return r.ok and r.json().get("health") == "true"
            except (requests.RequestException, ValueError):
                return False
        if member.scheme == "http":
            wait_until(healthy, timeout, 0.1, f"etcd {member.name} healthy")
        else:
            wait_until(lambda: _port_open(member.client_port), timeout, 0.1, f"etcd {member.name}")

    def leader(self) -> EtcdMember:
        def status_of(member: EtcdMember) -> Any:
            return self.session.post(f"{member.client_url}/v3/maintenance/status", json={},
                                     timeout=1).json()

        for m in self.members:
            try:
                status = self.call(partial(status_of, m))
            except (requests.RequestException, ValueError):
                continue
            if status.get("leader") and status["leader"] == status["header"]["member_id"]:
                return m
        raise RuntimeError("no etcd leader")

    def stop_member(self, member: EtcdMember) -> None:
        assert member.proc is not None
        member.proc.kill()
        member.proc.popen.wait(timeout=10)


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def start_cluster(processes: ProcessSet, base_dir: Path, size: int = 1,
                  extra_args: list[str] | None = None, scheme: str = "http",
                  host: str = "127.0.0.1", prefix: Sequence[str] = (),
                  call: Callable[[Callable[[], Any]], Any] = call_here) -> EtcdCluster:
    ports = free_ports(2 * size, "127.0.0.1")
    members = [EtcdMember(f"m{i}", ports[2 * i], ports[2 * i + 1], base_dir / f"etcd-m{i}",
                          list(extra_args or []), scheme, host=host, prefix=tuple(prefix))
               for i in range(size)]
    cluster = EtcdCluster(processes, members, call=call)
    for m in members:
        cluster.start_member(m)
    for m in members:
        cluster.wait_healthy(m)
    return cluster


def etcd_available() -> bool:
    return Path(ETCD_BIN).exists()


def run_etcdctl(cluster: EtcdCluster, *args: str) -> str:
    ctl = shutil.which("etcdctl") or "/usr/bin/etcdctl"
    return subprocess.run([ctl, f"--endpoints={cluster.endpoints}", *args], check=True,
                          capture_output=True, text=True, timeout=30,
                          env={"ETCDCTL_API": "3", "PATH": "/usr/bin:/bin"}).stdout


def _metrics(client_url: str, timeout: float) -> str:
    return requests.get(f"{client_url}/metrics", timeout=timeout,
                        proxies={"http": "", "https": ""}).text


def received_requests(client_url: str, timeout: float = 10.0) -> Counter[str]:
    """Messages the etcd at ``client_url`` received so far, by gRPC method (its
    ``/metrics``: unary calls and stream messages alike, through the gateway or not);
    ``timeout``: how long an etcd under load may take to answer."""
    counts: Counter[str] = Counter()
    for line in _metrics(client_url, timeout).splitlines():
        if line.startswith("grpc_server_msg_received_total{"):
            labels, value = line.rsplit(" ", 1)
            method = re.search(r'grpc_method="([^"]*)"', labels)
            counts[method[1] if method else "?"] += int(float(value))
    return counts


def sent_bytes(client_url: str, timeout: float = 10.0) -> int:
    """Bytes the etcd at ``client_url`` sent to its gRPC clients so far (its JSON gateway
    is one of them: what the gateway passes on is about 4/3 of it, values in base64)."""
    for line in _metrics(client_url, timeout).splitlines():
        if line.startswith("etcd_network_client_grpc_sent_bytes_total "):
            return int(float(line.rsplit(" ", 1)[1]))
    raise RuntimeError(f"etcd at {client_url} reports no etcd_network_client_grpc_sent_bytes_total")
