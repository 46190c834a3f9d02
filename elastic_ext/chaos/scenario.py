"""The scenario format: a few settings and an ordered list of faults, one per line.

Plain text so a scenario fits in a ticket, a shell heredoc or a test, and parses with
the standard library alone::

    # kill a node, let a new one join, then preempt everything and start again
    nodes = 3
    nnodes = 2:3
    steps = 160

    at step 30: kill node other
    when recovered: start node
    at step 100: preempt all
    when stopped: start all

Settings are ``key = value`` lines (see :data:`SETTINGS`). A fault is
``TRIGGER: ACTION``; faults fire one after the other, each trigger counted from the
moment the previous fault fired. Triggers:

- ``at step N``: a step >= N is logged;
- ``after D``: D (``20s``, ``1.5s``) has passed;
- ``when world N``: a step is logged at world size N;
- ``when recovered``: a step is logged by a round that started after the previous fault;
- ``when stopped``: every node has exited.

Actions (``TARGET`` is a node index in start order, ``rank0``, ``other`` — a live node
that neither hosts rank 0 nor the embedded store — or ``all``):

- ``kill worker TARGET``: SIGKILL one worker process of the node, not its agent;
- ``kill node TARGET``: SIGKILL the agent and all its workers;
- ``freeze node TARGET for D``: SIGSTOP the node, SIGCONT after D;
- ``slow node TARGET [to F] [every P] [for D]``: a straggler: the node's workers (not its
  agent) run a fraction F of every period P and are stopped for the rest (SIGSTOP and
  SIGCONT from a thread of the harness), so their compute takes about 1/F as long; F is
  ``1/3`` (the default), ``0.25`` or ``40%``, P ``30ms`` (the default) or ``0.05s``, best
  short against a step's compute. Without ``for``, it lasts until the scenario ends;
- ``partition node TARGET for D``: take the node's network link down, up after D
  (the nodes then run in network namespaces);
- ``cut peers of node TARGET for D``: the node still reaches the store but neither
  reaches the other nodes nor answers them, for D (network namespaces too);
- ``drop node TARGET for D``: everything the node sends is dropped without a word, the
  store included, for D: its link stays up, others' connects to it time out (network
  namespaces too);
- ``preempt all``: SIGUSR2 to every worker and etcd-ext agent, as SLURM's
  ``--signal=USR2@N`` does; ``preempt agents``: to the agents alone (a notice that
  comes between rounds, or that only torchrun gets);
- ``notice node TARGET``: SIGUSR2 to one node's agent and workers (one node's own SLURM
  job preempted, a spot machine reclaimed): that node leaves, the others train on;
  ``notice all over D``: the same to every node, one after the other over D;
- ``terminate node TARGET``: SIGTERM to one node's agent alone (a Kubernetes pod deleted);
- ``start node`` / ``start N nodes`` / ``start all``: start 1 / N new nodes / as many as ``nodes``;
- ``kill etcd leader|follower|all [for D]``: SIGKILL etcd member(s); with ``for``,
  start them again on the same data directory after D;
- ``fill disk [for D]``: fill the snapshot directory (a small tmpfs) to ENOSPC; free
  it after D.

The parser is pure: it validates everything it can before any process starts, and
every error names the line.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

__all__ = ["SETTINGS", "Action", "Fault", "Scenario", "ScenarioError", "ScenarioSettings",
           "Trigger", "parse"]


NETNS_VERBS = ("partition", "cut-peers", "drop")
"""Actions that need every node in a network namespace of its own."""


class ScenarioError(ValueError):
    """The scenario text is malformed or asks for something the settings cannot give."""


# ------------------------------------------------------------------------------ settings
@dataclass(frozen=True)
class ScenarioSettings:
    """The job a scenario runs: nodes, store, and the trainer's knobs. Not named ``Settings``:
    that is the rendezvous' parsed ``--rdzv-conf`` (``elastic_ext.rendezvous.settings``)."""

    nodes: int = 3
    nnodes: str = "2:3"
    nproc_per_node: int = 1
    store: str = "etcd"
    etcd_members: int = 1
    steps: int = 120
    snapshot_every: int = 10
    step_delay: float = 0.05
    global_batch_size: int = 12
    seed: int = 3
    model_size: str = "tiny"
    max_restarts: int = 3
    rdzv_conf: str = ""
    timeout: float = 300.0
    disk_size: str = "4m"
    network: str = "auto"  # auto: loopback, or namespaces when the scenario partitions

    @property
    def min_nodes(self) -> int:
        return int(self.nnodes.split(":")[0])

    @property
    def max_nodes(self) -> int:
        return int(self.nnodes.split(":")[-1])


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError("must be at least 1")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError("must be >= 0")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise ValueError("must be >= 0")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError("must be > 0")
    return value


def _nnodes(text: str) -> str:
    parts = text.split(":")
    if len(parts) not in (1, 2) or not all(p.isdigit() for p in parts):
        raise ValueError("must be N or MIN:MAX")
    low, high = int(parts[0]), int(parts[-1])
    if not 1 <= low <= high:
        raise ValueError("needs 1 <= MIN <= MAX")
    return f"{low}:{high}"


def _choice(*options: str) -> Callable[[str], str]:
    def check(text: str) -> str:
        if text not in options:
            raise ValueError(f"must be one of {', '.join(options)}")
        return text
    return check


def _size(text: str) -> str:
    if not re.fullmatch(r"\d+[kmg]?", text.lower()):
        raise ValueError("must be a tmpfs size such as 4m or 512k")
    return text.lower()


SETTINGS: dict[str, tuple[str, Callable[[str], Any], str]] = {
    # scenario key: (ScenarioSettings field, parser, help)
    "nodes": ("nodes", _positive_int, "nodes started at the beginning"),
    "nnodes": ("nnodes", _nnodes, "torchrun's --nnodes MIN:MAX"),
    "nproc-per-node": ("nproc_per_node", _positive_int, "workers per node"),
    "store": ("store", _choice("etcd", "embedded"), "etcd, or the embedded c10d store"),
    "etcd-members": ("etcd_members", _choice("1", "3"), "etcd cluster size (1 or 3)"),
    "steps": ("steps", _positive_int, "the trainer's --steps"),
    "snapshot-every": ("snapshot_every", _non_negative_int, "the trainer's --snapshot-every"),
    "step-delay": ("step_delay", _non_negative_float, "the trainer's --step-delay (seconds)"),
    "global-batch-size": ("global_batch_size", _positive_int, "the trainer's --global-batch-size"),
    "seed": ("seed", _non_negative_int, "the trainer's --seed"),
    "model-size": ("model_size", _choice("tiny", "small", "100mb"), "the trainer's --model-size"),
    "max-restarts": ("max_restarts", _non_negative_int, "torchrun's --max-restarts (job-wide)"),
    "rdzv-conf": ("rdzv_conf", str, "torchrun's --rdzv-conf"),
    "timeout": ("timeout", _positive_float, "seconds the whole scenario may take"),
    "disk-size": ("disk_size", _size, "tmpfs size of the snapshot directory for 'fill disk'"),
    "network": ("network", _choice("auto", "loopback", "netns"), "where the nodes' addresses live"),
}


def apply_setting(settings: ScenarioSettings, key: str, value: str) -> ScenarioSettings:
    """``settings`` with ``key`` (a scenario key) set from its text; ValueError names the key."""
    if key not in SETTINGS:
        raise ScenarioError(f"unknown setting {key!r}; known: {', '.join(SETTINGS)}")
    name, parse_value, _ = SETTINGS[key]
    try:
        parsed = parse_value(value)
    except ValueError as exc:
        raise ScenarioError(f"{key} = {value!r}: {exc}") from None
    if name == "etcd_members":
        parsed = int(parsed)
    return replace(settings, **{name: parsed})


# ------------------------------------------------------------------------------- faults
@dataclass(frozen=True)
class Trigger:
    """When a fault fires, counted from the moment the previous one fired."""

    kind: str  # "step" | "after" | "world" | "recovered" | "stopped"
    value: float = 0.0

    def describe(self) -> str:
        return {"step": f"at step {int(self.value)}", "after": f"after {self.value:g}s",
                "world": f"when world {int(self.value)}", "recovered": "when recovered",
                "stopped": "when stopped"}[self.kind]


@dataclass(frozen=True)
class Action:
    """What a fault does. ``target`` is a node selector or an etcd role; ``duration`` undoes it."""

    # kill-worker kill-node freeze partition cut-peers preempt notice terminate start-node
    # start-all kill-etcd fill-disk slow
    verb: str
    target: str = ""
    count: int = 1
    duration: float | None = None
    fraction: float | None = None  # slow: the share of each period the workers run
    period: float | None = None  # slow: seconds of one stop-and-run cycle

    @property
    def crash(self) -> bool:
        """Whether the job may lose the steps since its last snapshot because of this fault."""
        return self.verb in ("kill-worker", "kill-node", "freeze", "partition", "cut-peers",
                             "drop")

    def describe(self) -> str:
        words = {
            "kill-worker": f"kill worker {self.target}", "kill-node": f"kill node {self.target}",
            "freeze": f"freeze node {self.target}", "partition": f"partition node {self.target}",
            "cut-peers": f"cut peers of node {self.target}", "drop": f"drop node {self.target}",
            "preempt": f"preempt {self.target}",
            "notice": f"notice node {self.target}" if self.target != "all"
            else f"notice all over {self.duration or 0:g}s",
            "terminate": f"terminate node {self.target}",
            "start-node": "start node" if self.count == 1 else f"start {self.count} nodes",
            "start-all": "start all", "kill-etcd": f"kill etcd {self.target}",
            "fill-disk": "fill disk",
            "slow": f"slow node {self.target} to {_fraction_text(self.fraction or 0.0)} "
                    f"every {(self.period or 0.0) * 1000:g}ms",
        }[self.verb]
        spread = self.verb == "notice"  # its duration spreads the notices, undoes nothing
        return words + (f" for {self.duration:g}s" if self.duration is not None and not spread
                        else "")


def _fraction_text(fraction: float) -> str:
    """``1/3`` for a third, else the number (``0.4``)."""
    if fraction > 0 and abs(1 / fraction - round(1 / fraction)) < 1e-6:
        return f"1/{round(1 / fraction)}"
    return f"{fraction:g}"


@dataclass(frozen=True)
class Fault:
    trigger: Trigger
    action: Action
    line: int  # 1-based line number in the scenario text

    def describe(self) -> str:
        return f"{self.trigger.describe()}: {self.action.describe()}"


@dataclass(frozen=True)
class Scenario:
    name: str
    settings: ScenarioSettings
    faults: tuple[Fault, ...]
    text: str = field(default="", compare=False)

    @property
    def network(self) -> str:
        """``netns`` when a partition needs the nodes in their own namespaces, else as set."""
        if self.settings.network != "auto":
            return self.settings.network
        return "netns" if any(f.action.verb in NETNS_VERBS for f in self.faults) else "loopback"

    @property
    def needs_tmpfs(self) -> bool:
        return any(f.action.verb == "fill-disk" for f in self.faults)

    def with_settings(self, overrides: Mapping[str, str]) -> Scenario:
        """The same faults with some settings replaced (``--set key=value``), re-validated."""
        settings = self.settings
        for key, value in overrides.items():
            settings = apply_setting(settings, key, value)
        _validate(settings, self.faults)
        return replace(self, settings=settings)


_DURATION = r"(\d+(?:\.\d+)?)s"
_NODE_TARGET = r"(\d+|rank0|other|all)"
_TRIGGERS: list[tuple[re.Pattern[str], Callable[[re.Match[str]], Trigger]]] = [
    (re.compile(r"at step (\d+)"), lambda m: Trigger("step", int(m.group(1)))),
    (re.compile(rf"after {_DURATION}"), lambda m: Trigger("after", float(m.group(1)))),
    (re.compile(r"when world (\d+)"), lambda m: Trigger("world", int(m.group(1)))),
    (re.compile(r"when recovered"), lambda m: Trigger("recovered")),
    (re.compile(r"when stopped"), lambda m: Trigger("stopped")),
]
_FOR = rf"(?: for {_DURATION})?"
_FRACTION = r"(\d+/\d+|\d*\.\d+|\d+(?:\.\d+)?%)"
_PERIOD = r"(\d+(?:\.\d+)?)(ms|s)"
SLOW_FRACTION = 1 / 3
"""``slow node``'s default run fraction: the node's compute about 3x as long."""
SLOW_PERIOD_S = 0.03
"""``slow node``'s default period: short against a step's compute, long against the
scheduler's tick and a signal's delivery."""
SLOW_MIN_PERIOD_S = 0.005
_ACTIONS: list[tuple[re.Pattern[str], Callable[[re.Match[str]], Action]]] = [
    (re.compile(rf"kill worker {_NODE_TARGET}"), lambda m: Action("kill-worker", m.group(1))),
    (re.compile(rf"kill node {_NODE_TARGET}"), lambda m: Action("kill-node", m.group(1))),
    (re.compile(rf"freeze node {_NODE_TARGET} for {_DURATION}"),
     lambda m: Action("freeze", m.group(1), duration=float(m.group(2)))),
    (re.compile(rf"slow node {_NODE_TARGET}(?: to {_FRACTION})?(?: every {_PERIOD})?{_FOR}"),
     lambda m: Action("slow", m.group(1), fraction=_run_fraction(m.group(2)),
                      period=_period(m.group(3), m.group(4)),
                      duration=_opt_float(m.group(5)))),
    (re.compile(rf"partition node {_NODE_TARGET} for {_DURATION}"),
     lambda m: Action("partition", m.group(1), duration=float(m.group(2)))),
    (re.compile(rf"cut peers of node {_NODE_TARGET} for {_DURATION}"),
     lambda m: Action("cut-peers", m.group(1), duration=float(m.group(2)))),
    (re.compile(rf"drop node {_NODE_TARGET} for {_DURATION}"),
     lambda m: Action("drop", m.group(1), duration=float(m.group(2)))),
    (re.compile(r"preempt (all|agents)"), lambda m: Action("preempt", m.group(1))),
    (re.compile(r"notice node (\d+|rank0|other)"), lambda m: Action("notice", m.group(1))),
    (re.compile(rf"notice all over {_DURATION}"),
     lambda m: Action("notice", "all", duration=float(m.group(1)))),
    (re.compile(r"terminate node (\d+|rank0|other)"),
     lambda m: Action("terminate", m.group(1))),
    (re.compile(r"start node"), lambda m: Action("start-node")),
    (re.compile(r"start (\d+) nodes?"),
     lambda m: Action("start-node", count=_positive_int(m.group(1)))),
    (re.compile(r"start all"), lambda m: Action("start-all")),
    (re.compile(rf"kill etcd (leader|follower|all){_FOR}"),
     lambda m: Action("kill-etcd", m.group(1), duration=_opt_float(m.group(2)))),
    (re.compile(rf"fill disk{_FOR}"),
     lambda m: Action("fill-disk", duration=_opt_float(m.group(1)))),
]


def _opt_float(text: str | None) -> float | None:
    return None if text is None else float(text)


def _run_fraction(text: str | None) -> float:
    """``1/3``, ``0.25`` or ``40%``: the share of the time a slowed node's workers run."""
    if text is None:
        return SLOW_FRACTION
    if "/" in text:
        top, bottom = (int(part) for part in text.split("/"))
        if bottom == 0:
            raise ValueError("a fraction's denominator must not be 0")
        value = top / bottom
    else:
        value = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    if not 0 < value < 1:
        raise ValueError(f"the run fraction {text} must be between 0 and 1 (exclusive)")
    return value


def _period(number: str | None, unit: str | None) -> float:
    if number is None:
        return SLOW_PERIOD_S
    value = float(number) / (1000 if unit == "ms" else 1)
    if value < SLOW_MIN_PERIOD_S:
        raise ValueError(f"a period under {SLOW_MIN_PERIOD_S * 1000:g}ms is too short for "
                         "the signals to keep")
    return value


def _match(table: list[tuple[re.Pattern[str], Callable[[re.Match[str]], Any]]], text: str) -> Any:
    for pattern, build in table:
        match = pattern.fullmatch(text)
        if match:
            return build(match)
    return None


def parse(text: str, name: str = "scenario") -> Scenario:
    """Parse a scenario; :class:`ScenarioError` names the first bad line and says why."""
    settings = ScenarioSettings()
    faults: list[Fault] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = " ".join(raw.split("#", 1)[0].split())
        if not line:
            continue
        try:
            if "=" in line and ":" not in line.split("=", 1)[0]:
                key, value = (part.strip() for part in line.split("=", 1))
                if faults:
                    raise ScenarioError("settings must come before the first fault")
                settings = apply_setting(settings, key.lower(), value)
                continue
            line = line.lower()
            if ":" not in line:
                raise ScenarioError("expected 'key = value' or 'TRIGGER: ACTION'")
            when, what = (part.strip() for part in line.split(":", 1))
            trigger = _match(_TRIGGERS, when)
            if trigger is None:
                raise ScenarioError(f"unknown trigger {when!r} (at step N, after Ds, when world N, "
                                    "when recovered, when stopped)")
            action = _match(_ACTIONS, what)
            if action is None:
                raise ScenarioError(f"unknown action {what!r} (kill worker|node T, "
                                    "freeze|partition node T for Ds, "
                                    "slow node T [to F] [every Pms] [for Ds], "
                                    "cut peers of node T for Ds, drop node T for Ds, "
                                    "preempt all|agents, "
                                    "notice node T, notice all over Ds, terminate node T, "
                                    "start node, "
                                    "start N nodes, start all, "
                                    "kill etcd leader|follower|all [for Ds], fill disk [for Ds])")
            faults.append(Fault(trigger, action, number))
        except ValueError as exc:  # ScenarioError, or a number out of range
            raise ScenarioError(f"{name} line {number}: {raw.strip()!r}: {exc}") from None
    _validate(settings, faults, name)
    return Scenario(name, settings, tuple(faults), text)


def _validate(settings: ScenarioSettings, faults: tuple[Fault, ...] | list[Fault],
              name: str = "scenario") -> None:
    """What a line cannot tell alone: an action the chosen store or node range cannot give."""
    def fail(fault: Fault | None, message: str) -> None:
        where = f"{name} line {fault.line}: " if fault is not None else f"{name}: "
        raise ScenarioError(where + message)

    if settings.nodes > settings.max_nodes:
        fail(None, f"nodes = {settings.nodes} is more than nnodes MAX ({settings.nnodes})")
    if settings.global_batch_size < settings.max_nodes * settings.nproc_per_node:
        fail(None, "global-batch-size is smaller than the largest world size")
    uses_netns = settings.network == "netns" or any(f.action.verb in NETNS_VERBS for f in faults)
    if uses_netns and settings.network == "loopback":
        fail(None, "a partition needs network = netns (or auto)")
    if uses_netns and settings.store != "etcd":
        fail(None, "network namespaces need store = etcd")
    for fault in faults:
        action = fault.action
        if action.verb == "kill-etcd":
            if settings.store != "etcd":
                fail(fault, "kill etcd needs store = etcd")
            if action.target == "follower" and settings.etcd_members < 3:
                fail(fault, "kill etcd follower needs etcd-members = 3")
        if action.verb in ("freeze", "partition", "cut-peers", "drop", "slow") \
                and action.target == "all":
            fail(fault, f"{action.verb} needs one node, not all")
        if action.verb == "kill-worker" and action.target == "all":
            fail(fault, "kill worker needs one node, not all")
        if action.duration is not None and action.duration <= 0:
            fail(fault, "a duration must be more than 0s")


def settings_help() -> list[tuple[str, str, str]]:
    """``(key, default, help)`` for every setting, for the CLI's ``--help-format``."""
    defaults = {f.name: f.default for f in fields(ScenarioSettings)}
    return [(key, str(defaults[name]), text) for key, (name, _, text) in SETTINGS.items()]
