"""The ``etcd-ext`` rendezvous (one handler, two stores: etcd v3 and an embedded c10d
TCPStore), in three layers, each importing only the ones above it:

- ``protocol``: pure rules over the run's JSON state (``state``, ``policy.decide``,
  ``joins``, ``liveness``, ``head``, ``drain``); no I/O, no threads, only the injected
  ``clock``;
- ``stores``: the store contract (``contract``), how values look in a store (``wire``),
  and its implementations on etcd v3 (``stores.etcd``) and the embedded TCPStore
  (``stores.c10d``);
- ``agent``: torch's ``RendezvousHandler`` (``handler``), the join session, the keeper
  thread and what it decides with, the lifecycle and the agent's events and metrics.

``settings`` (``--rdzv-conf``) and ``errors`` are shared by all three."""
