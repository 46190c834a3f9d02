"""Which etcd client can hold 1,024 agents' heartbeats: lease keep-alives through etcd's
HTTP/JSON gateway (what etcd-ext uses) against gRPC keep-alive streams (grpcio).

A heartbeat on etcd is a lease keep-alive (issue 27). etcd's gRPC API has a keep-alive
*stream*; its gateway cannot hold one open (etcd-io/etcd#8237), so each keep-alive through
the gateway is one HTTP request on a kept-alive connection. This measures what that costs,
against one gRPC stream per lease, at the same rate on the same private etcd:

  gateway  ``EtcdClient.lease_keepalive`` from ``--threads`` threads (http.client per thread)
  grpc     one bidirectional ``Lease/LeaseKeepAlive`` stream per lease on grpc.aio, one
           channel per 64 leases (the two messages are encoded by hand: an int64 ID in,
           an int64 TTL out); needs ``pip install grpcio``, else the column says so

Each case: ``--leases`` leases (default 1,024), each renewed every ``--period`` s (1 s, what
etcd-ext's default heartbeat_timeout of 3 s gives: a lease TTL of 2 s renewed at every
second keeper tick) for ``--seconds`` s. Measured: keep-alives done per second, etcd's
CPU (user+system from /proc) and the client's (this process) per keep-alive, and whether
any lease expired. Repeated ``--reps`` times, alternating the clients; median and range.

Usage: python benchmarks/etcd_keepalive.py [--leases 1024] [--period 1] [--seconds 10]
       [--reps 3] [--threads 16]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import resource
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from common import cell, cpu_model, private_etcd

from elastic_ext.rendezvous.stores.etcd.client import EtcdClient

_CLK_TCK = os.sysconf("SC_CLK_TCK")
KEEPALIVE_METHOD = "/etcdserverpb.Lease/LeaseKeepAlive"


def process_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


def own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def varint(value: int) -> bytes:
    out = bytearray()
    value &= (1 << 64) - 1
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def keepalive_request(lease: int) -> bytes:
    """``LeaseKeepAliveRequest{ID}``: field 1, varint."""
    return b"\x08" + varint(lease)


def read_varint(data: bytes, at: int) -> tuple[int, int]:
    """The varint at ``at`` and the offset after it."""
    value, shift = 0, 0
    while True:
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, at


def ttl_of(reply: bytes) -> int:
    """``LeaseKeepAliveResponse.TTL`` (field 3, varint); 0 when absent (lease gone)."""
    at, ttl = 0, 0
    while at < len(reply):
        tag, at = read_varint(reply, at)
        field, kind = tag >> 3, tag & 7
        if kind == 0:
            value, at = read_varint(reply, at)
            if field == 3:
                ttl = value
        elif kind == 2:  # the header: length-delimited, skipped
            length, at = read_varint(reply, at)
            at += length
        else:
            raise ValueError(f"unexpected wire type {kind}")
    return ttl


class Case:
    """One client's run: keep-alives done, lost leases, CPU of etcd and of this process."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.done = 0
        self.expired = 0
        self.lock = threading.Lock()

    def count(self, ttl: int) -> None:
        with self.lock:
            self.done += 1
            self.expired += ttl <= 0


def run_gateway(client: EtcdClient, leases: list[int], period: float, seconds: float,
                threads: int, case: Case) -> None:
    stop = time.monotonic() + seconds

    def work(mine: list[int]) -> None:
        slot = period / max(1, len(mine))
        next_at = time.monotonic()
        while True:
            for lease in mine:
                next_at += slot
                if next_at > stop:
                    return
                time.sleep(max(0.0, next_at - time.monotonic()))
                case.count(client.lease_keepalive(lease))
    workers = [threading.Thread(target=work, args=(leases[i::threads],))
               for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()


def run_grpc(endpoint: str, leases: list[int], period: float, seconds: float,
             case: Case) -> None:
    import grpc  # optional: only this column needs it

    async def main() -> None:
        channels = [grpc.aio.insecure_channel(endpoint) for _ in range(0, len(leases), 64)]
        stop = time.monotonic() + seconds

        async def holder(index: int, lease: int) -> None:
            channel = channels[index // 64]
            call = channel.stream_stream(KEEPALIVE_METHOD, request_serializer=None,
                                         response_deserializer=None)()
            await asyncio.sleep(period * index / len(leases))  # spread, as agents are
            next_at = time.monotonic()
            while next_at <= stop:
                await call.write(keepalive_request(lease))
                case.count(ttl_of(await call.read()))
                next_at += period
                await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            await call.done_writing()
        await asyncio.gather(*(holder(i, lease) for i, lease in enumerate(leases)))
        for channel in channels:
            await channel.close()
    asyncio.run(main())


def measure(name: str, etcd_pid: int, body: Callable[[Case], None], seconds: float
            ) -> tuple[Case, float, float, float]:
    case = Case(name)
    etcd0, own0, began = process_cpu(etcd_pid), own_cpu(), time.monotonic()
    body(case)
    elapsed = time.monotonic() - began
    return case, elapsed, process_cpu(etcd_pid) - etcd0, own_cpu() - own0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--leases", type=int, default=1024)
    parser.add_argument("--period", type=float, default=1.0)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=16)
    args = parser.parse_args()
    try:
        import grpc  # noqa: F401
        have_grpc = True
    except ImportError:
        have_grpc = False
    rows: dict[str, dict[str, list[float]]] = {}
    with private_etcd("keepalive-") as (_, member, client):
        assert member.proc is not None
        etcd_pid = member.proc.popen.pid
        endpoint = member.endpoint
        leases = [client.lease_grant(30)[0] for _ in range(args.leases)]
        for rep in range(args.reps):
            order = ["gateway", "grpc"] if rep % 2 == 0 else ["grpc", "gateway"]
            for name in order:
                if name == "grpc" and not have_grpc:
                    continue
                if name == "gateway":
                    def body(case: Case) -> None:
                        run_gateway(client, leases, args.period, args.seconds,
                                    args.threads, case)
                else:
                    def body(case: Case) -> None:
                        run_grpc(endpoint, leases, args.period, args.seconds, case)
                case, elapsed, etcd_cpu, own = measure(name, etcd_pid, body, args.seconds)
                row = rows.setdefault(name, {})
                row.setdefault("rate", []).append(case.done / elapsed)
                row.setdefault("etcd_us", []).append(1e6 * etcd_cpu / max(1, case.done))
                row.setdefault("client_us", []).append(1e6 * own / max(1, case.done))
                row.setdefault("etcd_cores", []).append(etcd_cpu / elapsed)
                row.setdefault("expired", []).append(case.expired)
                print(f"rep {rep + 1} {name}: {case.done / elapsed:.0f} keep-alives/s, "
                      f"etcd {etcd_cpu / elapsed:.2f} cores, client "
                      f"{own / elapsed:.2f} cores, {case.expired} answered TTL 0",
                      file=sys.stderr, flush=True)
    print(f"\n{dt.date.today()}, {os.cpu_count()} cores ({cpu_model()}); {args.leases} "
          f"leases, each renewed every {args.period:g} s for {args.seconds:g} s; "
          f"{args.reps} reps, median (range)\n")
    print("| client | keep-alives/s | etcd CPU per keep-alive (µs) | etcd cores "
          "| client CPU per keep-alive (µs) | leases lost |")
    print("|---|---|---|---|---|---|")
    for name in ("gateway", "grpc"):
        if name not in rows:
            print(f"| {name} | not run: `pip install grpcio` | | | | |")
            continue
        got = rows[name]
        print(f"| {name} | {cell(got['rate'])} | {cell(got['etcd_us'])} "
              f"| {cell(got['etcd_cores'], 2)} | {cell(got['client_us'])} "
              f"| {int(max(got['expired']))} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
