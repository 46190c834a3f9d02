"""Random number generator states, captured into a snapshot and restored from one.

Kept in types that ``torch.load(weights_only=True)`` accepts (tensors, tuples, ints,
strings), so a snapshot never needs unpickling of arbitrary objects.

Every rank's states travel in a disk snapshot (``gather_rng``: a few KB per rank,
gathered to rank 0 at each commit), so per-rank dropout or augmentation streams stay
apart. A restore at the same world size gives each rank its own
(``restore_rank_rng``). At another world size old ranks do not map onto new ones: each
rank's generators are seeded from a hash of the step, its rank and rank 0's saved
torch state, so the streams are distinct per rank and reproducible for the same run.
Snapshots from before this format hold one state, restored on every rank.

In the hand-off (a step kept in node memory, ``local.py``), each worker keeps its own
generators beside the node's copy of the state, under its local rank
(``keep_worker_rng``): the next worker in the same slot of that node continues the same
streams, whatever global rank it gets (``continue_worker_rng``); a worker with no such
file (a new node, or a slot whose node died) is seeded from the step, its rank and the
run's id, as after a disk restore at another world size. The kept state itself carries
no RNG: every rank that keeps a step must write the same bytes.
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from elastic_ext.worker.distributed import rank, world_size

logger = logging.getLogger("elastic_ext.worker.snapshot")  # the whole package logs under one name


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


RANKS_KEY = "ranks"


def gather_rng() -> dict[str, Any] | None:
    """Every rank's :func:`capture_rng` on rank 0 (``{"ranks": [...]}``), None on the others.
    Collective when distributed: call it on every rank."""
    mine = capture_rng()
    if world_size() == 1:
        return {RANKS_KEY: [mine]}
    gathered: list[Any] | None = [None] * world_size() if rank() == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    return {RANKS_KEY: gathered} if gathered is not None else None


def reseed(step: int, rank_: int, anchor: torch.Tensor) -> int:
    """A seed for ``rank_`` at ``step``, derived from ``anchor`` (rank 0's saved torch
    state); torch (CPU and CUDA), numpy and python are seeded with it."""
    digest = hashlib.sha256(f"elastic-ext rng {step} {rank_}".encode()
                            + anchor.numpy().tobytes()).digest()
    seed = int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)
    torch.manual_seed(seed)
    np.random.seed(seed % (1 << 32))
    random.seed(seed)
    return seed


def restore_rank_rng(saved: Mapping[str, Any], step: int) -> None:
    """This rank's generators from what a snapshot holds (see the module docstring)."""
    ranks = saved.get(RANKS_KEY)
    if ranks is None:  # one state, from before per-rank states
        restore_rng(saved)
        return
    if len(ranks) == world_size():
        restore_rng(ranks[rank()])
        return
    reseed(step, rank(), ranks[0]["torch"])
    if rank() == 0:
        logger.info("the snapshot's RNG states are of %d ranks, this run has %d: each rank's "
                    "generators were seeded from the step and its rank", len(ranks),
                    world_size())


def _worker_file(directory: Path, step: int, local_rank: int) -> Path:
    return directory / f"rng-{step:010d}-local{local_rank}.pt"


def keep_worker_rng(directory: Path, step: int, local_rank: int) -> None:
    """Keep this worker's generators beside the node's copy of ``step`` (a few KB; written
    whole, then renamed), and drop the files of other steps this slot kept."""
    path = _worker_file(directory, step, local_rank)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    try:
        torch.save(capture_rng(), tmp)
        os.replace(tmp, path)
        for old in directory.glob(f"rng-*-local{local_rank}.pt"):
            if old != path:
                old.unlink(missing_ok=True)
    except OSError as exc:  # the node's memory is full or gone: the restore reseeds
        logger.warning("could not keep the RNG states with step %d: %s", step, exc)
        tmp.unlink(missing_ok=True)


def continue_worker_rng(directory: Path | None, step: int, local_rank: int, rank_: int,
                        run_id: str) -> bool:
    """After a hand-off restore of ``step``: continue the generators the worker of this
    slot kept with that step (True), or seed them from the step, ``rank_`` and ``run_id``
    (False)."""
    path = _worker_file(directory, step, local_rank) if directory is not None else None
    if path is not None and path.is_file():
        try:
            restore_rng(torch.load(path, weights_only=True))
            return True
        except Exception as exc:  # a damaged file: seeded instead, said so
            logger.warning("the RNG states kept with step %d are unreadable (%s): seeding "
                           "them from the step and the rank", step, exc)
    reseed(step, rank_, torch.tensor(list(run_id.encode() or b"-"), dtype=torch.uint8))
    return False


__all__ = ["RANKS_KEY", "capture_rng", "continue_worker_rng", "gather_rng", "keep_worker_rng",
           "reseed", "restore_rank_rng", "restore_rng"]
