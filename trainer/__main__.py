"""``python -m trainer`` / ``torchrun ... -m trainer``."""

from elastic_ext.preemption import exit_now
from trainer.cli import main

# Everything is flushed and closed by now; skipping interpreter teardown saves about a
# second per worker (torch's modules are many) on every restart.
exit_now(main())
