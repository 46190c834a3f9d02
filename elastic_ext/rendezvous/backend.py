"""What a store must offer etcd-ext: torch's ``RendezvousBackend`` contract plus heartbeats.

``get_state``/``set_state`` keep torch's token semantics (see torch's
``RendezvousBackend``), so the same contract tests run on every store. State
values carry a magic prefix so garbage in the key is reported, not parsed.
"""

from __future__ import annotations

import time
from abc import abstractmethod
from collections.abc import Iterable

from torch.distributed import Store
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend, Token

from elastic_ext.rendezvous.errors import CorruptStateError

STATE_MAGIC = b"elastic-ext/1\n"


def wrap_state(state: bytes) -> bytes:
    return STATE_MAGIC + state


def parse_beat(value: bytes | None) -> tuple[int, float] | None:
    """(counter, wall time) of a heartbeat value; None for a missing, left or odd value."""
    try:
        counter, stamp = (value or b"").decode().split(":")
        return int(counter), float(stamp)
    except ValueError:
        return None


def unwrap_state(raw: bytes) -> bytes:
    if not raw.startswith(STATE_MAGIC):
        raise CorruptStateError(
            "the run's state key holds data etcd-ext did not write; another program uses this "
            "key prefix, or the value was tampered with. Use another --rdzv-id or key_prefix, "
            "or delete the key")
    return raw[len(STATE_MAGIC):]


class StoreBackend(RendezvousBackend):
    """One connection to the run's keys. Not shared between threads: ``clone`` instead."""

    @abstractmethod
    def get_state(self) -> tuple[bytes, Token] | None: ...

    @abstractmethod
    def set_state(self, state: bytes, token: Token | None = None
                  ) -> tuple[bytes, Token, bool] | None: ...

    _beats: int = 0

    def beat(self, node: str) -> None:
        """Advance ``node``'s heartbeat; the wall time in it is for operators, not for liveness."""
        self._beats += 1
        self._write_beat(node, f"{self._beats}:{time.time():.3f}".encode())

    @abstractmethod
    def _write_beat(self, node: str, value: bytes) -> None: ...

    @abstractmethod
    def remove_run(self) -> None:
        """Delete every key of the run: the job is over and everybody has left."""

    @abstractmethod
    def leave(self, node: str) -> None:
        """Mark ``node`` as gone for good, so nobody waits for its heartbeat to expire."""

    @abstractmethod
    def read_beats(self, nodes: Iterable[str]) -> dict[str, bytes | None]:
        """Each node's heartbeat value (None when it has none)."""

    @abstractmethod
    def round_store(self, generation: str, round_: int) -> Store:
        """The c10d Store the agents of one round share (rank assignment, exit barrier)."""

    @abstractmethod
    def clone(self) -> StoreBackend:
        """Another connection to the same keys, for another thread."""

    @property
    def outages_are_transient(self) -> bool:
        """Whether an unreachable store may come back (an etcd cluster) or is gone (its host died)."""
        return True

    def close(self) -> None:
        """Release connections; the default has none to release."""
