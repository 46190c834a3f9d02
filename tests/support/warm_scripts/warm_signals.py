"""Waits for SIGTERM, SIGINT or SIGUSR2 in a handler of its own, writes which one came to
``OUT/got-rank<RANK>``, and exits 0."""

import json
import os
import signal
import sys
import time
from types import FrameType

from elastic_ext.warm.worker import in_warm_worker

WAIT_S = 60.0


def record(out: str, what: str, **facts: object) -> None:
    facts.update(warm=in_warm_worker(), pid=os.getpid(), ppid=os.getppid())
    gen = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    path = os.path.join(out, f"{what}-rank{os.environ.get('RANK', 'cold')}-gen{gen}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(facts, f)
    os.replace(path + ".tmp", path)


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
