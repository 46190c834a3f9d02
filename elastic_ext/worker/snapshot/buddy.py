"""Each rank's shard set copied to host memory on the next node, in the background.

Without replicas across nodes (FSDP2 on a 1-D mesh), a node's loss would lose its
shards; so every rank sends its set to its keeper ``LOCAL_WORLD_SIZE`` ranks ahead
(``redundancy.keeper``: the next node, a ring) and keeps the set of the rank behind it.
The copy is double-buffered and runs beside training:

1. ``next_buffer`` waits for the copy in flight (raising its failure: a peer's fault),
   and hands back the host buffer of the older of the two sets this rank last sent;
   that set is no longer one it can keep.
2. The caller captures the new step into it (the only copy the training thread makes).
3. ``start`` sends it on a gloo group of its own (one header and one flat buffer per
   pair, in bounded pieces) and receives the set it keeps: before it returns, or on a
   thread of its own.
4. ``kept`` lists what a keep writes to node memory: the two sets last sent (the one in
   flight included) and the last two received.

A step is whole in memory once the copy of it has arrived; a restore takes the newest
whole step (``shard_agreement``). Copied before the step-boundary agreement and waited
for, no finished step is ever trained again; in the background, the training thread
only waits for the previous copy and makes the capture, and a node that dies while the
last copy is in flight costs that one step, trained again.
"""

from __future__ import annotations

import json
import logging
import threading
from concurrent.futures import Future

import torch
import torch.distributed as dist

from elastic_ext.worker.snapshot.redundancy import keepers
from elastic_ext.worker.snapshot.shard_transfer import exchange
from elastic_ext.worker.snapshot.shards import ShardSet, header_of

logger = logging.getLogger("elastic_ext.worker.snapshot")  # the whole package logs under one name

_LEN = 8


class BuddyCopies:
    """This rank's part of the ring of copies; see the module docstring for the order."""

    def __init__(self, rank: int, world_size: int, ranks_per_node: int,
                 group: dist.ProcessGroup | None) -> None:
        ring = keepers(world_size, ranks_per_node)
        self.keeper = ring[rank].rank
        self.keeps_for = [r for r, k in enumerate(ring) if k.rank == rank]
        self.buffers: list[torch.Tensor | None] = [None, None]
        self._group = group
        self._lock = threading.Lock()
        self._sent: list[ShardSet] = []
        self._held: dict[int, list[ShardSet]] = {}
        self._inflight: Future[None] | None = None

    def next_buffer(self) -> int:
        """Wait for the copy in flight and free the older slot; its index in ``buffers``.

        Raises:
            Exception: the copy in flight failed (a peer died or hung).
        """
        self.wait()
        with self._lock:
            newest = self._sent[-1].buffer.data_ptr() if self._sent else None
            first = self.buffers[0]
            slot = 1 if first is not None and first.data_ptr() == newest else 0
            base = self.buffers[slot]
            self._sent = [s for s in self._sent
                          if base is None or s.buffer.data_ptr() != base.data_ptr()]
        return slot

    def start(self, shards: ShardSet, *, background: bool) -> None:
        """Send ``shards`` (captured into ``buffers[next_buffer()]``) to the keeper and
        receive the sets this rank keeps: done when this returns, or with ``background``
        on a thread of its own (the next ``next_buffer`` or ``wait`` waits for it).

        Raises:
            Exception: not in the background, the copy failed (a peer died or hung).
        """
        with self._lock:
            self._sent = [*self._sent[-1:], shards]
        future: Future[None] = Future()
        self._inflight = future
        if not background:
            self._copy(shards, future)
            self.wait()
            return
        threading.Thread(target=self._copy, args=(shards, future), name="buddy-copy",
                         daemon=True).start()

    def wait(self) -> None:
        """Until the copy in flight is done; raises its failure."""
        inflight, self._inflight = self._inflight, None
        if inflight is not None:
            inflight.result()

    def kept(self) -> list[ShardSet]:
        """The sets a keep writes beside this rank's own live one."""
        with self._lock:
            return [*self._sent, *(h for held in self._held.values() for h in held)]

    def _copy(self, shards: ShardSet, future: Future[None]) -> None:
        try:
            head = torch.frombuffer(bytearray(json.dumps(shards.header()).encode()),
                                    dtype=torch.uint8)
            sizes = exchange({self.keeper: [torch.tensor([head.numel(), shards.nbytes],
                                                         dtype=torch.int64).view(torch.uint8)]},
                             {r: [2 * _LEN] for r in self.keeps_for}, group=self._group)
            lengths = {r: [int(v) for v in sizes[r][0].view(torch.int64)]
                       for r in self.keeps_for}
            received = exchange({self.keeper: [head, shards.buffer]}, lengths,
                                group=self._group)
            with self._lock:
                for owner in self.keeps_for:
                    head_in, body = received[owner]
                    copy = header_of(json.loads(head_in.numpy().tobytes()), body)
                    older = [h for h in self._held.get(owner, []) if h.step != copy.step]
                    self._held[owner] = [*older[-1:], copy]
        except BaseException as exc:  # handed to the training thread at its next copy
            future.set_exception(exc)
            return
        future.set_result(None)


__all__ = ["BuddyCopies"]
