"""Leaves as told: ``OUT 3`` exits 3, ``OUT SIGKILL`` / ``OUT SIGSEGV`` kills itself, once
every rank wrote its facts (torchrun stops the others when the first one fails)."""

import os
import resource
import signal
import sys
import time
from pathlib import Path

try:  # run as a script: this directory is sys.path[0]
    from warm_record import record  # type: ignore[import-not-found]
except ImportError:  # run as a module: python -m tests.support.warm_scripts.NAME
    from tests.support.warm_scripts.warm_record import record


def main() -> None:
    out, how = sys.argv[1], sys.argv[2]
    record(out, "exit")
    ranks = int(os.environ.get("WORLD_SIZE", "1"))
    deadline = time.monotonic() + 30
    while len(list(Path(out).glob("exit-rank*.json"))) < ranks and time.monotonic() < deadline:
        time.sleep(0.01)
    if how.isdigit():
        sys.exit(int(how))
    resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))
    os.kill(os.getpid(), getattr(signal, how))


if __name__ == "__main__":
    main()
