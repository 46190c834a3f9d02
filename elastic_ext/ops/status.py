"""``elastic-ext status`` and ``elastic-ext list``: what a run is doing, from its store.

Read-only: these commands never write to the store, and on the embedded store they
connect as clients (they never host it). ``status --watch`` refreshes until interrupted:
in place on a terminal, one block (or with ``--json`` one JSON document per line) per
refresh otherwise, and it lists the last events it saw, so an operator can leave it open
through faults and store outages. Each node's pace (its step time and its slowest worker's
own work per step, from its heartbeat) is shown, and a node slower than the job's
``straggler_margin`` at this moment is marked ``slow``: the same rule the agents judge
stragglers by (``protocol/straggler.py``), without their wait of ``straggler_for``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO

from elastic_ext.rendezvous.errors import ConfigError
from elastic_ext.rendezvous.protocol.liveness import LEFT
from elastic_ext.rendezvous.protocol.pace import Pace
from elastic_ext.rendezvous.protocol.policy import stalled_rounds
from elastic_ext.rendezvous.protocol.state import Phase, RunState
from elastic_ext.rendezvous.protocol.straggler import StragglerJudge, StragglerRules
from elastic_ext.rendezvous.settings import Settings, parse_settings
from elastic_ext.rendezvous.stores.contract import StoreBackend
from elastic_ext.rendezvous.stores.open import open_backend
from elastic_ext.rendezvous.stores.wire import pace_of, parse_beat

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
        parser.add_argument("--watch", action="store_true",
                            help="refresh until interrupted (Ctrl-C)")
        parser.add_argument("--interval", type=float, default=2.0,
                            help="seconds between refreshes with --watch (default 2)")
        parser.add_argument("--count", type=int, default=None,
                            help="with --watch: stop after this many refreshes")


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
             snapshot_step: int | None, beats_expire: bool = False,
             straggler: StragglerRules | None = None) -> dict[str, Any]:
    """The status report as data. Pure, so the text and JSON views agree. Where heartbeat
    keys expire (etcd's leases, ``StoreBackend.heartbeats_expire``) a key's value is as
    old as the agent's announcement, so its age says nothing: ``lease_held`` instead, and
    no ``heartbeat_age_s``. ``straggler``: the job's rules, whose margin marks a node
    ``slow``."""
    if state is None:
        return {"exists": False, "newest_snapshot_step": snapshot_step}
    rules = straggler or StragglerRules()
    members = list(state.order) if state.phase is Phase.CLOSED else list(state.members)
    slow = _slow_now(state, members, beats, rules)

    def node(name: str) -> dict[str, Any]:
        info = state.members.get(name) or state.waiting.get(name)
        beat = parse_beat(beats.get(name))
        held = beats_expire and beat is not None
        pace = pace_of(beats.get(name))
        return {"node": name, "address": f"{info.addr}:{info.port}" if info else None,
                "heartbeat_age_s": None if beat is None or held
                else round(max(0.0, now - beat[1]), 1),
                "lease_held": held, "left": beats.get(name) == LEFT,
                "step_s": None if pace is None else pace.step_s,
                "own_s": None if pace is None else pace.own_s, "slow": name in slow}

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
        "rounds_without_progress": stalled_rounds(state),
        "left_out": dict(state.excluded),
        "left_the_job": dict(state.leaving),
        "slow_nodes": sorted(slow), "straggler_margin": rules.margin,
    }


def _slow_now(state: RunState, members: list[str], beats: Mapping[str, bytes | None],
              rules: StragglerRules) -> set[str]:
    """The closed round's nodes slower than the margin now, by the agents' own rule. An
    open round has no workers stepping, and a leaving node's pace is its last."""
    if state.phase is not Phase.CLOSED:
        return set()
    paces: dict[str, Pace | None] = {n: pace_of(beats.get(n)) for n in members
                                     if n not in state.leaving}
    return StragglerJudge(rules, min_nodes=1).slow_now(paces)


def render(report: dict[str, Any], run_id: str, where: str) -> str:
    """The report as text; a watch's report adds its time and the last events it saw."""
    stamp = ""
    if "time" in report:
        stamp = time.strftime(" (%H:%M:%S)", time.localtime(report["time"]))
    if report.get("error"):
        head = f"run {run_id} at {where}{stamp}: the store did not answer: {report['error']}"
        return head + "\n" + _render_recent(report)
    if not report["exists"]:
        return (f"run {run_id}: no state at {where}{stamp} (not started, or finished and "
                "removed)\n") + _render_recent(report)
    budget = ("unlimited" if report["max_restarts"] is None else
              f"{report['restarts_used']} of {report['max_restarts']} used, "
              f"{report['restarts_left']} left")
    lines = [f"run {run_id} at {where}{stamp}",
             f"  round {report['round']} ({report['phase']}), status {report['status']}, "
             f"generation {report['generation']}",
             f"  restarts: {budget}",
             f"  last event: {report['last_event']}"]
    if report.get("rounds_without_progress"):
        lines.append(f"  rounds in a row that ended before a training step: "
                     f"{report['rounds_without_progress']}")
    for name, why in (report.get("left_out") or {}).items():
        lines.append(f"  left out: {name}: {why}")
    for name, why in (report.get("left_the_job") or {}).items():
        lines.append(f"  left the job: {name}: {why}")
    if report["newest_snapshot_step"] is not None:
        lines.append(f"  newest snapshot: step {report['newest_snapshot_step']}")
    lines.append("  rank  node                              address                heartbeat"
                 "    step      own")

    def age(n: dict[str, Any]) -> str:
        if n["left"]:
            return "left"
        if n.get("lease_held"):
            return "lease held"
        return "none" if n["heartbeat_age_s"] is None else f"{n['heartbeat_age_s']:.1f}s ago"

    def pace(n: dict[str, Any]) -> str:
        step, own = (n.get(k) for k in ("step_s", "own_s"))
        text = " ".join(f"{'-' if v is None else f'{v:.3f}s':<9}" for v in (step, own))
        return (text + " slow").rstrip() if n.get("slow") else text.rstrip()
    for n in report["members"]:
        rank = "-" if n["rank"] is None else str(n["rank"])
        lines.append(f"  {rank:<5} {n['node']:<33} {str(n['address']):<22} {age(n):<12} "
                     f"{pace(n)}")
    for n in report["waiting"]:
        lines.append(f"  wait  {n['node']:<33} {str(n['address']):<22} {age(n):<12} "
                     f"{pace(n)}")
    if report.get("slow_nodes"):
        lines.append(f"  slow: own step work over {report['straggler_margin']:g}x the other "
                     "nodes' median (straggler_margin)")
    return "\n".join(lines) + "\n" + _render_recent(report)


def _render_recent(report: dict[str, Any]) -> str:
    recent = report.get("recent_events") or []
    if not recent:
        return ""
    lines = ["  events seen while watching:"]
    lines += [time.strftime("    %H:%M:%S ", time.localtime(e["time"])) + e["event"]
              for e in recent]
    return "\n".join(lines) + "\n"


RECENT_EVENTS = 5
CLEAR_SCREEN = "\x1b[H\x1b[2J"


def read_report(backend: StoreBackend, snapshot_dir: Path | None,
                straggler: StragglerRules | None = None) -> dict[str, Any]:
    """One look at the run: its state, everyone's heartbeat, the newest snapshot."""
    current = backend.get_state()
    state = RunState.from_bytes(current[0]) if current else None
    beats = backend.read_beats(sorted(state.known_nodes())) if state else {}
    snapshot_step = None
    if snapshot_dir is not None:
        from elastic_ext.worker.snapshot import newest_valid

        manifest = newest_valid(snapshot_dir)
        snapshot_step = manifest.step if manifest else None
    return describe(state, beats, time.time(), snapshot_step, backend.heartbeats_expire,
                    straggler)


def run(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    try:
        conf = parse_conf(args.rdzv_conf)
        if args.command == "list":
            return _list(args.endpoint, conf, args.json, out)
        if args.watch and (args.interval <= 0 or (args.count is not None and args.count < 1)):
            raise ConfigError("--interval must be > 0 and --count >= 1")
        settings, backend = connect(args.endpoint, args.run_id, conf)
        if args.watch:
            return watch(backend, args, settings.describe_endpoints(), out, settings.straggler)
        report = read_report(backend, args.snapshot_dir, settings.straggler)
    except Exception as exc:  # an operator command: one line, no traceback
        print(f"elastic-ext {args.command}: {exc}", file=sys.stderr)
        return 2
    if args.json:
        out.write(json.dumps(report, indent=2) + "\n")
    else:
        out.write(render(report, args.run_id, settings.describe_endpoints()))
    return 0


def watch(backend: StoreBackend, args: argparse.Namespace, where: str, out: TextIO,
          straggler: StragglerRules | None = None) -> int:
    """Refresh every ``args.interval`` seconds until interrupted (or ``args.count`` times).

    A refresh that cannot reach the store says so and the watch goes on: the store may
    come back, and an operator watching through an outage wants to see that it did.
    """
    recent: list[tuple[float, str]] = []
    in_place = out.isatty() and not args.json
    refreshes = 0
    try:
        while True:
            try:
                report = read_report(backend, args.snapshot_dir, straggler)
            except Exception as exc:
                report = {"exists": None, "error": str(exc)}
            report["time"] = round(time.time(), 3)
            note = report.get("last_event")
            if note and (not recent or recent[-1][1] != note):
                recent = [*recent, (report["time"], note)][-RECENT_EVENTS:]
            report["recent_events"] = [{"time": t, "event": n} for t, n in recent]
            if args.json:
                out.write(json.dumps(report) + "\n")
            else:
                text = render(report, args.run_id, where)
                out.write(CLEAR_SCREEN + text if in_place else text + "\n")
            out.flush()
            refreshes += 1
            if args.count is not None and refreshes >= args.count:
                return 0
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return 0


def _list(endpoint: str, conf: Mapping[str, str], as_json: bool, out: TextIO) -> int:
    _, backend = connect(endpoint, LIST_RUN_ID, conf)
    runs = backend.list_runs()
    out.write(json.dumps(runs) + "\n" if as_json else "".join(f"{r}\n" for r in runs))
    return 0
