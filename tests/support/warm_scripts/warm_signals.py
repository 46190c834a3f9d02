"""Waits for SIGTERM, SIGINT or SIGUSR2 in a handler of its own, writes which one came to
``OUT/got-rank<RANK>``, and exits 0."""

import signal
import sys
import time
from types import FrameType

try:  # run as a script: this directory is sys.path[0]
    from warm_record import record  # type: ignore[import-not-found]
except ImportError:  # run as a module: python -m tests.support.warm_scripts.NAME
    from tests.support.warm_scripts.warm_record import record

WAIT_S = 60.0


def main() -> None:
    out = sys.argv[1]

    def got(signum: int, frame: FrameType | None) -> None:
        record(out, "got", signal=signal.Signals(signum).name)
        sys.exit(0)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2):
        signal.signal(signum, got)
    record(out, "ready")
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        time.sleep(0.05)
    sys.exit(4)  # no signal came


if __name__ == "__main__":
    main()
