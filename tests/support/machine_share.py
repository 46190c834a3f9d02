"""How the suite's xdist workers share the machine: a test marked ``quiet`` (a bound on
time that holds on this machine, not on one busy with other jobs) runs while no other
test runs real parts; tests without real parts may run beside it.

A readers-writer lock on files every worker sees: each test with real parts holds it
shared, a quiet test holds it exclusively. ``flock`` gives a waiting exclusive lock no
priority over new shared ones, so every taker passes a turnstile first (an exclusive lock
held only while taking the main one): a waiting quiet test keeps new real-part tests out
instead of waiting for a moment when none runs.

The order of the collection (``order``) keeps the waiting short: the quiet tests first,
each followed by a share of the fast tests for the other workers, then the real-part
tests, the longest first (by their timeout: a rough but maintained estimate), then the
rest of the fast tests to fill the end.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest

FAST_PER_QUIET = 200
"""Fast tests queued after each quiet test: about 40 s for two workers, the length of a
quiet test."""


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
    real = sorted((item for item in items if has_real_parts(item)
                   and not item.get_closest_marker("quiet")), key=lambda item: -_timeout(item))
    fast = [item for item in items if not has_real_parts(item)
            and not item.get_closest_marker("quiet")]
    ordered: list[pytest.Item] = []
    for index, item in enumerate(quiet):
        ordered += [item, *fast[index * FAST_PER_QUIET:(index + 1) * FAST_PER_QUIET]]
    return [*ordered, *real, *fast[len(quiet) * FAST_PER_QUIET:]]
