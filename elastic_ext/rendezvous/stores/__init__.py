"""Where the run's state lives: the contract every store meets (``contract``), the bytes it
holds (``wire``), the stores (``etcd``, ``c10d``) and ``open``, which picks one."""
