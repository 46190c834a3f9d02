"""The ``etcd-ext`` rendezvous: one handler, two stores (etcd v3, embedded c10d TCPStore)."""
