"""The built-in scenarios: the project's chaos matrix, runnable by name.

Scenarios whose world size never changes run on 2 nodes: there the final parameters
must be bit-identical to an uninterrupted run's (at 3 or more ranks too since the
trainer settles DDP's buckets before its first step: ``--set nodes=3``).

``elastic-ext chaos NAME`` runs one, ``ci`` the fast subset the project's CI runs,
``full`` all of them. Each is also a template: ``elastic-ext chaos --show NAME``
prints it, to copy and edit.
"""

from __future__ import annotations

from elastic_ext.chaos.scenario import Scenario, parse

_COMMON = """\
steps = {steps}
snapshot-every = 10
step-delay = 0.05
rdzv-conf = last_call_timeout=5
"""
"""``last_call_timeout=5``: nodes started together form one round even on a slow machine
(the default 1 s closes a round before a late starter arrives); rounds after a fault still
close at once, since the dead are known and the live rejoin at once."""

SCENARIOS: dict[str, str] = {
    "kill-worker": """\
# One worker process dies (a crash in the training code); its agent is fine.
nodes = 2
{common}
at step 35: kill worker other
""",
    "kill-node": """\
# A whole machine dies: its agent and its workers.
nodes = 3
{common}
at step 35: kill node other
""",
    "kill-rank0": """\
# The machine hosting group rank 0 (and so the workers' store and the metrics writer) dies.
nodes = 3
{common}
at step 35: kill node rank0
""",
    "freeze": """\
# A machine hangs (SIGSTOP) for 15 s, then wakes up and rejoins.
nodes = 3
{common}
at step 35: freeze node other for 15s
""",
    "etcd-follower": """\
# An etcd follower dies and comes back 10 s later.
nodes = 2
etcd-members = 3
{common}
at step 35: kill etcd follower for 10s
""",
    "etcd-leader": """\
# The etcd leader dies; the other two elect a new one; it comes back 5 s later.
nodes = 2
etcd-members = 3
{common}
at step 35: kill etcd leader for 5s
""",
    "etcd-outage": """\
# All of etcd is down for 20 s, then starts again on the same data directory.
nodes = 2
etcd-members = 1
{common}
at step 35: kill etcd all for 20s
""",
    "kill-all": """\
# Every machine dies; the same number start again and resume from the snapshot.
nodes = 2
{common}
at step 35: kill node all
after 1s: start all
""",
    "join": """\
# A third machine arrives while two train: no step may be lost.
nodes = 2
{common}
at step 35: start node
""",
    "preempt": """\
# A preemption signal (SLURM's --signal=USR2) to every worker, then the job starts again.
nodes = 2
{common}
at step 35: preempt all
when stopped: start all
""",
    "notice": """\
# A preemption notice (SIGUSR2) to one node: it leaves, the other two train on.
nodes = 3
{common}
at step 35: notice node other
""",
    "notice-below-min": """\
# A notice to one of two nodes of a 2:3 job: the whole job stops with a durable snapshot
# and starts again.
nodes = 2
{common}
at step 35: notice node other
when stopped: start all
""",
    "notice-spread": """\
# Notices to every node, one after the other over 2 s: one whole-job stop, then a restart.
nodes = 3
{common}
at step 35: notice all over 2s
when stopped: start all
""",
    "terminate-rank0": """\
# SIGTERM to the agent of the rank-0 node alone (a Kubernetes pod deleted).
nodes = 3
{common}
at step 35: terminate node rank0
""",
    "disk-full": """\
# The snapshot directory is full for 10 s: snapshots fail, training goes on.
nodes = 2
snapshot-every = 5
steps = {steps}
step-delay = 0.05
at step 12: fill disk for 10s
""",
    "partition": """\
# One machine's network link goes down for 15 s (each node in its own network namespace).
nodes = 3
{common}
at step 35: partition node other for 15s
""",
    "drop-two": """\
# Two of three machines drop off the network without a word (everything they send is
# dropped, each node in its own network namespace) for 15 s; the third trains on alone.
nodes = 3
nnodes = 1:3
{common}
at step 35: drop node other for 15s
after 0s: drop node other for 15s
""",
    "tour": """\
# The issue's example: several faults in one run (the picture in docs/chaos.md).
nodes = 3
etcd-members = 3
steps = 400
snapshot-every = 10
step-delay = 0.05
timeout = 420
at step 35: kill node 1
when recovered: start node
at step 120: freeze node other for 20s
at step 250: kill etcd leader for 10s
at step 320: preempt all
when stopped: start all
""",
}

# Long enough that training goes on well past the end of the fault: a frozen or cut-off
# node must wake up while the job still runs, to rejoin it.
# A joining node must be ready (its torchrun and warm-start server up: 10 s on a slow
# machine, 14 s on a busy one) while the job still trains.
STEPS = {"etcd-outage": 400, "disk-full": 200, "freeze": 300, "partition": 300, "join": 500,
         "drop-two": 400}
DEFAULT_STEPS = 120

CI = ("kill-worker", "notice", "etcd-leader")
"""The subset CI runs with the bundled trainer: a worker crash (bit-exact against an
uninterrupted run), a preemption notice to one node, and an etcd leader failure (the
rest are in ``full``). The etcd leader stays down 5 s: a new one is elected in about
1 s, and the job trains on under it for seconds before the old member is back. Rank 0's
machine dying, a join and a whole-job preemption with a restart run in CI on the same
``ElasticLoop`` as ``examples/own_loop.py`` and the Hugging Face example
(``tests/test_own_loop.py``, ``tests/test_huggingface.py``), where they also check
exactly-once data and no step trained twice."""

GROUPS: dict[str, tuple[str, ...]] = {"ci": CI,
                                      "full": tuple(name for name in SCENARIOS if name != "tour")}


def text(name: str) -> str:
    template = SCENARIOS[name]
    steps = STEPS.get(name, DEFAULT_STEPS)
    return template.format(common=_COMMON.format(steps=steps).rstrip("\n"), steps=steps)


def scenario(name: str) -> Scenario:
    """The built-in scenario ``name``; KeyError lists the names."""
    if name not in SCENARIOS:
        raise KeyError(f"no built-in scenario {name!r}; built in: {', '.join(SCENARIOS)}")
    return parse(text(name), name)


def names(selector: str) -> tuple[str, ...]:
    """A group (``ci``, ``full``) or one built-in name, as a tuple of names."""
    if selector in GROUPS:
        return GROUPS[selector]
    if selector in SCENARIOS:
        return (selector,)
    raise KeyError(selector)
