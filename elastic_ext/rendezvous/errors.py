"""The narrow set of errors etcd-ext raises.

Each subclasses torch's rendezvous errors so torch's agent treats them as it would
its own; each message names what to fix.
"""

from __future__ import annotations

from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousStateError,
    RendezvousTimeoutError,
)

__all__ = [
    "ConfigError",
    "RestartBudgetExhaustedError",
    "JobFinishedError",
    "NodeExcludedError",
    "NodeLeftError",
    "StoreUnavailableError",
    "StoreAuthError",
    "CorruptStateError",
    "RendezvousTimeoutError",
    "RendezvousClosedError",
]


class ConfigError(RendezvousError, ValueError):
    """A ``--rdzv-conf`` key, value, endpoint or ``--nnodes`` that cannot work."""


class StoreUnavailableError(RendezvousConnectionError):
    """No store endpoint answered within the retry deadline."""


class StoreAuthError(RendezvousConnectionError):
    """The store refused our credentials or certificate; retrying will not help."""


class CorruptStateError(RendezvousStateError):
    """The run's state key holds something that is not an etcd-ext state."""


class RestartBudgetExhaustedError(RendezvousClosedError):
    """The job-wide ``--max-restarts`` budget is spent; every agent stops."""


class JobFinishedError(RendezvousClosedError):
    """The job finished while this node was away (frozen, cut off): nothing left to do."""


class NodeLeftError(RendezvousClosedError):
    """This node left the job on a preemption notice; the others train on: its part is over,
    and it ended well."""


class NodeExcludedError(RendezvousClosedError):
    """The other nodes cannot reach this one (though the store can): it was left out."""
