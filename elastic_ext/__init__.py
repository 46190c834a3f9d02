"""elastic-ext: fault-tolerant rendezvous and state snapshots for torchrun.

``from elastic_ext import ElasticLoop, LoopSettings`` for your own training loop
(``elastic_ext.worker.loop``); imported on first use, so the rendezvous plugin that torchrun
loads does not pay for it.
"""

from __future__ import annotations

from typing import Any

from elastic_ext import _moved

__version__ = "0.1.0"

_moved.install()  # the import paths of before the layout by process still work

_LAZY = {"ElasticLoop": "elastic_ext.worker.loop", "LoopSettings": "elastic_ext.worker.loop"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'elastic_ext' has no attribute {name!r}")


__all__ = ["ElasticLoop", "LoopSettings", "__version__"]
