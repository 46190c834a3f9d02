"""A DCP storage reader whose storage is the other ranks' memory.

DCP's load planner knows how to cut a checkpoint's saved chunks into a new world's
shards; it asks the storage for the chunks each rank needs. Here those chunks are in
host memory on the ranks that kept them (their own set, a buddy's copy, an HSDP
replica's), so ``read_data`` is collective: every rank says which chunks its plan reads,
each chunk is given a sender (``redundancy.schedule``: itself when it holds it, else
the least-loaded holder), one flat buffer moves per pair of ranks
(``shard_transfer.exchange``), and the bytes are read into the plan's tensors as
:class:`~elastic_ext.worker.snapshot.memory_storage.MemoryReader` does, narrowed where the
new world cuts a saved chunk elsewhere.

Use it with ``dcp.load(state, storage_reader=reader, no_dist=True)`` on every rank of the
group: planning stays local (no DCP collective), and the one exchange happens in
``read_data``, which DCP calls exactly once per rank.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.futures import Future

from elastic_ext.worker.snapshot.memory_storage import MemoryReader, chunk_key
from elastic_ext.worker.snapshot.redundancy import ChunkKey, schedule
from elastic_ext.worker.snapshot.shard_transfer import all_gather_objects, exchange, flat

logger = logging.getLogger("elastic_ext.worker.snapshot")  # the whole package logs under one name


class PeerReader(MemoryReader):
    """Reads a checkpoint (``metadata``) whose chunks the group's ranks hold in memory.

    ``local`` maps the chunks this rank holds to their bytes (uint8 host tensors);
    ``holdings[r]`` names the chunks rank ``r`` holds and ``lengths`` every chunk's size
    in bytes, the same on every rank (from the gathered set headers). ``moved_bytes``
    is what this rank received, once the load ran.
    """

    def __init__(self, metadata: Metadata, local: Mapping[ChunkKey, torch.Tensor], *,
                 holdings: Mapping[int, Mapping[ChunkKey, object]],
                 lengths: Mapping[ChunkKey, int],
                 group: dist.ProcessGroup | None = None) -> None:
        super().__init__(metadata, dict(local))
        self._local = dict(local)
        self._holdings = {r: set(keys) for r, keys in holdings.items()}
        self._lengths = lengths
        self._group = group
        self.moved_bytes = 0

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        me = dist.get_rank(self._group)
        wanted = sorted({chunk_key(item.storage_index) for item in plan.items})
        requests = dict(enumerate(all_gather_objects(wanted, self._group)))
        senders = schedule(requests, self._holdings, live=range(len(requests)))
        outgoing: dict[int, list[torch.Tensor]] = {}
        for receiver, chosen in senders.items():
            for key in sorted(chosen):
                if chosen[key] == me and receiver != me:
                    outgoing.setdefault(receiver, []).append(self._local[key])
        incoming: dict[int, list[ChunkKey]] = {}
        for key in sorted(senders.get(me, {})):
            sender = senders[me][key]
            if sender != me:
                incoming.setdefault(sender, []).append(key)
        received = exchange({peer: [flat(parts)] for peer, parts in outgoing.items()},
                            {peer: [sum(self._lengths[k] for k in keys)]
                             for peer, keys in incoming.items()}, group=self._group)
        chunks: dict[ChunkKey, bytes | torch.Tensor] = dict(self._local)
        for sender, keys in incoming.items():
            buffer, start = received[sender][0], 0
            for key in keys:
                chunks[key] = buffer[start:start + self._lengths[key]]
                start += self._lengths[key]
            self.moved_bytes += start
        self.chunks = chunks
        logger.debug("rank %d received %d bytes of chunks from %d ranks", me, self.moved_bytes,
                     len(incoming))
        return super().read_data(plan, planner)


__all__ = ["PeerReader"]
