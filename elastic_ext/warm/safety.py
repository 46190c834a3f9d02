"""Whether this process may still fork workers that work.

A forked child inherits the parent's memory but only the forking thread: a thread
pool, a CUDA context or an NCCL communicator created before the fork is broken in
the child (it hangs or crashes later, far from the cause). The server checks
before every fork and refuses, naming the cause, so workers start cold instead.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any


def native_threads() -> int:
    """Threads of this process, Python's and native ones (Linux ``/proc``)."""
    return len(os.listdir("/proc/self/task"))


@dataclass(frozen=True)
class ForkSafety:
    threads: int
    """Native threads now."""
    allowed_threads: int
    """Threads there were after importing numpy: OpenBLAS's pool, which stops itself
    around ``fork`` (``pthread_atfork``); any more were started by an import."""
    python_threads: list[str]
    cuda_initialized: bool
    process_group: bool
    thread_imports: list[str] = field(default_factory=list)
    """Modules after whose import there were more threads (``preload.thread_starters``):
    where to look when a hazard is a thread."""

    @property
    def hazards(self) -> list[str]:
        found = []
        suspects = (f" (threads appeared while importing {', '.join(self.thread_imports)})"
                    if self.thread_imports else "")
        if self.python_threads:
            found.append(f"Python threads running: {', '.join(self.python_threads)}{suspects}")
        if self.threads > self.allowed_threads:
            found.append(f"{self.threads - self.allowed_threads} native thread(s) started by an "
                         "import (a thread pool, or a library that ran a parallel operation)"
                         + ("" if self.python_threads else suspects))
        if self.cuda_initialized:
            found.append("CUDA was initialised at import")
        if self.process_group:
            found.append("a torch.distributed process group was created at import")
        return found

    def to_message(self) -> dict[str, Any]:
        return {**asdict(self), "hazards": self.hazards}


def check(allowed_threads: int, thread_imports: Sequence[str] = ()) -> ForkSafety:
    """This process's fork hazards now; touches no device (``is_initialized`` only reads).
    ``thread_imports``: the imports to name if threads are a hazard."""
    torch = sys.modules.get("torch")
    cuda = bool(torch is not None and torch.cuda.is_initialized())
    dist = sys.modules.get("torch.distributed")
    group = bool(dist is not None and dist.is_available() and dist.is_initialized())
    python_threads = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    return ForkSafety(threads=native_threads(), allowed_threads=allowed_threads,
                      python_threads=python_threads, cuda_initialized=cuda, process_group=group,
                      thread_imports=list(thread_imports))


def baseline_threads() -> int:
    """Import numpy (torch does anyway) and count: its BLAS pool is fork-aware."""
    try:
        import numpy  # noqa: F401
    except ImportError:
        pass
    return native_threads()
