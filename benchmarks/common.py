"""What the benchmark scripts share: the machine line of their tables, and a SIGTERM that
lets their ``finally`` blocks kill what they started. Imported as a sibling
(``from common import ...``): the scripts run as ``python benchmarks/NAME.py``."""

from __future__ import annotations

import platform
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


@contextmanager
def terminated_by_sigterm() -> Iterator[None]:
    """SIGTERM raises SystemExit, so that ``finally`` blocks kill what was started."""
    def stop(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
