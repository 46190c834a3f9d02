"""--max-restarts is one budget for the whole job, kept in the store.

Worker crashes spend it; membership changes (a node dies, a node joins) do not: that
half runs in ``tests/test_own_loop.py`` and ``tests/test_huggingface.py``, whose jobs
under ``--max-restarts=0`` lose nodes (rank 0's too) and take a new one. A
requeued job (new agents under the same run id, every agent of the old allocation dead)
starts a fresh budget: a new generation with ``restarts`` 0 and its own ``max_restarts``,
whatever the old allocation left in the store (deploy/slurm/README.md, "Requeue").
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from elastic_ext.agent.control import AgentControl
from elastic_ext.local.job import JobSpec, LocalJob
from elastic_ext.rendezvous.agent.events import EventKind
from elastic_ext.rendezvous.agent.handler import EtcdExtRendezvousHandler
from elastic_ext.rendezvous.protocol.policy import (
    BudgetSpent,
    Decision,
    Joined,
    Limits,
    View,
    Write,
    decide,
)
from elastic_ext.rendezvous.protocol.state import NodeInfo, Phase, Reason, RunState, Status
from tests.support.memory_backend import MemoryBackend, MemoryStore
from tests.support.stores import settings_for

LOOP_JOB = str(Path(__file__).parent / "support" / "loop_job.py")


def loop_spec(metrics, *, steps, max_restarts, crash_at=0, nnodes="2:3", store="etcd"):
    return JobSpec(command=[LOOP_JOB, str(metrics), str(steps), "0.05", str(crash_at)],
                   store=store, nnodes=nnodes, run_id="budget", max_restarts=max_restarts)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_spent_budget_stops_every_agent_with_a_message(tmp_path):
    metrics = tmp_path / "m.jsonl"
    spec = loop_spec(metrics, steps=100000, max_restarts=1, crash_at=3, nnodes="3:3")
    with LocalJob(spec, tmp_path).start(3) as job:
        codes = job.wait(timeout=150)
        spent = [n.events(EventKind.BUDGET_SPENT) for n in job.nodes]
        outputs = [n.proc.output() for n in job.nodes]
    assert all(code != 0 for code in codes), codes
    # the crashing node's torch agent gave up locally; the others learned it from the store
    assert sum(bool(events) for events in spent) >= 2, outputs[0][-3000:]
    assert any("--max-restarts=1" in e["note"] for events in spent for e in events), spent


# -- a requeued job starts a fresh budget ---------------------------------------------------
# SLURM's requeue (and any new job under an old run id) brings new agents: the old
# allocation's are all dead by then. Its budget was spent by worker failures over there;
# SLURM bounds the requeues themselves (ELASTIC_EXT_MAX_REQUEUES, `scontrol requeue`).
OLD = Limits(min_nodes=2, max_nodes=2, last_call=1.0, max_restarts=1)  # the old allocation
NEW = Limits(min_nodes=2, max_nodes=2, last_call=1.0, max_restarts=5)  # the requeued job
OLD_NODES = ("a", "b")
KILLED_TRAINING = "killed while training"
SPENT = "budget spent, state kept"  # one agent was killed before it could remove the run
REMOVED = "run removed"  # every agent left cleanly; the last one removed the run's keys


def view(me: str, *, dead: tuple[str, ...] = (), completed: tuple[str, int] | None = None,
         reason: Reason = Reason.FAILURE) -> View:
    return View(me=me, my_info=NodeInfo("10.0.0.1", 1000 + ord(me[-1])), dead=frozenset(dead),
                completed=completed, min_reached_for=None, reenter_reason=reason,
                fresh_generation=f"gen-{me}")


def settle(state: RunState | None, v: View, limits: Limits) -> tuple[RunState | None, Decision]:
    """Apply ``v.me``'s writes (as the store's compare-and-swap would) until it waits or is done."""
    for _ in range(10):
        decision = decide(state, v, limits)
        if not isinstance(decision, Write):
            return state, decision
        state = decision.state
    raise AssertionError(f"{v.me} makes no progress")


def worker_failure(state: RunState | None, nodes: tuple[str, ...], limits: Limits) -> RunState:
    """Every node of the closed round comes back after a worker failed (one restart charged)."""
    assert state is not None
    ran = (state.generation, state.round)
    for node in nodes:
        state, _ = settle(state, view(node, completed=ran), limits)
    assert state is not None
    return state


def old_allocation(left: str) -> RunState | None:
    """What the old allocation (nodes a and b, --max-restarts=1) left in the store: one
    worker failure charged, then ``left``."""
    state, _ = settle(None, view("a"), OLD)
    state, _ = settle(state, view("b"), OLD)
    state = worker_failure(state, OLD_NODES, OLD)
    assert (state.phase, state.restarts, state.status) == (Phase.CLOSED, 1, Status.ACTIVE)
    if left == KILLED_TRAINING:
        return state
    state = worker_failure(state, OLD_NODES, OLD)  # a second failure: over --max-restarts=1
    assert state.status is Status.BUDGET_SPENT and "restart budget spent" in state.note
    return state if left == SPENT else None


@pytest.mark.parametrize("left", [KILLED_TRAINING, SPENT, REMOVED])
def test_a_requeued_job_starts_a_fresh_generation_with_its_own_budget(left: str) -> None:
    old = old_allocation(left)
    # every agent of the requeued job has judged every old one dead (heartbeat_timeout)
    state, _ = settle(old, view("x", dead=OLD_NODES), NEW)
    state, joined_y = settle(state, view("y", dead=OLD_NODES), NEW)
    state, joined_x = settle(state, view("x", dead=OLD_NODES), NEW)
    assert isinstance(joined_x, Joined) and isinstance(joined_y, Joined), (joined_x, joined_y)
    assert state is not None and state.generation == "gen-x"
    assert (state.order, state.restarts, state.max_restarts, state.status) == \
        (("x", "y"), 0, NEW.max_restarts, Status.ACTIVE), state.note
    # a worker failure after the requeue is charged from 0, against the new --max-restarts
    # (the old count and --max-restarts=1 would have stopped the job here)
    state = worker_failure(state, ("x", "y"), NEW)
    assert (state.restarts, state.status) == (1, Status.ACTIVE), state.note


def test_a_node_that_starts_while_an_old_node_still_beats_joins_the_running_job() -> None:
    """Not a requeue: one agent of the old allocation is alive, so the newcomer joins its
    generation, and the budget goes on."""
    old = old_allocation(KILLED_TRAINING)
    assert old is not None
    state, waits = settle(old, view("x", dead=("a",)), NEW)
    assert state is not None and "x" in state.waiting and not isinstance(waits, Joined)
    # the survivor b leaves its round for a's death and takes x in
    state, _ = settle(state, view("b", dead=("a",), completed=(old.generation, old.round),
                                  reason=Reason.MEMBERSHIP), NEW)
    state, joined = settle(state, view("x", dead=("a",)), NEW)
    assert isinstance(joined, Joined) and state is not None
    assert (state.generation, state.order) == (old.generation, ("b", "x"))
    assert (state.restarts, state.max_restarts) == (1, OLD.max_restarts), state.note


@pytest.mark.parametrize("left", [KILLED_TRAINING, SPENT, REMOVED])
def test_requeued_agents_that_arrive_before_the_old_ones_are_judged_dead_start_fresh(
        left: str) -> None:
    """As on a cluster: srun starts every agent of the requeued job within a second or two,
    and an agent judges a silent node dead only after watching it for heartbeat_timeout."""
    state = old_allocation(left)
    decisions: dict[str, Decision] = {}
    for dead in ((), OLD_NODES, OLD_NODES):  # both arrive; heartbeat_timeout passes; again
        for me in ("x", "y"):
            state, decisions[me] = settle(state, view(me, dead=dead), NEW)
            assert state is not None
            assert not isinstance(decisions[me], BudgetSpent), f"{me} stopped: {state.note}"
    assert state is not None
    assert all(isinstance(d, Joined) for d in decisions.values()), (decisions, state.note)
    assert state.generation in ("gen-x", "gen-y"), f"still the old generation: {state.note}"
    assert (state.restarts, state.max_restarts) == (0, NEW.max_restarts), state.note


# The same through the handler, with the in-memory store and simulated time: the agent of
# a requeued job, over what killed agents of the old allocation left.
class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0
        self.on_sleep: list = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        for hook in self.on_sleep:
            hook()


@pytest.fixture
def requeued_agent(tmp_path: Path) -> Iterator:
    """``start(old_state, beating, left)``: the store holds ``old_state`` and a heartbeat
    that never moves for each old node (agents killed), or ``left`` for those that left
    cleanly; ``beating`` peers beat all along. Returns
    the handler of one agent of the requeued job (node x, --nnodes=1:2, --max-restarts=5),
    its keeper ticking as its simulated time passes, and a reader of the run's state."""
    handlers: list[EtcdExtRendezvousHandler] = []

    def start(old: RunState, beating: tuple[str, ...] = (), left: tuple[str, ...] = ()) -> tuple:
        store = MemoryStore()
        peer = MemoryBackend(store)
        assert peer.set_state(old.to_bytes(), None)
        for node in (*old.members, *old.previous):
            peer.beat(node)  # its last beat before the kill
        for node in left:
            peer.leave(node)
        clock = _Clock()
        handler = EtcdExtRendezvousHandler(
            settings_for("127.0.0.1:2379", "run1", (1, 2), max_restarts="5", join_timeout="60"),
            MemoryBackend(store), backend_name="etcd-ext", node_id="x",
            control=AgentControl(tmp_path / f"control-{len(handlers)}"), clock=clock,
            keeper_thread=False)
        handlers.append(handler)

        def tick() -> None:
            for node in beating:
                peer.beat(node)
            handler.keeper.tick()
        clock.on_sleep.append(tick)

        def state() -> RunState:
            current = peer.get_state()
            assert current is not None
            return RunState.from_bytes(current[0])
        return handler, state
    yield start
    for handler in handlers:
        handler.keeper.stop()


def _old_state(**fields) -> RunState:
    nodes = {n: NodeInfo("10.0.0.1", 30000 + i) for i, n in enumerate(OLD_NODES)}
    return replace(RunState(generation="old", round=2, phase=Phase.CLOSED, members=nodes,
                            order=OLD_NODES, previous=OLD_NODES, restarts=1, max_restarts=1,
                            opened_because=Reason.FAILURE), **fields)


def test_a_requeued_agent_is_not_stopped_by_the_spent_budget_killed_agents_left(
        requeued_agent) -> None:
    handler, state = requeued_agent(_old_state(status=Status.BUDGET_SPENT,
                                               note="restart budget spent: 2 worker-failure "
                                                    "restarts > --max-restarts=1"))
    info = handler.next_rendezvous()
    assert info.world_size == 1
    new = state()
    assert new.generation != "old" and (new.restarts, new.max_restarts) == (0, 5), new.note


def test_requeued_agents_arriving_together_start_a_fresh_generation_over_a_killed_job(
        requeued_agent) -> None:
    # y, the requeued job's other agent, got into the old state's waiting list first
    old = _old_state(waiting={"y": NodeInfo("10.0.0.2", 31000)})
    handler, state = requeued_agent(old, beating=("y",))
    handler.next_rendezvous()
    new = state()
    assert new.generation != "old", f"x went on with the old generation: {new.note}"
    assert (new.restarts, new.max_restarts) == (0, 5), new.note


def test_a_requeued_agent_over_agents_that_left_cleanly_starts_fresh_at_once(
        requeued_agent) -> None:
    """The control case of the two above: the old agents left cleanly (their heartbeats say
    so), so the requeued agent takes the fresh budget at once."""
    handler, state = requeued_agent(_old_state(), left=OLD_NODES)
    info = handler.next_rendezvous()
    new = state()
    assert info.world_size == 1 and new.generation != "old", new.note
    assert (new.restarts, new.max_restarts) == (0, 5), new.note
