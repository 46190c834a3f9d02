"""Random number generator states, captured into a snapshot and restored from one.

Kept in types that ``torch.load(weights_only=True)`` accepts (tensors, tuples, ints,
strings), so a snapshot never needs unpickling of arbitrary objects.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

logger = logging.getLogger("elastic_ext.snapshot")  # the whole package logs under one name


def capture_rng() -> dict[str, Any]:
    """RNG states of torch (CPU and CUDA), numpy and python, in types ``weights_only`` loads."""
    np_state = np.random.get_state(legacy=True)
    assert isinstance(np_state, tuple)  # legacy=True: the tuple form of numpy's MT19937
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": (str(np_state[0]), torch.from_numpy(np.asarray(np_state[1], dtype=np.int64)),
                  int(np_state[2]), int(np_state[3]), float(np_state[4])),
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: Mapping[str, Any]) -> None:
    """Set the generators to what :func:`capture_rng` returned (CUDA only on as many devices)."""
    # Copies: a state loaded from a received buffer is a view into it, which the
    # generators' setters do not accept (torch 2.13 crashes on one).
    torch.set_rng_state(state["torch"].clone())
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        cuda_states = [s.clone() for s in state["cuda"]]
        if len(cuda_states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda_states)
        else:
            logger.warning("not restoring CUDA RNG: snapshot has %d devices, this process sees %d",
                           len(cuda_states), torch.cuda.device_count())


__all__ = ["capture_rng", "restore_rng"]
