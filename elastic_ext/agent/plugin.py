"""The ``torchrun.handlers`` entry point.

torch imports this module while it imports ``torch.distributed.elastic.rendezvous``,
so, like torch's own ``registry.py``, the creator is thin: it imports the agent's set-up
(``setup.py``) lazily and injects the backend name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters

BACKEND_NAME = "etcd-ext"


def _create_etcd_ext_handler(params: RendezvousParameters) -> RendezvousHandler:
    from elastic_ext.agent.setup import set_up_agent

    return set_up_agent(params, BACKEND_NAME)


def handler_creator() -> Callable[[RendezvousParameters], RendezvousHandler]:
    """Called by torch's registry with no arguments; returns the handler creator."""
    return _create_etcd_ext_handler
