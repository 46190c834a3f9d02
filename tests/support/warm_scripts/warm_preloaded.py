"""Writes which of the modules named on its command line were loaded before it ran: the
ones ``--rdzv-conf warm_preload=...`` named, the warm-start server imported before the fork."""

import sys

try:  # run as a script: this directory is sys.path[0]
    from warm_record import record  # type: ignore[import-not-found]
except ImportError:  # run as a module: python -m tests.support.warm_scripts.NAME
    from tests.support.warm_scripts.warm_record import record


if __name__ == "__main__":
    loaded = [name for name in sys.argv[2:] if name in sys.modules]
    record(sys.argv[1], "preloaded", loaded=loaded)
