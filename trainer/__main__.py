"""``python -m trainer`` / ``torchrun ... -m trainer``.

Under an etcd-ext agent with warm start on, this process only hands its command to
the node's warm-start server, which forks the real worker with torch already
imported (see ``elastic_ext.warm``); otherwise, and in that forked worker, it trains.
"""

import sys

from elastic_ext.warm.launcher import hand_off
from elastic_ext.warm.target import Target

hand_off(Target.module("trainer"), sys.argv[1:])

from elastic_ext.preemption import exit_now  # noqa: E402  (after the hand-off: imports torch)
from trainer.cli import main  # noqa: E402

# Everything is flushed and closed by now; skipping interpreter teardown saves about a
# second per worker (torch's modules are many) on every restart.
exit_now(main())
