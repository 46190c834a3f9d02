"""Make etcd-ext's log lines visible inside torchrun, like torch's own.

torchrun configures only torch's loggers (level from ``LOGLEVEL``); without this
an operator would never see why a round was opened or a node declared dead.
Applied once, only when nobody configured the ``elastic_ext`` logger.
"""

from __future__ import annotations

import logging
import os

_FORMAT = "%(levelname).1s%(asctime)s %(process)d %(name)s] %(message)s"


def configure_for_torchrun() -> None:
    package = logging.getLogger("elastic_ext")
    if package.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%m%d %H:%M:%S"))
    package.addHandler(handler)
    package.setLevel(os.environ.get("LOGLEVEL", "INFO").upper())
    package.propagate = False
