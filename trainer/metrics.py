"""The trainer's ``--metrics`` file is the own-loop object's: ``elastic_ext.worker.loop.events``."""

from elastic_ext.worker.loop.events import MetricsLog

__all__ = ["MetricsLog"]
