"""Import paths users' code may hold from before the package was laid out by process
(``elastic_ext.snapshot`` is now ``elastic_ext.worker.snapshot``, and so on): they still
import, as the same module objects, with a ``DeprecationWarning`` naming the new path.

A meta path finder rather than stub files, so that the top level holds only what is
there now, and every submodule (``elastic_ext.snapshot.hook``) follows its package.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from collections.abc import Sequence
from types import ModuleType

MOVED = {
    "elastic_ext.snapshot": "elastic_ext.worker.snapshot",
    "elastic_ext.preemption": "elastic_ext.worker.preemption",
    "elastic_ext.loop": "elastic_ext.worker.loop",
    "elastic_ext.loop.events": "elastic_ext.worker.loop.metrics_file",
    "elastic_ext.distributed": "elastic_ext.worker.distributed",
    "elastic_ext.hold": "elastic_ext.worker.hold",
    "elastic_ext.plugin": "elastic_ext.agent.plugin",
    "elastic_ext.cli": "elastic_ext.ops.cli",
}
"""Old module path -> new one, for the paths the README and docs named before."""


def new_name(old: str) -> str | None:
    """Where ``old`` (a moved module or one inside a moved package) lives now; the longest
    old path that names it wins (``elastic_ext.loop.events`` was renamed as it moved)."""
    for before, after in sorted(MOVED.items(), key=lambda item: -len(item[0])):
        if old == before or old.startswith(before + "."):
            return after + old[len(before):]
    return None


class _Alias(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target
        self.real_spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(f"{spec.name} moved to {self.target}: import it from there",
                      DeprecationWarning, stacklevel=2)
        real = importlib.import_module(self.target)
        self.real_spec = real.__spec__
        return real

    def exec_module(self, module: ModuleType) -> None:
        # The import system gave the real module the alias' spec: give its own back.
        module.__spec__ = self.real_spec


class MovedFinder(importlib.abc.MetaPathFinder):
    """Finds the old paths in ``MOVED`` and nothing else."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        target_name = new_name(fullname)
        if target_name is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Alias(target_name))


def install() -> None:
    """Register the finder once per process (``elastic_ext/__init__.py`` does), first:
    the path finder would load ``elastic_ext.snapshot.hook`` from the real package's
    ``__path__`` as a second copy of the module."""
    if not any(isinstance(finder, MovedFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, MovedFinder())
