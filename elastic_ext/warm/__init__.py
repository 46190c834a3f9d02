"""Warm worker starts: a per-node fork server that has imported torch and the training
module's imports, and a launcher that has it fork each worker.

torchrun stops and starts every worker on any membership change, and a fresh
``python -m trainer`` spends seconds on the interpreter and ``import torch`` before
the first line of training code. The etcd-ext agent starts a server
(:mod:`elastic_ext.warm.server`) when its workers' command can use it; the launcher
(``torchrun ... -m elastic_ext.warm -m mymodule ...``, or the bundled trainer by
itself) hands the server its argv, environment, working directory, resource limits
and standard streams, relays signals to the forked worker and exits with its status.

This package imports nothing heavy: the launcher must start in milliseconds.
"""

import signal

SOCKET_ENV = "ELASTIC_EXT_WARM_SOCKET"
"""Set by the etcd-ext agent for its workers: the server's Unix socket, or ``off``."""

OFF = "off"
"""``SOCKET_ENV`` when the agent was told not to warm-start (``--rdzv-conf warm_start=off``)."""

RELAYED_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT,
                             signal.SIGUSR1, signal.SIGUSR2})
"""What torchrun may send a worker: the launcher relays them to the forked worker. The
server blocks them (a Ctrl-C or a node-wide SIGTERM is for the agent and the workers, not
for it); a forked worker unblocks them once its handlers are the defaults."""
