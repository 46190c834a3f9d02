"""``elastic-ext doctor``: a preflight that finds a broken set-up in seconds, before the job
spends its queue time on it.

It takes the job's own torchrun line (torchrun's flags are read, the rest, the training
script and its arguments included, ignored except the trainer's ``--snapshot-dir``). Run on
every node of an allocation, it prints one line per check (``ok``, ``FAIL`` with the fix,
or ``skip`` with why it could not check) and exits 1 on any failure. The checks live in
``checks.py``, the peer probe in ``peers.py``; what each means: docs/doctor.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TextIO

from elastic_ext.ops.doctor.checks import (
    FAIL,
    OK,
    SKIP,
    Address,
    Finding,
    check_gpus,
    check_launch,
    check_run_id,
    check_snapshot_dir,
    count_gpus,
    local_interfaces,
    pick_address,
    resolve_hostname,
    summary,
)
from elastic_ext.rendezvous.settings import Settings

DEFAULT_WAIT_S = 30.0
DEFAULT_PROBE_TIMEOUT_S = 2.0


def add_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    env = os.environ
    parser.add_argument("--rdzv-backend", "--rdzv_backend", dest="rdzv_backend",
                        default=env.get("PET_RDZV_BACKEND", "static"))
    parser.add_argument("--rdzv-endpoint", "--rdzv_endpoint", dest="rdzv_endpoint",
                        default=env.get("PET_RDZV_ENDPOINT", ""))
    parser.add_argument("--rdzv-id", "--rdzv_id", dest="rdzv_id",
                        default=env.get("PET_RDZV_ID", "none"))
    parser.add_argument("--rdzv-conf", "--rdzv_conf", dest="rdzv_conf",
                        default=env.get("PET_RDZV_CONF", ""))
    parser.add_argument("--nnodes", default=env.get("PET_NNODES", "1:1"))
    parser.add_argument("--nproc-per-node", "--nproc_per_node", dest="nproc_per_node",
                        default=env.get("PET_NPROC_PER_NODE"))
    parser.add_argument("--local-addr", "--local_addr", dest="local_addr", default=None)
    parser.add_argument("--snapshot-dir", dest="snapshot_dirs", action="append", type=Path,
                        default=[], help="check this directory (the trainer's own "
                        "--snapshot-dir in the line is checked too)")
    parser.add_argument("--min-free-mb", type=float, default=1024.0,
                        help="least free space the snapshot directory needs (default 1024)")
    parser.add_argument("--wait", type=float, default=DEFAULT_WAIT_S,
                        help="seconds to wait for --nnodes MIN doctors of this --rdzv-id "
                        f"(default {DEFAULT_WAIT_S:g})")
    parser.add_argument("--probe-timeout", type=float, default=DEFAULT_PROBE_TIMEOUT_S,
                        help="seconds one connection to a peer may take "
                        f"(default {DEFAULT_PROBE_TIMEOUT_S:g})")
    parser.set_defaults(_accepts_rest=True)


def parse_nnodes(text: str) -> tuple[int, int]:
    low, _, high = text.partition(":")
    try:
        return int(low), int(high or low)
    except ValueError:
        raise ValueError(f"--nnodes={text} is not N or MIN:MAX, e.g. --nnodes=2:4") from None


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = out or sys.stdout  # read now: a test (or a caller) may have replaced it
    findings: list[Finding] = []

    def say(finding: Finding) -> None:
        findings.append(finding)
        out.write(finding.line() + "\n")
        out.flush()
    started = time.monotonic()
    for finding in diagnose(args, os.environ):
        say(finding)
    out.write(f"{summary(findings)} ({time.monotonic() - started:.1f}s)\n")
    return 1 if any(f.failed for f in findings) else 0


def diagnose(args: argparse.Namespace, env: Mapping[str, str]) -> Iterator[Finding]:
    """Every check in order, each finding as soon as it is known (a hang shows where)."""
    rest: list[str] = list(getattr(args, "_rest", []))
    yield check_launch(env, [r.partition("=")[0] for r in rest])
    yield check_gpus(args.nproc_per_node, count_gpus(env))
    for path in args.snapshot_dirs:
        yield check_snapshot_dir(path, int(args.min_free_mb * 2**20))
    if args.rdzv_backend != "etcd-ext":
        yield Finding("rendezvous", FAIL, f"--rdzv-backend={args.rdzv_backend}: the doctor "
                      "checks etcd-ext jobs; pass --rdzv-backend=etcd-ext")
        return
    try:
        settings = _settings(args)
    except ValueError as exc:  # ConfigError is one: its message names the fix
        yield Finding("rendezvous", FAIL, str(exc))
        return
    address, problem = pick_address(env, args.local_addr, local_interfaces(), resolve_hostname)
    if problem is not None:
        yield problem
    if settings.store == "c10d":
        yield from _embedded(settings)
        return
    yield from _etcd(settings, args, address)


def _settings(args: argparse.Namespace) -> Settings:
    from elastic_ext.ops.status import parse_conf
    from elastic_ext.rendezvous.settings import parse_settings

    low, high = parse_nnodes(args.nnodes)
    conf = parse_conf(args.rdzv_conf)
    conf.setdefault("connect_timeout", "5")  # a preflight: say it is down, do not wait it out
    return parse_settings(endpoint=args.rdzv_endpoint, run_id=args.rdzv_id, min_nodes=low,
                          max_nodes=high, conf=conf, local_addr=args.local_addr)


def _etcd(settings: Settings, args: argparse.Namespace,
          address: Address | None) -> Iterator[Finding]:
    from elastic_ext.ops.doctor.peers import Meeting
    from elastic_ext.rendezvous.stores.etcd.backend import EtcdBackend

    try:
        backend = EtcdBackend.connect(settings)
        backend.get_state()  # a v3 request: a gateway that is not etcd's fails here
    except Exception as exc:  # every store error names its fix
        yield Finding("etcd", FAIL, f"{settings.describe_endpoints()}: {exc}")
        return
    yield Finding("etcd", OK, f"v3 API at {settings.describe_endpoints()}")
    try:
        yield check_run_id(backend, settings)
        if address is None:
            return
        client = backend._client  # the backend's one connection pool, rotation and auth
        meeting = Meeting(client, settings.run_prefix, address, settings.min_nodes,
                          settings.max_nodes, wait=args.wait,
                          probe_timeout=args.probe_timeout,
                          clock_limit=settings.timeouts.heartbeat)
        yield Finding("network", OK, f"this node: {address.describe()}")
        yield from meeting.run()
    except OSError as exc:
        yield Finding("network", FAIL, f"cannot listen on {address.addr if address else '?'} "
                      f"({exc.strerror or exc}): the address is not this node's; set "
                      "ELASTIC_EXT_IFNAME to one of its interfaces")
    except Exception as exc:
        yield Finding("etcd", FAIL, f"{settings.describe_endpoints()}: {exc}")
    finally:
        backend.close()


def _embedded(settings: Settings) -> Iterator[Finding]:
    """The embedded store lives in one agent, so before the job there is nothing to meet
    at: check that its host can bind the port, or read a run already served there."""
    import socket

    endpoint = settings.endpoints[0]
    try:
        with socket.create_connection((endpoint.host, endpoint.port), timeout=2):
            served = True
    except OSError:
        served = False
    if served:
        from elastic_ext.ops.status import connect

        try:
            _, backend = connect(f"c10d://{endpoint}", settings.run_id,
                                 {"key_prefix": settings.key_prefix})
            yield check_run_id(backend, settings)
        except Exception as exc:
            yield Finding("store", FAIL, f"something listens on {endpoint} but does not answer "
                          f"as the embedded store ({exc}); free the port or pick another "
                          "--rdzv-endpoint")
    else:
        yield Finding("store", OK, f"embedded store at {endpoint}: nothing serves it yet "
                      "(its host's agent starts it)")
    yield Finding("network", SKIP, "the embedded store has no place for the nodes to meet "
                  "before the job: the agents probe each other when the first round closes; "
                  "use etcd for the peer and clock checks")
    yield Finding("clock", SKIP, "needs the peer probe (etcd)")
