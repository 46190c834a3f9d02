"""Building the handler from torch's ``RendezvousParameters``: settings, store, checks."""

from __future__ import annotations

import logging
import os
import sys

from torch.distributed.elastic.rendezvous import RendezvousParameters

from elastic_ext.logs import configure_for_torchrun
from elastic_ext.rendezvous.backend import StoreBackend
from elastic_ext.rendezvous.handler import EtcdExtRendezvousHandler
from elastic_ext.rendezvous.settings import Settings, parse_settings

logger = logging.getLogger(__name__)


def torchrun_max_restarts(argv: list[str] | None = None) -> int | None:
    """``--max-restarts`` of the torchrun command line this agent runs under, if any.

    The handler is not told the agent's restart budget, yet it keeps the job-wide
    count; torchrun's own parser reads it back (PET_MAX_RESTARTS included).
    """
    argv = sys.argv if argv is None else argv
    if not argv:
        return None
    program = os.path.basename(argv[0])
    if program != "torchrun" and not argv[0].endswith(os.path.join("distributed", "run.py")):
        return None
    from torch.distributed.run import get_args_parser

    try:
        args = get_args_parser().parse_args(argv[1:])
    except SystemExit:
        return None
    return int(args.max_restarts)


def settings_from_params(params: RendezvousParameters) -> Settings:
    return parse_settings(endpoint=params.endpoint or "", run_id=params.run_id,
                          min_nodes=params.min_nodes, max_nodes=params.max_nodes,
                          conf=dict(params.config), local_addr=params.local_addr,
                          default_max_restarts=torchrun_max_restarts())


def create_backend(settings: Settings) -> StoreBackend:
    if settings.store == "c10d":
        from elastic_ext.rendezvous.c10d_backend import C10dBackend, connect_tcp_store

        return C10dBackend(settings, connect_tcp_store(settings))
    from elastic_ext.rendezvous.etcd_backend import EtcdBackend

    backend = EtcdBackend(settings)
    version = backend.check_server()
    logger.info("etcd-ext: etcd %s at %s", version, settings.describe_endpoints())
    return backend


def create_handler(params: RendezvousParameters) -> EtcdExtRendezvousHandler:
    configure_for_torchrun()
    settings = settings_from_params(params)
    return EtcdExtRendezvousHandler(settings, create_backend(settings))
