"""Whether this process may still fork workers that work.

A forked child inherits the parent's memory but only the forking thread: a thread
pool, a CUDA context or an NCCL communicator created before the fork is broken in
the child (it hangs or crashes later, far from the cause). The CUDA driver is
broken in the child as soon as it is loaded, even before ``torch.cuda`` counts as
initialised: ``torch.cuda.is_available()`` at import time loads ``libcuda`` (and calls
``cuInit``) without setting ``torch.cuda.is_initialized()``, and every forked worker's
first CUDA call then fails. So the driver is looked for in ``/proc/self/maps`` too. The
server checks before every fork and refuses, naming the cause, so workers start cold
instead.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

NVML_CUDA_CHECK_ENV = "PYTORCH_NVML_BASED_CUDA_CHECK"
"""Set to ``1`` in the server: torch's ``is_available()`` then asks NVML, not the driver."""

_DRIVER_PREFIX = "libcuda.so"
"""The CUDA driver's file name, up to its version (``libcuda.so.1``, ``libcuda.so.550.54``);
not the runtime (``libcudart.so``), which torch may map without loading the driver."""


def native_threads() -> int:
    """Threads of this process, Python's and native ones (Linux ``/proc``)."""
    return len(os.listdir("/proc/self/task"))


def cuda_driver_loaded(maps_text: str) -> bool:
    """Whether ``maps_text`` (a ``/proc/<pid>/maps``) maps the CUDA driver: a file whose
    name starts with ``libcuda.so``. The driver is loaded once and never unloaded by
    torch, so its mapping is the fork hazard, whatever loaded it."""
    if _DRIVER_PREFIX not in maps_text:  # the usual case, without splitting every line
        return False
    for line in maps_text.splitlines():
        fields = line.split(maxsplit=5)  # address perms offset dev inode [path]
        if len(fields) == 6 and fields[5].startswith("/"):
            if fields[5].rpartition("/")[2].startswith(_DRIVER_PREFIX):
                return True
    return False


def cuda_driver_mapped() -> bool:
    """Whether this process has loaded the CUDA driver (False where ``/proc`` says nothing)."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            return cuda_driver_loaded(f.read())
    except OSError:
        return False


@dataclass(frozen=True)
class ForkSafety:
    threads: int
    """Native threads now."""
    allowed_threads: int
    """Threads there were after importing numpy: OpenBLAS's pool, which stops itself
    around ``fork`` (``pthread_atfork``); any more were started by an import."""
    python_threads: list[str]
    cuda_initialized: bool
    """``torch.cuda.is_initialized()``."""
    process_group: bool
    thread_imports: list[str] = field(default_factory=list)
    """Modules after whose import there were more threads (``preload.thread_starters``):
    where to look when a hazard is a thread."""
    cuda_driver: bool = False
    """The CUDA driver (``libcuda.so*``) is mapped in this process, initialised or not."""
    cuda_import: str | None = None
    """The module whose import loaded the driver (``preload.cuda_driver_importer``)."""

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
        if self.cuda_driver or self.cuda_initialized:
            where = (f"while importing {self.cuda_import}" if self.cuda_import
                     else "before the fork")
            found.append(f"the CUDA driver was loaded {where}, so every forked worker's first "
                         "CUDA call would fail: move the CUDA call (for example "
                         "torch.cuda.is_available()) into main(), or set --rdzv-conf "
                         "warm_start=off")
        if self.process_group:
            found.append("a torch.distributed process group was created at import")
        return found

    def to_message(self) -> dict[str, Any]:
        return {**asdict(self), "hazards": self.hazards}


def check(allowed_threads: int, thread_imports: Sequence[str] = (),
          cuda_import: str | None = None) -> ForkSafety:
    """This process's fork hazards now; touches no device (``is_initialized`` only reads,
    the driver is looked for in ``/proc/self/maps``). ``thread_imports``: the imports to
    name if threads are a hazard; ``cuda_import``: the one to name if the driver is."""
    torch = sys.modules.get("torch")
    cuda = bool(torch is not None and torch.cuda.is_initialized())
    dist = sys.modules.get("torch.distributed")
    group = bool(dist is not None and dist.is_available() and dist.is_initialized())
    python_threads = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    return ForkSafety(threads=native_threads(), allowed_threads=allowed_threads,
                      python_threads=python_threads, cuda_initialized=cuda, process_group=group,
                      thread_imports=list(thread_imports), cuda_driver=cuda_driver_mapped(),
                      cuda_import=cuda_import)


def baseline_threads() -> int:
    """Import numpy (torch does anyway) and count: its BLAS pool is fork-aware."""
    try:
        import numpy  # noqa: F401
    except ImportError:
        pass
    return native_threads()
