"""The doctor's peer probe: every doctor of one ``--rdzv-id`` meets the others in etcd,
probes a few of them on the workers' network and judges who cannot be reached.

Each doctor listens on a TCP port of its chosen address and registers
``<run_prefix>doctor/node/<me>`` (its host, address, interface, port) on a lease, waits a
bounded time for ``--nnodes`` MIN peers (and MAX, for a short grace after MIN), connects
to the next ``RING`` peers in name order (O(N) connections in all, as at 1,024 nodes),
and publishes what it found under ``doctor/result/<me>``. Once every peer published (or
the deadline passed), each doctor judges the same results the same way: a node most of
its probers could not reach is named with its address and interface, and a node whose
clock most of its probers read more than ``heartbeat_timeout`` apart is named too. Each
probe reply carries the peer's wall clock, read against the prober's round trip.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import socket
import statistics
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

from elastic_ext.ops.doctor.checks import FAIL, OK, SKIP, Address, Finding, is_loopback
from elastic_ext.rendezvous.stores.etcd.client import EtcdClient

logger = logging.getLogger(__name__)

RING = 4
"""Each doctor probes the next RING peers in name order; each node is probed by RING others."""
GRACE_S = 2.0
"""After MIN peers are in, how long the doctor waits for the rest of MAX."""


@dataclass(frozen=True)
class Peer:
    key: str  # unique per doctor process
    host: str  # the node's hostname, for people
    addr: str
    ifname: str | None
    port: int
    how: str

    def describe(self) -> str:
        return f"{self.host} ({self.addr} on {self.ifname or 'an unknown interface'}, {self.how})"


@dataclass(frozen=True)
class Probe:
    ok: bool
    error: str = ""
    offset: float | None = None  # the peer's clock minus ours, at the round trip's middle
    rtt: float | None = None


class ProbeServer:
    """Answers every connection with one JSON line: who this is and its wall clock."""

    def __init__(self, addr: str, key: str) -> None:
        family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((addr, 0))
        self._sock.listen(128)
        self._sock.settimeout(0.2)
        self._key = key
        self._stop = threading.Event()
        self.port: int = self._sock.getsockname()[1]
        self._thread = threading.Thread(target=self._serve, name="doctor-probe", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                reply = json.dumps({"key": self._key, "time": time.time()}) + "\n"
                with contextlib.suppress(OSError):
                    conn.sendall(reply.encode())

    def close(self) -> None:
        self._stop.set()
        self._sock.close()
        self._thread.join(timeout=2)


def probe(peer: Peer, timeout: float) -> Probe:
    """One connection to ``peer``'s doctor: reached, and its clock against ours."""
    start = time.time()
    try:
        with socket.create_connection((peer.addr, peer.port), timeout=timeout) as conn:
            data = b""
            while not data.endswith(b"\n") and len(data) < 4096:
                chunk = conn.recv(4096)
                if not chunk:
                    break
                data += chunk
    except OSError as exc:
        reason = "timed out" if isinstance(exc, TimeoutError) else (exc.strerror or str(exc))
        return Probe(False, f"{reason} after {time.time() - start:.1f}s")
    end = time.time()
    try:
        reply = json.loads(data)
        theirs, key = float(reply["time"]), str(reply["key"])
    except (ValueError, KeyError, TypeError):
        return Probe(False, "something else answers on its port")
    if key != peer.key:
        return Probe(False, "another doctor answers at its address (two nodes share it?)")
    return Probe(True, offset=theirs - (start + end) / 2, rtt=end - start)


def ring_targets(keys: list[str], me: str, ring: int = RING) -> list[str]:
    """The next ``ring`` keys after ``me`` in name order, wrapping around."""
    ordered = sorted(set(keys) | {me})
    at = ordered.index(me)
    others = ordered[at + 1:] + ordered[:at]
    return others[:ring]


def judge(peers: Mapping[str, Peer], results: Mapping[str, Mapping[str, Probe]],
          clock_limit: float) -> list[Finding]:
    """The job's verdict from every doctor's probes; the same on every node. Pure."""
    findings: list[Finding] = []
    incoming: dict[str, list[tuple[str, Probe]]] = {}
    for prober, found in results.items():
        for target, result in found.items():
            incoming.setdefault(target, []).append((prober, result))
    unreachable = []
    for target, probes in sorted(incoming.items()):
        failed = [(p, r) for p, r in probes if not r.ok]
        if target in peers and len(failed) * 2 > len(probes):
            unreachable.append(target)
            who = "; ".join(f"from {peers[p].host if p in peers else p}: {r.error}"
                            for p, r in failed[:3])
            findings.append(Finding(
                "network", FAIL,
                f"{peers[target].describe()} is not reachable from {len(failed)} of "
                f"{len(probes)} peers ({who}); on that node set ELASTIC_EXT_IFNAME (or "
                "ELASTIC_EXT_LOCAL_ADDR) to the interface the other nodes reach, or open "
                "its firewall to the job's ports"))
    if len(unreachable) == 2 and len(peers) == 2:
        findings.append(Finding("network", FAIL, "with two nodes the doctor cannot tell which "
                                "side is wrong: check both"))
    if not unreachable:
        probes_done = sum(len(found) for found in results.values())
        findings.append(Finding("network", OK, f"{len(peers)} nodes, {probes_done} probes on "
                                "the workers' network, all answered"))
    loopbacks = {peer.host for peer in peers.values()}
    if len(loopbacks) > 1:
        for peer in peers.values():
            if is_loopback(peer.addr):
                findings.append(Finding(
                    "network", FAIL, f"{peer.describe()} is a loopback address, which other "
                    "nodes cannot reach; set ELASTIC_EXT_IFNAME to the training network's "
                    "interface (Debian's `127.0.1.1 hostname` line does this)"))
    findings += _judge_clocks(peers, incoming, clock_limit)
    return findings


def _judge_clocks(peers: Mapping[str, Peer], incoming: Mapping[str, list[tuple[str, Probe]]],
                  limit: float) -> list[Finding]:
    """A node whose clock most of its pairs read more than ``limit`` apart."""
    pairs: dict[str, list[float]] = {}
    for target, probes in incoming.items():
        for prober, result in probes:
            if result.ok and result.offset is not None:
                pairs.setdefault(target, []).append(result.offset)
                pairs.setdefault(prober, []).append(-result.offset)
    findings = []
    for node, offsets in sorted(pairs.items()):
        apart = [o for o in offsets if abs(o) > limit]
        if node in peers and len(apart) * 2 > len(offsets):
            findings.append(Finding(
                "clock", FAIL, f"{peers[node].host}'s clock is {statistics.median(apart):+.1f}s "
                f"off its peers' (more than heartbeat_timeout={limit:g}s); run NTP (chrony) "
                "on every node"))
    if not findings:
        worst = max((abs(o) for offsets in pairs.values() for o in offsets), default=None)
        text = "no pair measured" if worst is None else f"within {worst:.3f}s of each other"
        findings.append(Finding("clock", OK if worst is not None else SKIP, text))
    return findings


class Meeting:
    """This doctor's part in the meeting: registration, serving, probing, publishing."""

    def __init__(self, client: EtcdClient, run_prefix: str, address: Address,
                 min_nodes: int, max_nodes: int, *, wait: float, probe_timeout: float,
                 clock_limit: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._client = client
        self._prefix = f"{run_prefix}doctor/"
        self._address = address
        self._min, self._max = min_nodes, max_nodes
        self._wait, self._probe_timeout = wait, probe_timeout
        self._clock_limit = clock_limit
        self._clock = clock
        self.key = f"{socket.gethostname()}-{uuid.uuid4().hex[:8]}"

    def _peers(self) -> dict[str, Peer]:
        found = {}
        for kv in self._client.get_prefix(self._prefix + "node/"):
            try:
                peer = Peer(**json.loads(kv.value))
            except (ValueError, TypeError):
                continue
            found[peer.key] = peer
        return found

    def _results(self) -> dict[str, dict[str, Probe]]:
        found = {}
        for kv in self._client.get_prefix(self._prefix + "result/"):
            try:
                raw = json.loads(kv.value)
                found[raw["key"]] = {t: Probe(**p) for t, p in raw["probes"].items()}
            except (ValueError, TypeError, KeyError):
                continue
        return found

    def _readers(self) -> set[str]:
        """The doctors that have read every result they waited for."""
        return {kv.key.decode().rsplit("/", 1)[-1]
                for kv in self._client.get_prefix(self._prefix + "read/")}

    def _poll(self, done: Callable[[], bool], deadline: float) -> bool:
        """``done()`` until it holds or ``deadline``; whether it held."""
        stop = threading.Event()
        while not done():
            left = deadline - self._clock()
            if left <= 0:
                return False
            stop.wait(min(0.1, left))
        return True

    def run(self) -> list[Finding]:
        start = self._clock()
        ttl = math.ceil(self._wait + 3 * self._probe_timeout + 10)
        server = ProbeServer(self._address.addr, self.key)
        lease, _ = self._client.lease_grant(ttl)
        try:
            me = Peer(self.key, socket.gethostname(), self._address.addr, self._address.ifname,
                      server.port, self._address.how)
            self._client.put(self._prefix + "node/" + self.key, json.dumps(asdict(me)).encode(),
                             lease=lease)
            findings, peers = self._gather(start)
            targets = [peers[k] for k in ring_targets(list(peers), self.key)]
            with ThreadPoolExecutor(max_workers=max(1, len(targets))) as pool:
                probes = dict(zip((t.key for t in targets),
                                  pool.map(lambda t: probe(t, self._probe_timeout), targets),
                                  strict=True))
            payload = {"key": self.key, "probes": {k: asdict(p) for k, p in probes.items()}}
            self._client.put(self._prefix + "result/" + self.key,
                             json.dumps(payload).encode(), lease=lease)
            # Keep answering until every peer, late ones included, probed and said so (or
            # the deadline): a late doctor must not find the early ones gone.
            results: dict[str, dict[str, Probe]] = {}

            def all_in() -> bool:
                peers.update(self._peers())
                results.clear()
                results.update(self._results())
                return set(peers) <= set(results)
            settle = self._clock() + 2 * self._probe_timeout + 3
            if not self._poll(all_in, settle):
                missing = sorted(peers[k].host for k in set(peers) - set(results))
                findings.append(Finding("network", SKIP, "no probe results from "
                                        f"{', '.join(missing)} within the deadline: judged "
                                        "on the others'"))
            verdict = findings + judge(peers, {k: v for k, v in results.items() if k in peers},
                                       self._clock_limit)
            # Leaving revokes the lease, which removes this doctor's result: wait until every
            # peer has read them all (a slower one polls), or the same deadline.
            self._client.put(self._prefix + "read/" + self.key, b"1", lease=lease)
            self._poll(lambda: set(peers) <= self._readers(), settle)
            return verdict
        finally:
            server.close()
            with contextlib.suppress(Exception):
                self._client.lease_revoke(lease)

    def _gather(self, start: float) -> tuple[list[Finding], dict[str, Peer]]:
        """Wait for MIN peers (up to ``wait``), then for MAX up to ``GRACE_S`` more."""
        peers: dict[str, Peer] = {}

        def enough(count: int) -> Callable[[], bool]:
            def check() -> bool:
                peers.clear()
                peers.update(self._peers())
                return len(peers) >= count
            return check
        findings = []
        deadline = start + self._wait
        if not self._poll(enough(self._min), deadline):
            findings.append(Finding(
                "peers", FAIL, f"only {len(peers)} of --nnodes MIN={self._min} nodes ran the "
                f"doctor with this --rdzv-id within {self._wait:g}s; run it on every node "
                "(srun --ntasks-per-node=1), or raise --wait"))
            return findings, peers
        if len(peers) < self._max:
            self._poll(enough(self._max), min(deadline, self._clock() + GRACE_S))
        findings.append(Finding("peers", OK, f"{len(peers)} nodes ran the doctor "
                                f"(--nnodes={self._min}:{self._max})"))
        return findings, peers
