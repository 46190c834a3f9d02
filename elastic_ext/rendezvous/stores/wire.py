"""How a run's values look in a store, the same on every store: the state behind a magic
prefix (compressed when large), its head and seats, heartbeat values. Stores write and
read through these, so that garbage in a key is reported, not parsed.

Key layout of a run, relative to ``Settings.run_prefix`` (``<key_prefix>/<run_id>/``):
``state`` (the JSON state), ``head`` and ``seat/<generation>/<round>/<node>`` (what most
agents read of it, ``protocol/head.py``, where the store keeps them), ``hb/<node>``
(heartbeats), ``join/<generation>/<round>/`` (the open round's join keys,
``protocol/joins.py``), ``verdict`` (the watching node's judgement of the others,
``agent/keeper.py``) and the rounds' c10d stores.
"""

from __future__ import annotations

import time
import zlib

from elastic_ext.rendezvous.errors import CorruptStateError
from elastic_ext.rendezvous.protocol.head import Head, seats_of
from elastic_ext.rendezvous.protocol.pace import Pace
from elastic_ext.rendezvous.protocol.state import RunState, Status

STATE_KEY = "state"
HEAD_KEY = "head"  # written with the state where the store keeps heads (``head.py``)
SEAT_DIR = "seat/"  # seat/<generation>/<round>/<node>: the closed round's seats
STATE_MAGIC = b"elastic-ext/1\n"
STATE_MAGIC_ZLIB = b"elastic-ext/1z\n"  # the same, compressed: at 1,024 nodes 28 KB, not 65
_COMPRESS_FROM = 4096
_MAX_UNWRAPPED = 1 << 20  # state.MAX_STATE_BYTES: more is refused before it is parsed


def head_and_seats(state: bytes) -> tuple[bytes | None, dict[str, bytes]]:
    """What a store that keeps heads writes with ``state``: its head, and the seats of a
    closed round that runs (key: ``<generation>/<round>/<node>``, under ``SEAT_DIR``);
    (None, {}) for bytes that are no state (the head is then stored empty, so that it
    still moves with the state: readers derive it, and fail as on the state)."""
    try:
        parsed = RunState.from_bytes(state)
    except CorruptStateError:
        return None, {}
    seats = seats_of(parsed) if parsed.status is Status.ACTIVE else {}
    return Head.of(parsed).to_bytes(), {
        f"{seat.generation}/{seat.round}/{node}": seat.to_bytes() for node, seat in seats.items()}


def wrap_state(state: bytes) -> bytes:
    """The state as stored: a magic prefix, then the state, zlib-compressed when large
    (every agent receives it at every change: bytes through the store's gateway)."""
    if len(state) < _COMPRESS_FROM:
        return STATE_MAGIC + state
    return STATE_MAGIC_ZLIB + zlib.compress(state, 1)


def unwrap_state(raw: bytes) -> bytes:
    """Raises CorruptStateError for anything ``wrap_state`` did not make (never more than
    1 MiB is decompressed)."""
    if raw.startswith(STATE_MAGIC):
        return raw[len(STATE_MAGIC):]
    if raw.startswith(STATE_MAGIC_ZLIB):
        inflate = zlib.decompressobj()
        try:
            state = inflate.decompress(raw[len(STATE_MAGIC_ZLIB):], _MAX_UNWRAPPED + 1)
        except zlib.error as exc:
            raise CorruptStateError(f"the run's state key holds a damaged compressed state "
                                    f"({exc}); delete the key or use another --rdzv-id") from exc
        if len(state) > _MAX_UNWRAPPED or not inflate.eof:
            raise CorruptStateError("the run's state key holds a state over the 1 MiB limit; "
                                    "delete the key or use another --rdzv-id")
        return state
    raise CorruptStateError(
        "the run's state key holds data etcd-ext did not write; another program uses this "
        "key prefix, or the value was tampered with. Use another --rdzv-id or key_prefix, "
        "or delete the key")


def heartbeat_value(counter: int, presence_port: int | None = None,
                    pace: Pace | None = None) -> bytes:
    """``counter:wall time[:presence port[:pace]]``: the wall time is for operators
    (``elastic-ext status``), never for liveness, which watches the counter; the port is
    where this agent listens (``presence``), empty when it listens nowhere but a pace
    follows; the pace is its workers' (``protocol/pace.py``), once they report steps. A
    job's nodes run one version of etcd-ext: an older one reads no presence port in a
    value with a pace."""
    value = f"{counter}:{time.time():.3f}"
    if presence_port is None and pace is None:
        return value.encode()
    value = f"{value}:{'' if presence_port is None else presence_port}"
    return (value if pace is None else f"{value}:{pace.to_text()}").encode()


def parse_beat(value: bytes | None) -> tuple[int, float] | None:
    """(counter, wall time) of a heartbeat value; None for a missing, left or odd value."""
    try:
        counter, stamp, *_ = (value or b"").decode().split(":")
        return int(counter), float(stamp)
    except ValueError:
        return None


def presence_port_of(value: bytes | None) -> int | None:
    """The presence port a heartbeat value names, if any."""
    parts = (value or b"").decode(errors="replace").split(":")
    if len(parts) not in (3, 4) or not parts[2].isdigit() or not 0 < int(parts[2]) < 65536:
        return None
    return int(parts[2])


def pace_of(value: bytes | None) -> Pace | None:
    """The pace a heartbeat value carries, if any."""
    parts = (value or b"").decode(errors="replace").split(":")
    return Pace.from_text(parts[3]) if len(parts) == 4 else None
