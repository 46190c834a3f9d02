"""Building etcd-ext backends against real stores for tests."""

from __future__ import annotations

from elastic_ext.rendezvous.settings import Settings, parse_settings


def settings_for(endpoint: str, run_id: str = "run1", nnodes: tuple[int, int] = (1, 3),
                 **conf: str) -> Settings:
    conf.setdefault("connect_timeout", "5")
    return parse_settings(endpoint=endpoint, run_id=run_id, min_nodes=nnodes[0],
                          max_nodes=nnodes[1], conf=conf)
