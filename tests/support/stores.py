"""Settings for test backends, and writing to a run's keys the way a foreign program would."""

from __future__ import annotations

from elastic_ext.rendezvous.settings import Settings, parse_settings
from elastic_ext.rendezvous.stores.etcd.client import EtcdClient
from elastic_ext.rendezvous.stores.wire import STATE_KEY


def settings_for(endpoint: str, run_id: str = "run1", nnodes: tuple[int, int] = (1, 3),
                 **conf: str) -> Settings:
    conf.setdefault("connect_timeout", "5")
    return parse_settings(endpoint=endpoint, run_id=run_id, min_nodes=nnodes[0],
                          max_nodes=nnodes[1], conf=conf)


def plant_etcd_state(settings: Settings, raw: bytes) -> None:
    """Put ``raw`` into the run's state key on etcd, bypassing etcd-ext's own checks."""
    EtcdClient(settings).put(settings.run_prefix + STATE_KEY, raw)
