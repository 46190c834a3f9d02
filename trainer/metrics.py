"""The trainer's ``--metrics`` file is the own-loop object's:
``elastic_ext.worker.loop.metrics_file``."""

from elastic_ext.worker.loop.metrics_file import MetricsLog

__all__ = ["MetricsLog"]
