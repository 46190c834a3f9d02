"""Leaves as told: ``OUT 3`` exits 3, ``OUT SIGKILL`` / ``OUT SIGSEGV`` kills itself."""

import os
import resource
import signal
import sys

try:  # run as a script: this directory is sys.path[0]
    from warm_record import record  # type: ignore[import-not-found]
except ImportError:  # run as a module: python -m tests.support.warm_scripts.NAME
    from tests.support.warm_scripts.warm_record import record


def main() -> None:
    out, how = sys.argv[1], sys.argv[2]
    record(out, "exit")
    if how.isdigit():
        sys.exit(int(how))
    resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))
    os.kill(os.getpid(), getattr(signal, how))


if __name__ == "__main__":
    main()
