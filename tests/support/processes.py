"""Tests use the product's own process handling (``elastic_ext.local.processes``)."""

from elastic_ext.local.processes import Proc, ProcessSet, signal_pids, tagged_pids, wait_until

__all__ = ["Proc", "ProcessSet", "signal_pids", "tagged_pids", "wait_until"]
