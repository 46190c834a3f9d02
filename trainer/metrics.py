"""The trainer's ``--metrics`` file is the own-loop object's: ``elastic_ext.loop.events``."""

from elastic_ext.loop.events import MetricsLog

__all__ = ["MetricsLog"]
