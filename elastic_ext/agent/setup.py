"""The agent's set-up: everything a torchrun agent starts with when it asks for the
``etcd-ext`` rendezvous (logging, the quiet exit, its Prometheus server, the store, the warm
fork server, the control directory, the signal hooks) and the handler it then gets."""

from __future__ import annotations

from pathlib import Path

from torch.distributed.elastic.rendezvous import RendezvousParameters

from elastic_ext.agent.control import AgentControl
from elastic_ext.logs import configure_for_torchrun
from elastic_ext.rendezvous.agent.handler import EtcdExtRendezvousHandler
from elastic_ext.rendezvous.agent.prometheus import (
    AgentMetrics,
    MeasuredBackend,
    require_prometheus_client,
)
from elastic_ext.rendezvous.settings import Settings, parse_settings
from elastic_ext.rendezvous.stores.open import open_backend
from elastic_ext.torch_compat import (
    on_agent_signal,
    quiet_agent_exit,
    torchrun_max_restarts,
    torchrun_worker_command,
)


def settings_from_params(params: RendezvousParameters) -> Settings:
    return parse_settings(endpoint=params.endpoint or "", run_id=params.run_id,
                          min_nodes=params.min_nodes, max_nodes=params.max_nodes,
                          conf=dict(params.config), local_addr=params.local_addr,
                          default_max_restarts=torchrun_max_restarts())


def set_up_agent(params: RendezvousParameters, backend_name: str) -> EtcdExtRendezvousHandler:
    """Set this agent up and return the handler torchrun asked for as
    ``--rdzv-backend=<backend_name>``."""
    configure_for_torchrun()
    quiet_agent_exit()
    settings = settings_from_params(params)
    metrics = None
    if settings.metrics_port is not None:
        require_prometheus_client()
        metrics = AgentMetrics(settings.run_id)
        metrics.serve(settings.metrics_port)
    backend = open_backend(settings)
    if metrics is not None:
        backend = MeasuredBackend(backend, metrics)
    # Imported here: the launcher's package must stay free of the rendezvous' imports.
    from elastic_ext.warm.agent import WarmStartServer

    warm = WarmStartServer.for_workers(torchrun_worker_command(), enabled=settings.warm_start,
                                       preload=settings.warm_preload)
    control = AgentControl()
    control.catch_preemption()  # torchrun itself has no handler for SLURM's SIGUSR2
    handler = EtcdExtRendezvousHandler(
        settings, backend, backend_name=backend_name, metrics=metrics,
        events_file=Path(settings.events_file) if settings.events_file else None,
        control=control, starter=warm)
    if metrics is not None:
        keeper = handler.keeper
        metrics.watch_pace(lambda: keeper.pace)  # read when scraped: the keeper's last tick
    on_agent_signal(handler.leave_after_signal)
    return handler
