"""``elastic-ext status`` and ``elastic-ext list``: what a run is doing, from its store.

Read-only: these commands never write to the store, and on the embedded store they
connect as clients (they never host it).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO

from elastic_ext.rendezvous.backend import StoreBackend, parse_beat
from elastic_ext.rendezvous.errors import ConfigError
from elastic_ext.rendezvous.factory import open_backend
from elastic_ext.rendezvous.liveness import LEFT
from elastic_ext.rendezvous.settings import Settings, parse_settings
from elastic_ext.rendezvous.state import Phase, RunState

LIST_RUN_ID = "elastic-ext-list"
"""``list`` looks at the whole key prefix; the settings it opens the store with still name a run."""


def add_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    parser.add_argument("--endpoint", required=True,
                        help="the job's --rdzv-endpoint (etcd list, or c10d://host:port)")
    parser.add_argument("--rdzv-conf", default="",
                        help="the job's --rdzv-conf (key_prefix, TLS, user, ...)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    if name == "status":
        parser.add_argument("--run-id", required=True, help="the job's --rdzv-id")
        parser.add_argument("--snapshot-dir", type=Path, default=None,
                            help="also report the newest valid snapshot there")


def parse_conf(text: str) -> dict[str, str]:
    conf = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--rdzv-conf entry {item!r} is not key=value")
        conf[key.strip()] = value.strip()
    return conf


def connect(endpoint: str, run_id: str, conf: Mapping[str, str]) -> tuple[Settings, StoreBackend]:
    """The run's backend for a read-only look: a short connect timeout, never hosting."""
    settings = parse_settings(endpoint=endpoint, run_id=run_id, min_nodes=1, max_nodes=1,
                              conf={"connect_timeout": "5", **conf})
    return settings, open_backend(settings, may_host=False)


def describe(state: RunState | None, beats: Mapping[str, bytes | None], now: float,
             snapshot_step: int | None) -> dict[str, Any]:
    """The status report as data. Pure, so the text and JSON views agree."""
    if state is None:
        return {"exists": False, "newest_snapshot_step": snapshot_step}

    def node(name: str) -> dict[str, Any]:
        info = state.members.get(name) or state.waiting.get(name)
        beat = parse_beat(beats.get(name))
        return {"node": name, "address": f"{info.addr}:{info.port}" if info else None,
                "heartbeat_age_s": None if beat is None else round(max(0.0, now - beat[1]), 1),
                "left": beats.get(name) == LEFT}

    members = list(state.order) if state.phase is Phase.CLOSED else list(state.members)
    left = None if state.max_restarts is None else max(0, state.max_restarts - state.restarts)
    return {
        "exists": True, "generation": state.generation, "round": state.round,
        "phase": state.phase.value, "status": state.status.value,
        "members": [dict(node(n), rank=i if state.phase is Phase.CLOSED else None)
                    for i, n in enumerate(members)],
        "waiting": [node(n) for n in state.waiting],
        "restarts_used": state.restarts, "restarts_left": left,
        "max_restarts": state.max_restarts, "last_event": state.note,
        "newest_snapshot_step": snapshot_step,
    }


def render(report: dict[str, Any], run_id: str, where: str) -> str:
    if not report["exists"]:
        return f"run {run_id}: no state at {where} (not started, or finished and removed)\n"
    budget = ("unlimited" if report["max_restarts"] is None else
              f"{report['restarts_used']} of {report['max_restarts']} used, "
              f"{report['restarts_left']} left")
    lines = [f"run {run_id} at {where}",
             f"  round {report['round']} ({report['phase']}), status {report['status']}, "
             f"generation {report['generation']}",
             f"  restarts: {budget}",
             f"  last event: {report['last_event']}"]
    if report["newest_snapshot_step"] is not None:
        lines.append(f"  newest snapshot: step {report['newest_snapshot_step']}")
    lines.append("  rank  node                              address                heartbeat")

    def age(n: dict[str, Any]) -> str:
        if n["left"]:
            return "left"
        return "none" if n["heartbeat_age_s"] is None else f"{n['heartbeat_age_s']:.1f}s ago"
    for n in report["members"]:
        rank = "-" if n["rank"] is None else str(n["rank"])
        lines.append(f"  {rank:<5} {n['node']:<33} {str(n['address']):<22} {age(n)}")
    for n in report["waiting"]:
        lines.append(f"  wait  {n['node']:<33} {str(n['address']):<22} {age(n)}")
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    try:
        conf = parse_conf(args.rdzv_conf)
        if args.command == "list":
            return _list(args.endpoint, conf, args.json, out)
        settings, backend = connect(args.endpoint, args.run_id, conf)
        current = backend.get_state()
        state = RunState.from_bytes(current[0]) if current else None
        beats = backend.read_beats(sorted(state.known_nodes())) if state else {}
    except Exception as exc:  # an operator command: one line, no traceback
        print(f"elastic-ext {args.command}: {exc}", file=sys.stderr)
        return 2
    snapshot_step = None
    if args.snapshot_dir is not None:
        from elastic_ext.snapshot import newest_valid

        manifest = newest_valid(args.snapshot_dir)
        snapshot_step = manifest.step if manifest else None
    report = describe(state, beats, time.time(), snapshot_step)
    if args.json:
        out.write(json.dumps(report, indent=2) + "\n")
    else:
        out.write(render(report, args.run_id, settings.describe_endpoints()))
    return 0


def _list(endpoint: str, conf: Mapping[str, str], as_json: bool, out: TextIO) -> int:
    _, backend = connect(endpoint, LIST_RUN_ID, conf)
    runs = backend.list_runs()
    out.write(json.dumps(runs) + "\n" if as_json else "".join(f"{r}\n" for r in runs))
    return 0
