"""Opening the store that settings name. Store modules are imported only when chosen, so an
agent on the embedded store never imports the etcd client, nor one on etcd the c10d one."""

from __future__ import annotations

from elastic_ext.rendezvous.settings import Settings
from elastic_ext.rendezvous.stores.contract import StoreBackend


def open_backend(settings: Settings, *, may_host: bool = True) -> StoreBackend:
    """The run's backend on the store ``settings`` name, reachable when this returns.

    ``may_host=False`` (the operator commands) never hosts the embedded store.

    Raises:
        StoreUnavailableError: the store could not be reached within ``connect_timeout``.
        StoreAuthError: the store refused the credentials or certificate.
        ConfigError: the etcd server is too old for the v3 gateway.
    """
    if settings.store == "c10d":
        from elastic_ext.rendezvous.stores.c10d.backend import C10dBackend

        return C10dBackend.connect(settings, may_host=may_host)
    from elastic_ext.rendezvous.stores.etcd.backend import EtcdBackend

    return EtcdBackend.connect(settings)
