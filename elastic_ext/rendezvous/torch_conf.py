"""Where etcd-ext's ``--rdzv-conf`` keys meet torch's: what torch 2.13's own rendezvous code
reads, so that a torch configuration carries over or fails with the key to give instead.

Checked against torch's source: ``dynamic_rendezvous.create_handler`` (the ``c10d`` and
``etcd-v2`` backends: ``join_timeout``, ``last_call_timeout``, ``close_timeout``,
``heartbeat_timeout``, ``keep_alive_interval``, ``keep_alive_max_attempt``), the ``c10d``
store (``is_host``, ``read_timeout``, ``store_type``), the ``etcd-v2`` client (``protocol``,
``read_timeout``, ``ssl_cert``, ``ssl_cert_key``, ``ca_cert``), the legacy ``etcd`` backend
(``protocol``, ``cert``, ``key``, ``cacert``, ``etcd_prefix``, ``timeout``,
``last_call_timeout``) and torchrun's launcher (sets ``timeout``). Data only: parsing is
``settings``' job.
"""

from __future__ import annotations

TORCH_KEYS: dict[str, str] = {
    "join_timeout": "same", "last_call_timeout": "same", "close_timeout": "same",
    "heartbeat_interval": "as `keep_alive_interval`", "heartbeat_timeout": "other meaning",
    "is_host": "same", "cacert": "same", "cert": "same", "key": "same", "timeout": "same",
}
"""The README table's torch column: how torch 2.13's own rendezvous code (the ``c10d`` and
``etcd-v2`` handler, its c10d store, the legacy ``etcd`` backend, torchrun's launcher) reads
our key: ``same`` name and meaning, under another name, or ``other meaning``, so that users
know what carries over. Torch's ``heartbeat_timeout`` bounds one keep-alive write (a node is
dead after ``keep_alive_interval`` x ``keep_alive_max_attempt``); ours is the death verdict."""

ALIASES: dict[str, str] = {"keep_alive_interval": "heartbeat_interval"}
"""Torch's name -> ours, same meaning: accepted so a torch ``--rdzv-conf`` carries over."""

TORCH_ONLY: dict[str, str] = {
    "keep_alive_max_attempt": "torch declares a node dead after keep_alive_interval x "
                              "keep_alive_max_attempt without a keep-alive; etcd-ext after "
                              "heartbeat_timeout seconds without a heartbeat: give "
                              "heartbeat_timeout=SECONDS instead",
    "read_timeout": "give request_timeout (seconds one etcd request may take) and "
                    "connect_timeout (seconds one store operation keeps retrying) instead",
    "protocol": "give an https:// endpoint or cacert instead",
    "ca_cert": "give cacert instead",
    "ssl_cert": "give cert instead",
    "ssl_cert_key": "give key instead",
    "etcd_prefix": "give key_prefix instead",
    "store_type": "etcd-ext's stores are etcd and the embedded TCPStore: give store=etcd, "
                  "c10d or auto instead",
}
"""Keys torch's own backends read and etcd-ext does not, with what to give instead: an error
beats a silently ignored setting."""
