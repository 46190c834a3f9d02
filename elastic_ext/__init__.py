"""elastic-ext: fault-tolerant rendezvous and state snapshots for torchrun."""

__version__ = "0.1.0"
