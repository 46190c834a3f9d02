"""``python -m trainer`` / ``torchrun ... -m trainer``.

Under an etcd-ext agent with warm start on, this process only hands its command to
the node's warm-start server, which forks the real worker with torch already
imported (see ``elastic_ext.warm``); otherwise, and in that forked worker, it trains.
"""

import signal
import sys

# SLURM's advance notice must not kill a worker before its guard takes the signal over
# (the etcd-ext agent gets the notice too: elastic_ext.agent.control.AgentControl.catch_preemption).
signal.signal(signal.SIGUSR2, signal.SIG_IGN)

from elastic_ext.warm.launcher import hand_off  # noqa: E402
from elastic_ext.warm.target import Target  # noqa: E402

hand_off(Target.module("trainer"), sys.argv[1:])

from elastic_ext.worker.preemption import exit_now  # noqa: E402  (after the hand-off: imports torch)
from trainer.cli import main  # noqa: E402

# Everything is flushed and closed by now; skipping interpreter teardown saves about a
# second per worker (torch's modules are many) on every restart.
exit_now(main())
