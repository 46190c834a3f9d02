"""Who this process is in ``torch.distributed``, with or without a process group.

The snapshot hook and the preemption guard both run in scripts that may or may not
have called ``init_process_group``; these answer for both cases in one place.
"""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Mapping
from typing import Literal

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

NCCL_ASYNC_ERROR_HANDLING = "2"
"""``TORCH_NCCL_ASYNC_ERROR_HANDLING`` for workers under etcd-ext: CleanUpOnly.

torch defines the modes in ``torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp``
(``enum ErrorHandlingMode``: NoHandling 0, TearDown 1, CleanUpOnly 2, SkipCleanUp 3), and
torchrun gives every worker 1 unless its own environment says otherwise
(``torch/distributed/elastic/agent/server/local_elastic_agent.py``). TearDown kills the
process when a collective fails or times out, so the worker could neither keep its step
for the others nor report the fault to its agent and hold. CleanUpOnly aborts the
communicators and raises the failure in the training thread, where the guard catches it.
"""

DeviceChoice = Literal["auto", "cpu", "cuda"]
BackendChoice = Literal["auto", "nccl", "gloo"]


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


def choose_device(device: DeviceChoice = "auto", local_rank: int | None = None) -> torch.device:
    """``cuda:LOCAL_RANK`` when asked or (``auto``) when a GPU is there, else the CPU;
    ``local_rank`` defaults to torchrun's ``LOCAL_RANK``.

    Raises:
        ValueError: ``cuda`` asked for without a GPU, or fewer GPUs than local ranks.
    """
    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    count = torch.cuda.device_count()
    if count == 0:
        raise ValueError("--device cuda needs a GPU and this machine has none: use "
                         "--device cpu (or auto)")
    if local_rank >= count:
        raise ValueError(f"LOCAL_RANK {local_rank} has no GPU of its own ({count} visible): "
                         f"start at most {count} workers per node (--nproc-per-node)")
    return torch.device("cuda", local_rank)


FLIGHT_RECORDER_DIR_ENV = "ELASTIC_EXT_FLIGHT_RECORDER_DIR"
"""Where NCCL ranks dump their flight recorder (default: none, the recorder stays off)."""


def flight_recorder_env(environ: Mapping[str, str]) -> dict[str, str]:
    """What turns on torch's NCCL flight recorder for a hang's post-mortem, when
    ``ELASTIC_EXT_FLIGHT_RECORDER_DIR`` names a directory (shared, or collected per node):
    each rank keeps its last 2,000 collectives and dumps them, with their sequence numbers,
    when a collective times out; ``torchfrtrace DIR`` then names the rank that stopped
    issuing them (docs/failure-model.md). Settings the user made win (``setdefault``)."""
    directory = environ.get(FLIGHT_RECORDER_DIR_ENV)
    if not directory:
        return {}
    return {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
            "TORCH_FR_DUMP_TEMP_FILE": f"{directory.rstrip('/')}/rank_"}


def init_process_group(*, timeout_s: float, device: torch.device,
                       backend: BackendChoice = "auto", store: dist.Store | None = None,
                       rank: int | None = None, world_size: int | None = None) -> str:
    """Create the default process group for ``device`` the way etcd-ext's recovery needs it;
    the backend's name.

    ``auto`` is NCCL on a GPU and gloo on the CPU. Under NCCL the environment gets
    ``NCCL_ASYNC_ERROR_HANDLING`` (set before the group exists, the only time NCCL reads
    it) and ``device`` becomes the current device. ``timeout_s`` bounds every collective:
    a silent peer makes the waiting collective fail after it, in the training thread
    with either backend (gloo raises itself; NCCL through the watchdog's abort), instead
    of torch's 10-minute NCCL default. gloo also works on CUDA tensors (slower; useful to
    run several ranks on one GPU); NCCL needs one GPU per rank.
    """
    name = ("nccl" if device.type == "cuda" else "gloo") if backend == "auto" else backend
    if name == "nccl":
        if device.type != "cuda":
            raise ValueError("--backend nccl needs --device cuda (NCCL moves GPU tensors only)")
        previous = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
        if previous not in (None, NCCL_ASYNC_ERROR_HANDLING):
            logger.debug("TORCH_NCCL_ASYNC_ERROR_HANDLING %s -> %s (etcd-ext recovery)",
                         previous, NCCL_ASYNC_ERROR_HANDLING)
        os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = NCCL_ASYNC_ERROR_HANDLING
        for key, value in flight_recorder_env(os.environ).items():
            os.environ.setdefault(key, value)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        dist.init_process_group(name, timeout=timeout)
    else:
        dist.init_process_group(name, store=store, rank=rank if rank is not None else 0,
                                world_size=world_size if world_size is not None else 1,
                                timeout=timeout)
    return name


__all__ = ["FLIGHT_RECORDER_DIR_ENV", "NCCL_ASYNC_ERROR_HANDLING", "choose_device",
           "collective_device", "flight_recorder_env", "init_process_group", "rank",
           "world_size"]
