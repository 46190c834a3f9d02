"""What the benchmark scripts share: the machine line of their tables, a cell of median
and range, and a SIGTERM that lets their ``finally`` blocks kill what they started.
Imported as a sibling (``from common import ...``): the scripts run as
``python benchmarks/NAME.py``."""

from __future__ import annotations

import platform
import signal
import statistics
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

from elastic_ext.local.etcd import EtcdMember, start_cluster
from elastic_ext.local.processes import ProcessSet
from elastic_ext.rendezvous.settings import parse_settings
from elastic_ext.rendezvous.stores.etcd.client import EtcdClient


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def cell(values: list[float], digits: int = 0) -> str:
    """A table cell: the median, then the range when there is more than one value."""
    if not values:
        return "n/a"
    med = statistics.median(values)
    if len(values) == 1:
        return f"{med:.{digits}f}"
    return f"{med:.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


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


@contextmanager
def private_etcd(prefix: str) -> Iterator[tuple[ProcessSet, EtcdMember, EtcdClient]]:
    """One etcd member on loopback with a temporary data directory, a client of it, and
    the process set to start more in; SIGTERM or the end kills everything started."""
    with terminated_by_sigterm(), tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        procs = ProcessSet(Path(tmp) / "logs")
        try:
            member = start_cluster(procs, Path(tmp), 1).members[0]
            yield procs, member, EtcdClient(parse_settings(
                endpoint=member.endpoint, run_id="bench", min_nodes=1, max_nodes=1, conf={}))
        finally:
            procs.cleanup()
