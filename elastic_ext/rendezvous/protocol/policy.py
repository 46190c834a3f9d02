"""The rendezvous' policy: what an agent does with the run's state, decided purely.

Every agent runs the same ``decide`` over (the state, its own ``View``) and writes the
result; the store's compare-and-swap arbitrates between agents. Also here: how a round
closes and what it charges to the job's restart budget, who is left out for being
unreachable, and the keeper's ``restart_pressure``. Nothing here does I/O or reads a
clock, so every rule is tested without a store (``tests/test_state.py``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from elastic_ext.rendezvous.protocol.head import Head
from elastic_ext.rendezvous.protocol.reach import cut_off_in_ring
from elastic_ext.rendezvous.protocol.state import NodeInfo, Phase, Reason, RunState, Status

if TYPE_CHECKING:  # the settings are only read here, never parsed
    from elastic_ext.rendezvous.settings import Settings


@dataclass(frozen=True)
class Limits:
    """The job's bounds, the same on every agent: ``--nnodes``, the last call, the budget."""

    min_nodes: int
    max_nodes: int
    last_call: float
    max_restarts: int | None
    stalled_rounds: int = 5  # free restarts in a row without a training step, then charged

    @classmethod
    def of(cls, settings: Settings) -> Limits:
        """The bounds ``settings`` set: the one place they are derived, so that the keeper
        and every rendezvous of a node decide on the same."""
        return cls(settings.min_nodes, settings.max_nodes, settings.timeouts.last_call,
                   settings.max_restarts)


@dataclass(frozen=True)
class View:
    """What one agent knows beyond the state itself."""

    me: str
    my_info: NodeInfo
    dead: frozenset[str]  # nodes this agent judges dead or gone
    completed: tuple[str, int] | None  # (generation, round) this agent last ran in
    min_reached_for: float | None  # seconds since it saw the open round reach MIN nodes
    reenter_reason: Reason  # why it is back in the rendezvous after ``completed``
    fresh_generation: str  # the id to use if it must start a new generation
    unreachable: frozenset[str] = frozenset()  # nodes it could not reach (``probes.py``)


@dataclass(frozen=True)
class Wait:
    """Nothing to do now: poll the state again."""


@dataclass(frozen=True)
class Write:
    """Compare-and-swap ``state`` into the store, then decide again."""

    state: RunState


@dataclass(frozen=True)
class Joined:
    """This node is a member of the closed round ``state``."""

    state: RunState


@dataclass(frozen=True)
class BudgetSpent:
    """The job-wide restart budget is spent; ``state.note`` says how."""

    state: RunState


@dataclass(frozen=True)
class Closed:
    """The run was closed for good (``set_closed``)."""


@dataclass(frozen=True)
class Finished:
    """The job this node belongs to finished (its other nodes' workers completed)."""

    state: RunState


@dataclass(frozen=True)
class Left:
    """This node leaves the job on a preemption notice (``state.leaving``); the others
    train on without it (``drain.py``)."""

    state: RunState


@dataclass(frozen=True)
class Excluded:
    """The other nodes cannot reach this one; it was left out of the job (``state.excluded``)."""

    state: RunState


Decision = Wait | Write | Joined | BudgetSpent | Closed | Finished | Left | Excluded


def fresh_state(view: View, round_: int, limits: Limits) -> RunState:
    """A new generation opened by ``view.me`` at ``round_``, with a fresh restart budget:
    a new job, or a requeued one whose old agents are all gone."""
    return RunState(generation=view.fresh_generation, round=round_, phase=Phase.OPEN,
                    members={view.me: view.my_info}, opened_because=Reason.START,
                    max_restarts=limits.max_restarts, progress_round=round_ - 1,
                    note=f"generation started by {view.me}")


def _without(nodes: Mapping[str, NodeInfo], drop: Iterable[str]) -> dict[str, NodeInfo]:
    dropped = set(drop)
    return {k: v for k, v in nodes.items() if k not in dropped}


def _is_stranger(state: RunState, view: View) -> bool:
    return view.completed is None or view.completed[0] != state.generation


def decide(state: RunState | None, view: View, limits: Limits) -> Decision:
    """One step of the rendezvous for ``view.me``. Pure: no I/O, no clocks."""
    if state is None:
        return Write(fresh_state(view, 1, limits))
    if state.status is Status.CLOSED:
        return Closed()
    # Who ran in this generation; nodes only waiting to join (other new agents of a
    # requeued job, say) never did, so they cannot keep it alive.
    participants = (set(state.members) | set(state.previous) | set(state.order)) - {view.me}
    stranger = _is_stranger(state, view) and view.me not in state.members
    if stranger and participants <= view.dead:
        # Nobody of the old generation is alive: a new job (or a requeued one) starts over,
        # with a fresh restart budget.
        return Write(fresh_state(view, state.round + 1, limits))
    if stranger and state.status is Status.BUDGET_SPENT:
        return Wait()  # the old job's agents are leaving: start over once they are gone
    if state.status is Status.FINISHED:
        if _is_stranger(state, view) and view.me not in state.known_nodes():
            return Write(fresh_state(view, state.round + 1, limits))  # the same id, a new job
        return Finished(state)
    if state.status is Status.BUDGET_SPENT:
        return BudgetSpent(state)
    if view.me in state.leaving:
        return Left(state)
    if view.me in state.excluded:
        return Excluded(state)
    if state.phase is Phase.CLOSED:
        return _decide_closed(state, view)
    return _decide_open(state, view, limits)


def _decide_closed(state: RunState, view: View) -> Decision:
    if view.me in state.members:
        if view.completed != (state.generation, state.round):
            return Joined(state)
        return Write(open_next_round(state, view, view.reenter_reason))
    if view.me not in state.waiting:
        waiting = {**state.waiting, view.me: view.my_info}
        return Write(replace(state, waiting=waiting, note=f"{view.me} waits to join"))
    if set(state.order) <= view.dead:
        return Write(open_next_round(state, view, Reason.MEMBERSHIP))
    return Wait()


def open_next_round(state: RunState, view: View, reason: Reason) -> RunState:
    """The round after ``state``'s, opened by ``view.me`` (its closer) for ``reason``, which
    decides whether closing it is charged."""
    return replace(state, round=state.round + 1, phase=Phase.OPEN,
                   members={view.me: view.my_info}, order=(), previous=state.order,
                   waiting=_without(state.waiting, [view.me]), opened_because=reason,
                   unreachable=_reports(view),
                   note=f"round {state.round + 1} opened by {view.me} ({reason.value})")


def _reports(view: View, state: RunState | None = None) -> dict[str, tuple[str, ...]]:
    """The open round's reports of unreachable nodes with ``view.me``'s added."""
    reports = dict(state.unreachable) if state is not None else {}
    if view.unreachable:
        reports[view.me] = tuple(sorted(view.unreachable))
    return reports


def _decide_open(state: RunState, view: View, limits: Limits) -> Decision:
    dead_members = (set(state.members) & view.dead) - {view.me}
    if dead_members:  # a death is free: the round is a membership change from here on,
        # even if the node comes back before it closes (a frozen node that wakes up)
        return Write(replace(
            state, members=_without(state.members, dead_members),
            opened_because=Reason.MEMBERSHIP,
            note=f"dropped dead {sorted(dead_members)} from round {state.round}"))
    leaving_members = set(state.members) & set(state.leaving)
    if leaving_members:
        return Write(replace(
            state, members=_without(state.members, leaving_members),
            note=f"dropped leaving {sorted(leaving_members)} from round {state.round}"))
    if view.me not in state.members:
        if len(state.members) < limits.max_nodes:
            return Write(replace(
                state, members={**state.members, view.me: view.my_info},
                waiting=_without(state.waiting, [view.me]),
                unreachable=_reports(view, state)))
        if view.me not in state.waiting:
            return Write(replace(state, waiting={**state.waiting, view.me: view.my_info}))
        return Wait()
    # Only nodes that still beat: a dead one is dropped anyway, and may come back.
    cut_off = {n: by for n, by in unreachable_by_most(state).items() if n not in view.dead}
    if cut_off and set(state.members) - set(cut_off):
        return Write(exclude(state, cut_off))
    if should_close(state, view, limits):
        return Write(close_round(state, view, limits))
    return Wait()


def should_close(state: RunState, view: View, limits: Limits) -> bool:
    """Whether the open round, once it has MIN nodes, closes now: it is full, its last call
    is over, or (a restart, not a start) everyone it waits for is in."""
    joined = len(state.members)
    if joined < limits.min_nodes:
        return False
    if joined >= limits.max_nodes:
        return True
    if view.min_reached_for is not None and view.min_reached_for >= limits.last_call:
        return True
    if state.opened_because is Reason.START:
        return False  # a fresh job gives late starters the whole last call
    expected = (set(state.previous) | set(state.waiting)) - view.dead - set(state.members) \
        - set(state.excluded) - set(state.leaving)
    return not expected


def unreachable_by_most(state: RunState) -> dict[str, list[str]]:
    """Nodes of the job that most of the open round's other members could not reach, or
    most of their ring probers in the last round (``reach.py``: each node probes only a
    few), with who reported them (a node whose workers hang at start may not have
    rejoined yet). Two reporters at least: with two nodes nobody can tell which side is
    cut off, and those rounds are bounded by ``Limits.stalled_rounds`` instead."""
    out: dict[str, list[str]] = {}
    for node in sorted(state.known_nodes() - set(state.excluded)):
        others = [n for n in state.members if n != node]
        reporters = sorted(n for n in others if node in state.unreachable.get(n, ()))
        if len(reporters) >= 2 and 2 * len(reporters) > len(others):
            out[node] = reporters
    ring = cut_off_in_ring(state.previous, list(state.members), state.unreachable,
                           skip=tuple(state.excluded))
    for node, reporters in ring.items():
        out.setdefault(node, reporters)
    return dict(sorted(out.items()))


def stalled_rounds(state: RunState) -> int:
    """Rounds in a row, up to the one ``state`` opens, that ended before a training step."""
    return max(0, state.round - 1 - state.progress_round)


def exclude(state: RunState, cut_off: Mapping[str, list[str]]) -> RunState:
    """The open round without the members its others cannot reach, who are told why."""
    excluded = {**state.excluded, **{node: f"not reachable from {', '.join(by)}, though the "
                                           f"store was{_at(state, node)}"
                                     for node, by in cut_off.items()}}
    return replace(state, members=_without(state.members, cut_off),
                   waiting=_without(state.waiting, cut_off),
                   excluded=dict(list(excluded.items())[-64:]),
                   unreachable={k: v for k, v in state.unreachable.items() if k not in cut_off},
                   note=f"left {', '.join(sorted(cut_off))} out of round {state.round}: "
                        + "; ".join(f"{n} {excluded[n]}" for n in sorted(cut_off)))


def _at(state: RunState, node: str) -> str:
    """Where the others tried to reach ``node``: the address it published for its workers."""
    info = state.members.get(node) or state.waiting.get(node)
    if info is None:
        return ""
    port = f", presence port {info.presence}" if info.presence is not None else ""
    return f" (they tried its workers' address {info.addr}{port})"


def _unreachable_text(state: RunState) -> str:
    if not state.unreachable:
        return ""
    return "; unreachable: " + ", ".join(f"{k} could not reach {', '.join(v)}"
                                          for k, v in sorted(state.unreachable.items()))


def close_round(state: RunState, view: View, limits: Limits | None = None) -> RunState:
    """The open round closed with its members, the last round's ranks kept; a restart that
    changed nothing (or one round too many without a training step) is charged, and the
    run is marked budget-spent when that charge is over ``max_restarts``."""
    kept = [n for n in state.previous if n in state.members]
    order = tuple(kept + [n for n in state.members if n not in kept])
    unchanged = bool(state.previous) and set(order) == set(state.previous)
    stalled = stalled_rounds(state)
    stall_limit = limits.stalled_rounds if limits is not None else None
    over_stall = stall_limit is not None and bool(state.previous) and stalled > stall_limit
    charge = int((unchanged and state.opened_because is not Reason.MEMBERSHIP) or over_stall)
    restarts = state.restarts + charge
    waiting = _without(state.waiting, set(order) | view.dead | set(state.leaving))
    stall_text = (f"{stalled} rounds in a row ended before a training step "
                  f"(more than {stall_limit} are charged){_unreachable_text(state)}")
    if state.max_restarts is not None and restarts > state.max_restarts:
        spent = f"> --max-restarts={state.max_restarts}"
        note = (f"restart budget spent: {restarts} restarts charged {spent}, the last because "
                f"{stall_text}" if over_stall else
                f"restart budget spent: {restarts} worker-failure restarts {spent}")
        return replace(state, status=Status.BUDGET_SPENT, restarts=restarts, waiting=waiting,
                       note=note)
    if over_stall:
        what = f"{stall_text}, restart {restarts} charged"
    elif charge:
        what = f"worker failure, restart {restarts} charged"
    elif not state.previous:
        what = "start"
    else:
        what = "membership changed"
    return replace(state, phase=Phase.CLOSED, order=order, restarts=restarts, waiting=waiting,
                   note=f"round {state.round} closed with {len(order)} nodes ({what})")


def restart_pressure(state: RunState, me: str, dead: frozenset[str], limits: Limits,
                     my_round: tuple[str, int], fault_reported: bool) -> tuple[int, str, Reason]:
    """``head_pressure`` of a node that read the whole state."""
    lost = frozenset(n for n in dead if n in state.members) \
        if (state.generation, state.round) == my_round and state.phase is Phase.CLOSED \
        else frozenset()
    return head_pressure(Head.of(state), me, dead, lost, limits, my_round, fault_reported)


def head_pressure(head: Head, me: str, dead: frozenset[str], lost: frozenset[str],
                  limits: Limits, my_round: tuple[str, int], fault_reported: bool
                  ) -> tuple[int, str, Reason]:
    """How many reasons a running agent has to restart its workers, the first, and its kind,
    from the state's head and ``lost``, the dead of its round (``my_round``).

    torch's agent polls ``num_nodes_waiting`` while its workers are healthy and
    restarts them without spending a local restart when it is positive.
    """
    generation, round_ = my_round
    if head.generation == generation and (
            head.round < round_ or (head.round == round_ and head.phase is Phase.OPEN)):
        # Read before our round closed (a round never reopens under its number): stale.
        return 0, "", Reason.FAILURE
    if (head.generation, head.round) != my_round or head.phase is Phase.OPEN:
        # A round opened for a membership change says so; anything else may be a failure.
        why = Reason.MEMBERSHIP if head.phase is Phase.OPEN and head.generation == generation \
            and head.opened_because is Reason.MEMBERSHIP else Reason.FAILURE
        return 1, f"round {head.round} ({head.phase.value}) replaced round {my_round[1]}", why
    if head.status is not Status.ACTIVE:
        return 1, f"run is {head.status.value}", Reason.FAILURE
    leaving = sorted(head.leaving_members)
    if leaving:
        return len(leaving), f"leaving the job (a preemption notice, or a straggler left " \
            f"out): {', '.join(leaving)}", Reason.MEMBERSHIP
    gone = sorted(lost - {me})
    if gone:
        return len(gone), f"dead or hung: {', '.join(gone)}", Reason.MEMBERSHIP
    room = limits.max_nodes - head.size
    joiners = [n for n in head.waiting if n not in dead][:max(room, 0)]
    if joiners:
        return len(joiners), f"waiting to join: {', '.join(joiners)}", Reason.MEMBERSHIP
    if fault_reported:
        return 1, "a worker reported a peer fault", Reason.FAILURE
    return 0, "", Reason.FAILURE
