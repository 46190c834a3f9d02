"""A node that only beats, as an etcd-ext agent's keeper does: its heartbeat in etcd every
``heartbeat_interval`` (the default), with the port it listens on for presence probes. For
tests of the watcher.

    python tests/support/beating_node.py NODE ENDPOINT RUN_ID [HEARTBEAT]

HEARTBEAT is ``write`` (the default) or ``lease`` (``--rdzv-conf heartbeat_mode=``).
"""

from __future__ import annotations

import sys
import time

from elastic_ext.rendezvous.agent.presence import PresenceListener
from elastic_ext.rendezvous.settings import parse_settings
from elastic_ext.rendezvous.stores.etcd.backend import EtcdBackend


def main() -> None:
    node, endpoint, run_id = sys.argv[1:4]
    heartbeat = sys.argv[4] if len(sys.argv) > 4 else "write"
    settings = parse_settings(endpoint=endpoint, run_id=run_id, min_nodes=1, max_nodes=64,
                              conf={"heartbeat_mode": heartbeat})
    backend = EtcdBackend.connect(settings)
    listener = PresenceListener()
    while True:
        try:
            backend.keeper_read(node, listener.port, [])
        except Exception as exc:  # dropped off the network: the watcher sees silence
            print(f"{node}: {exc}", file=sys.stderr, flush=True)
        listener.drain()
        time.sleep(settings.timeouts.heartbeat_interval)  # the beat's period, not a wait


if __name__ == "__main__":
    main()
