"""Your own training loop with what the bundled trainer has: ``ElasticLoop``.

``elastic_loop`` holds the object (and ``FrameworkHooks``, its ``framework``), ``data``
the exactly-once data order at any world size, ``metrics_file`` the JSON-lines metrics
file the chaos harness and outside checks read.
"""

from elastic_ext.worker.loop.data import DataPosition
from elastic_ext.worker.loop.elastic_loop import (
    ElasticLoop,
    EventHook,
    FrameworkHooks,
    LoopSettings,
)
from elastic_ext.worker.loop.metrics_file import MetricsLog

__all__ = ["DataPosition", "ElasticLoop", "EventHook", "FrameworkHooks", "LoopSettings",
           "MetricsLog"]
