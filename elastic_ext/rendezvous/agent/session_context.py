"""What every ``next_rendezvous`` call of one node shares: the handles it reaches the run
through (``RunAccess``; ``SessionParts``, the agent's parts, for the session, which hands the head
path only the keeper's judgement of a closer),
what it carries from one call to the next (``Memory``), and how it waits out a store that
went away."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from elastic_ext.agent.control import AgentControl
from elastic_ext.rendezvous.agent.events import EventLog
from elastic_ext.rendezvous.agent.keeper import Keeper
from elastic_ext.rendezvous.agent.lifecycle import Lifecycle
from elastic_ext.rendezvous.agent.probes import Probes
from elastic_ext.rendezvous.errors import StoreUnavailableError
from elastic_ext.rendezvous.protocol.clock import Clock
from elastic_ext.rendezvous.protocol.state import NodeInfo
from elastic_ext.rendezvous.settings import Settings
from elastic_ext.rendezvous.stores.contract import StoreBackend

logger = logging.getLogger(__name__)

OUTAGE_RETRY_S = 0.05
"""How often a rendezvous asks a store that went away again."""


def wait_out_outage(backend: StoreBackend, clock: Clock, exc: StoreUnavailableError,
                    deadline: float) -> None:
    """Inside a rendezvous (and at an agent's first heartbeat) an outage is waited out until
    the join deadline when the store can come back (etcd); the embedded store dies with its
    host, so losing it ends the rendezvous at once: ``exc`` is raised again."""
    if not backend.outages_are_transient or clock.monotonic() > deadline:
        raise exc
    logger.warning("etcd-ext: store unreachable, still trying until the join timeout: %s", exc)
    clock.sleep(OUTAGE_RETRY_S)


@dataclass
class Memory:
    """What one node carries from one ``next_rendezvous`` call to the next."""

    completed: tuple[str, int] | None = None  # (generation, round) it last joined
    # The nodes of that round, by rank; None when this node learnt its place in it from its
    # seat (``head.py``) and read no list of them, then only that round's rank 0 is known.
    last_order: tuple[str, ...] | None = ()
    last_rank0: str | None = None
    last_seal: str = ""  # ``head.seal_of`` that round
    # that round's nodes this node probes (its seat's ring: ``reach.py``); None: unknown
    last_ring: tuple[tuple[str, NodeInfo], ...] | None = None
    # when this node first saw each open round with MIN nodes (its last call counts from then)
    min_reached_at: dict[tuple[str, int], float] = field(default_factory=dict)
    last_written_note: str = ""  # logged when written: not logged again when read
    # when this node saw each round of its generation complete (rank 0 drops old rounds'
    # keys only ``OLD_ROUND_GRACE_S`` after)
    completed_at: dict[tuple[str, int], float] = field(default_factory=dict)
    # An open round whose idle closer this node took over. Kept across calls: after a call
    # that ended in an error, the next one on the same round decides on it at once.
    take_over: tuple[str, int] | None = None


@dataclass(frozen=True)
class RunAccess:
    """How a session reaches the run, the same for every call: this node's name, the job's
    settings (its ``Limits``: ``Limits.of``), the store and time. The head path needs no
    more (with the keeper's judgement of the closer)."""

    node: str
    settings: Settings
    backend: StoreBackend
    clock: Clock


@dataclass(frozen=True)
class SessionParts:
    """What a session works with besides ``RunAccess``: where this node is, and the
    agent's parts it tells and asks (the keeper, the events, the
    workers' control directory, the probes, the lifecycle), and the reach of its ring
    neighbours it checks before its workers start (seconds; 0: no check)."""

    addr: str
    keeper: Keeper
    events: EventLog
    control: AgentControl
    probes: Probes
    lifecycle: Lifecycle
    reach_timeout: float = 0.0
