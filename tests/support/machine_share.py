"""How the suite's xdist workers share the machine: a test marked ``quiet`` (a bound on
time that holds on this machine, not on one busy with other jobs) runs alone.

A readers-writer lock on files every worker sees: each other test holds it shared, a
quiet test exclusively. ``flock`` gives a waiting exclusive lock no priority over new
shared ones, so every taker passes a turnstile first (an exclusive lock held only while
taking the main one): a waiting quiet test keeps new tests out instead of waiting for a
moment when none runs.

Alone, not only apart from the tests that start real parts: beside the fast tests the
held worker of ``tests/test_warm_hold_exit.py`` took 0.152 s to exit against 0.04-0.05 s
alone (bound 0.1 s). The order of the collection (``order``) puts the quiet tests first,
where they cost the other workers the least (about a minute of waiting), then the tests
that start real parts, the longest first (by their timeout: a rough but maintained
estimate), then the fast tests, which fill the end.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def machine_share(directory: Path, *, exclusive: bool) -> Iterator[None]:
    """Hold the suite's lock in ``directory`` (shared, or ``exclusive`` for a quiet test)."""
    directory.mkdir(parents=True, exist_ok=True)
    turnstile = os.open(directory / "machine-share.turnstile", os.O_RDWR | os.O_CREAT, 0o644)
    main = os.open(directory / "machine-share.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(main, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        finally:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        yield
    finally:
        os.close(main)  # releases the lock
        os.close(turnstile)


def _timeout(item: pytest.Item) -> float:
    marker = item.get_closest_marker("timeout")
    return float(marker.args[0]) if marker is not None and marker.args else 300.0


def order(items: Sequence[pytest.Item],
          has_real_parts: Callable[[pytest.Item], bool]) -> list[pytest.Item]:
    """``items`` in the order described in the module's docstring (stable otherwise)."""
    quiet = [item for item in items if item.get_closest_marker("quiet")]
    rest = [item for item in items if not item.get_closest_marker("quiet")]
    real = sorted((item for item in rest if has_real_parts(item)),
                  key=lambda item: -_timeout(item))
    return [*quiet, *real, *(item for item in rest if not has_real_parts(item))]
