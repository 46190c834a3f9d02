"""Who this process is in ``torch.distributed``, with or without a process group.

The snapshot hook and the preemption guard both run in scripts that may or may not
have called ``init_process_group``; these answer for both cases in one place.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """The global rank, 0 without a process group."""
    return dist.get_rank() if _initialized() else 0


def world_size() -> int:
    """The number of ranks, 1 without a process group."""
    return dist.get_world_size() if _initialized() else 1


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where a tensor for a collective on ``group`` must live: the current GPU under NCCL."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


__all__ = ["collective_device", "rank", "world_size"]
