"""Preemption notices to some nodes: those nodes leave and the others train on, or, when
that would leave fewer than ``--nnodes`` MIN, the whole job stops with a durable snapshot.

A notice (SLURM's ``--signal=USR2@N`` to one node's job, a spot reclaim, a drained
Kubernetes node) reaches a node's agent, or its workers, which pass it to the agent
(``control.report_notice``). The agent records it in the run's state (``notices``) and,
``NOTICE_SETTLE_S`` later, settles every notice recorded by then in one compare-and-swap:

- the nodes left without a notice still make MIN: the noticed ones go to ``leaving``.
  Every agent of the round restarts its workers for a membership change (the step is
  kept in node memory, nothing is trained twice), the new round forms without them, and
  their agents end with status 0;
- otherwise ``stop`` says why: every agent tells its workers, which stop at the next step
  boundary with a durable snapshot and exit 0, as after SLURM's whole-job signal, so the
  requeued job resumes at that step.

The settling wait gathers the notices of a whole-job signal, which reach every node
within milliseconds, into one stop instead of a leave followed by a stop. Pure: the
keeper does the I/O (``keeper.py``).
"""

from __future__ import annotations

from collections.abc import Set
from dataclasses import replace

from elastic_ext.rendezvous.protocol.policy import Limits
from elastic_ext.rendezvous.protocol.state import Phase, RunState

NOTICE_SETTLE_S = 0.3
"""How long a notice waits for notices to other nodes before it is settled."""

_KEPT = 64  # nodes remembered in ``leaving``, as for ``excluded``


def with_notice(state: RunState, node: str, why: str) -> RunState | None:
    """``state`` with ``node``'s notice recorded; None when there is nothing to record (the
    job already stops, the node already leaves, or its notice is recorded)."""
    if state.stop or node in state.leaving or node in state.notices:
        return None
    return replace(state, notices={**state.notices, node: why[:200]},
                   note=f"preemption notice to {node}: {why[:200]}")


def settled(state: RunState, dead: Set[str], limits: Limits) -> RunState | None:
    """``state`` with its pending notices settled (see the module's docstring); None when
    none is pending. ``dead``: nodes this agent judges dead, which do not count as staying."""
    if not state.notices:
        return None
    if state.stop:
        return replace(state, notices={})
    noticed = sorted(state.notices)
    # An open round's job: who joined it so far and who ran the last round (they rejoin).
    job = set(state.order) if state.phase is Phase.CLOSED \
        else set(state.members) | set(state.previous)
    staying = job - set(noticed) - set(state.leaving) - set(dead)
    names = ", ".join(noticed)
    if len(staying) >= limits.min_nodes:
        leaving = {**state.leaving, **state.notices}
        return replace(state, notices={}, leaving=dict(list(leaving.items())[-_KEPT:]),
                       note=f"{names} leave(s) on a preemption notice; {len(staying)} "
                            "node(s) train on")
    why = (f"preemption notice to {names}: the {len(staying)} node(s) left would be fewer "
           f"than --nnodes MIN={limits.min_nodes}; the whole job stops with a durable "
           "snapshot")
    return replace(state, notices={}, stop=why, note=why)


def with_left_out(state: RunState, node: str, why: str, limits: Limits) -> RunState | None:
    """``state`` with ``node``, a member of its closed round, leaving as on a settled notice
    (``straggler.py``: a straggler dropped); None when the job stops, the node is not in the
    round or already leaves, or the others would be fewer than ``--nnodes`` MIN."""
    if state.stop or state.phase is not Phase.CLOSED or node not in state.order \
            or node in state.leaving or node in state.notices:
        return None
    staying = set(state.order) - set(state.leaving) - {node}
    if len(staying) < limits.min_nodes:
        return None
    leaving = {**state.leaving, node: why[:200]}
    return replace(state, leaving=dict(list(leaving.items())[-_KEPT:]),
                   note=f"{node} is left out: {why[:200]}")
