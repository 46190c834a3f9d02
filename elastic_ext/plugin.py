"""The ``torchrun.handlers`` entry point.

torch imports this module while it imports ``torch.distributed.elastic.rendezvous``,
so everything heavy is imported lazily inside the creator.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters

BACKEND_NAME = "etcd-ext"


def create_handler(params: "RendezvousParameters") -> "RendezvousHandler":
    from elastic_ext.rendezvous.factory import create_handler as _create

    return _create(params)


def handler_creator() -> Callable[["RendezvousParameters"], "RendezvousHandler"]:
    """Called by torch's registry with no arguments; returns the handler creator."""
    return create_handler
