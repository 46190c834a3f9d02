"""The contract between etcd-ext and a store: everything the handler, the keeper and the
operator commands do with one. Nothing reaches past it.

``get_state``/``set_state`` keep the token semantics of torch's ``RendezvousBackend``
(``torch/distributed/elastic/rendezvous/dynamic_rendezvous.py``), so the same contract
tests (``tests/test_backend_contract.py``) run on every store, the in-memory test double
included. How values look in the store, and the key layout, is ``wire.py``.

Raises: unless a method says otherwise, every method that talks to the store raises
:class:`~elastic_ext.rendezvous.errors.StoreUnavailableError` when no endpoint answered
within ``connect_timeout`` and :class:`~elastic_ext.rendezvous.errors.StoreAuthError` when
the store refused the credentials or certificate (retrying will not help).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from torch.distributed import Store

from elastic_ext.rendezvous.protocol.clock import Clock
from elastic_ext.rendezvous.protocol.head import head_bytes_of, seat_of, seats_of
from elastic_ext.rendezvous.protocol.pace import Pace
from elastic_ext.rendezvous.protocol.state import RunState

Token = Any
"""Opaque to the caller: what ``get_state`` returned, handed back to ``set_state``."""

STATE_POLL_S = 0.05
"""How often ``StoreBackend.wait_for_state`` looks at a store that cannot notify."""


def poll_until(done: Callable[[], bool], timeout: float, clock: Clock) -> bool:
    """``done()`` every ``STATE_POLL_S`` until it holds (True) or about ``timeout`` seconds of
    ``clock`` passed (False): the waits of a store that cannot notify. A ``done`` that
    raises counts as done: the caller's next read says what is wrong."""
    deadline = clock.monotonic() + timeout
    while True:
        try:
            if done():
                return True
        except Exception:  # the caller's next read says what is wrong
            return True
        if clock.monotonic() >= deadline:
            return False
        clock.sleep(min(STATE_POLL_S, max(0.0, deadline - clock.monotonic())))


@dataclass(frozen=True)
class KeeperRead:
    """What a keeper reads each tick: the state's version, some heartbeats, the verdict."""

    state_version: object | None
    beats: dict[str, bytes | None]
    verdict: bytes | None


class StateDocument(ABC):
    """The run's state: one JSON document, written only by compare-and-swap, and what
    a store may keep beside it to be read cheaply (its version, its head, the closed
    round's seats). torch's ``RendezvousBackend`` is this contract's first two methods.

    Raises what every store method raises (the module's docstring), unless a method
    says otherwise.
    """

    @abstractmethod
    def get_state(self) -> tuple[bytes, Token] | None:
        """The run's state and its token, or None if the run has no state.

        Raises:
            CorruptStateError: the state key holds something etcd-ext did not write.
        """

    @abstractmethod
    def set_state(self, state: bytes, token: Token | None = None
                  ) -> tuple[bytes, Token, bool] | None:
        """Compare-and-swap the run's state.

        Writes ``state`` if ``token`` is the current state's token, or if ``token`` is
        None and there is no state yet. Returns ``(state, token, True)`` after writing,
        ``(current state, its token, False)`` when someone else wrote first (a stale,
        unknown or missing token), and None if the state vanished in between.

        Raises:
            CorruptStateError: the state key holds something etcd-ext did not write.
        """

    @abstractmethod
    def state_version(self) -> object | None:
        """A value that changes whenever the state is written, read without the state
        itself (a few bytes, whatever the job's size); None when the run has no state.
        Only compared with other values of this method, never used as a token."""

    def state_after(self, version: object | None) -> tuple[bytes, Token] | None:
        """The state as of ``version`` (what ``state_version`` or ``keeper_read`` gave) or
        newer, and its token; None when there is none. A store may answer from what it
        read last (etcd, when that is the version asked for); this default reads it."""
        return self.get_state()

    def wait_for_state(self, token: Token | None, timeout: float, clock: Clock
                       ) -> bool | tuple[bytes, Token]:
        """Wait until the state's token differs from ``token`` (what ``get_state`` or
        ``set_state`` gave; None: there was no state): then the new state and its token
        when the wait brought them along, else True; False after about ``timeout`` seconds
        of ``clock``. Stores that notify wake at the change (etcd: a watch of the head,
        which never brings the state); this default reads the state every
        ``STATE_POLL_S``. Never raises for an
        unreachable store: it returns True and the caller's next read reports it."""
        def changed() -> bool:
            current = self.get_state()
            return (current[1] if current is not None else None) != token
        return poll_until(changed, timeout, clock)

    def on_state_change(self, callback: Callable[[], None]) -> None:  # noqa: B027
        """Have ``callback`` called, on another thread, after each state write this agent
        learns of without a request (etcd's watch of the head, the embedded store's write
        feed; a backend and its clones share one), so that the keeper acts on a change when
        it happens, not at its next tick. ``callback`` must return at once. Stores that
        cannot notify never call it (the default). Never raises."""

    @property
    def keeps_heads(self) -> bool:
        """Whether the store keeps the state's head and the closed rounds' seats as keys of
        their own, written with the state (etcd): an agent then follows a round change in a
        few bytes (``head.py``) and the rendezvous decides on them where it can. Otherwise
        ``head_after`` and ``read_seat`` derive both from the whole state."""
        return False

    def head_after(self, version: object | None) -> tuple[bytes, Token] | None:
        """The state's head (``head.Head``) as of ``version`` (what ``state_version`` or
        ``keeper_read`` gave; None: the newest) or newer, with the state's token; None when
        the run has no state. Stores that keep heads answer from their watch of it; this
        default derives it from ``state_after``.

        Raises:
            CorruptStateError: the state key holds something etcd-ext did not write.
        """
        current = self.state_after(version)
        return None if current is None else (head_bytes_of(current[0]), current[1])

    def read_seat(self, generation: str, round_: int, node: str) -> bytes | None:
        """``node``'s seat (``head.Seat``) in the closed round, as its closer wrote it before
        the closing write; None if it has none. Trust it only under a head with its seal
        (a close that lost its compare-and-swap may leave seats). This default derives it
        from the state.

        Raises:
            CorruptStateError: the state key holds something etcd-ext did not write.
        """
        current = self.get_state()
        seat = None if current is None else seat_of(RunState.from_bytes(current[0]), node)
        return seat.to_bytes() if seat is not None and \
            (seat.generation, seat.round) == (generation, round_) else None

    def read_seats(self, generation: str, round_: int) -> list[tuple[str, bytes]]:
        """Every seat of the closed round as (node, seat), in no order: the round's nodes
        and where they are, for a node that knows its round only by its own seat and must
        probe the others (O(N) bytes: only after a round that failed or made no progress).
        Stores that keep seats read them all, including any a lost close left (compare
        the seal); this default derives them from the state, while it is that round's.

        Raises:
            CorruptStateError: the state key holds something etcd-ext did not write.
        """
        current = self.get_state()
        state = None if current is None else RunState.from_bytes(current[0])
        if state is None or (state.generation, state.round) != (generation, round_):
            return []
        return [(node, seat.to_bytes()) for node, seat in seats_of(state).items()]


class JoinBook(ABC):
    """An open round's join entries: one key per node under the round's prefix, counted
    and waited on without being read.

    Raises what every store method raises (the module's docstring), unless a method
    says otherwise.
    """

    @abstractmethod
    def join(self, generation: str, round_: int, node: str, entry: bytes) -> int:
        """Write ``node``'s join entry (``joins.JoinEntry``) under the open round: one
        write, whatever the job's size; writing it again replaces it. Returns how many
        nodes have joined the round so far, this one included."""

    @abstractmethod
    def count_joins(self, generation: str, round_: int) -> int:
        """How many join entries the round has, read without them (a few bytes)."""

    def wait_for_joins(self, generation: str, round_: int, at_least: int, timeout: float,
                       clock: Clock) -> bool:
        """Wait until the round's ``count_joins`` is ``at_least`` or more: True when it
        is, False after about ``timeout`` seconds of ``clock``. The closer of an open round
        waits here between its decisions. Stores that notify wake at the join (etcd: a
        watch of the round's join keys, from which ``count_joins`` and ``read_joins`` of
        that round are then answered without a request; the embedded store: a wait on the
        key the next join creates); this default reads the count every ``STATE_POLL_S``.
        Never raises: it returns True and the caller's next read reports the store."""
        return poll_until(lambda: self.count_joins(generation, round_) >= at_least, timeout,
                          clock)

    @abstractmethod
    def read_joins(self, generation: str, round_: int) -> list[tuple[str, bytes]]:
        """The round's join entries as (node, entry), in the order the nodes joined."""

    @abstractmethod
    def drop_joins(self, generation: str, round_: int, nodes: Iterable[str]) -> None:
        """Delete ``nodes``' join entries of the round (dead or left out of it)."""


class Heartbeats(ABC):
    """Each agent's heartbeat (its session in the run) and the watching node's verdict on
    the others.

    Raises what every store method raises (the module's docstring), unless a method
    says otherwise.
    """

    @property
    def heartbeats_expire(self) -> bool:
        """Whether a heartbeat key lives only as long as its agent renews it (etcd: it hangs
        on the agent's lease, and etcd deletes it a TTL after the last keep-alive): its
        presence is the heartbeat, and its value moves only when the agent announces itself
        anew. False: the value is a counter that ``beat`` moves and the keeper must see
        move (``liveness.Liveness``)."""
        return False

    @abstractmethod
    def beat(self, node: str, presence_port: int | None = None, pace: Pace | None = None
             ) -> None:
        """Advance ``node``'s heartbeat: store ``heartbeat_value`` of a counter that moves
        at every call, of ``presence_port`` and of its workers' ``pace`` (on etcd the key
        expires with this agent's lease, which ``keeper_read`` renews)."""

    @abstractmethod
    def leave(self, node: str) -> None:
        """Mark ``node`` as gone for good (its heartbeat becomes ``liveness.LEFT``) so that nobody
        waits for its heartbeat to expire."""

    @abstractmethod
    def read_beats(self, nodes: Iterable[str]) -> dict[str, bytes | None]:
        """Each of ``nodes``' heartbeat value, None for a node that has none."""

    @abstractmethod
    def write_verdict(self, verdict: bytes) -> None:
        """Store the watching node's verdict (``keeper.Verdict``), replacing the last."""

    @abstractmethod
    def read_verdict(self) -> bytes | None:
        """The last verdict written, or None."""


class RoundStores(ABC):
    """The c10d stores that torch's agent uses after a round closed (rank assignment, exit
    barrier), one per round.

    Raises what every store method raises (the module's docstring), unless a method
    says otherwise.
    """

    @abstractmethod
    def round_store(self, generation: str, round_: int) -> Store:
        """The c10d ``Store`` the agents of one round share (torch's rank assignment and
        exit barrier). Its operations raise what torch's stores raise."""

    @abstractmethod
    def drop_round_stores(self, generation: str, keep_from_round: int) -> None:
        """Delete the round stores of other generations and of rounds before
        ``keep_from_round``; a store that cannot enumerate keys keeps them for its life."""


class StoreBackend(StateDocument, JoinBook, Heartbeats, RoundStores):
    """One connection to one run's keys, as the four contracts above on one connection,
    the way etcd's Go client embeds its ``KV``, ``Lease`` and ``Watcher`` interfaces: a
    collaborator that needs one of them is typed against that one. Not shared between
    threads: ``clone`` instead.

    Raises what every store method raises (the module's docstring), unless a method
    says otherwise.
    """

    @property
    @abstractmethod
    def name(self) -> str:
        """The kind of store, for logs and events: ``etcd-v3`` or ``c10d-embedded``."""

    @property
    def outages_are_transient(self) -> bool:
        """Whether an unreachable store may come back (an etcd cluster, whose members
        recover or stand in for each other) or is gone for good (the embedded store died
        with the agent that hosted it)."""
        return True

    @property
    def hosts_store(self) -> bool:
        """Whether this agent's own process serves the store (the embedded store's host)."""
        return False

    def keeper_read(self, node: str, presence_port: int | None,
                    watched: Sequence[str], due: bool = True, pace: Pace | None = None
                    ) -> KeeperRead:
        """One keeper tick's store work: ``beat``, then read ``state_version``, the
        heartbeats of ``watched`` and the verdict. ``due``: False for a tick woken before
        its time (a state change, a verdict), which a store may answer without a request.
        Stores that can do better override it (etcd: the version and the verdict from
        watches, so that a write made moments before shows once the watch delivered it,
        milliseconds; a tick not due reuses the heartbeats last read and beats at the next;
        with ``heartbeat_mode=lease`` a keep-alive every third of its TTL and the heartbeats
        from a watch too, the value put anew only when the pace moved)."""
        self.beat(node, presence_port, pace)
        return KeeperRead(self.state_version(), self.read_beats(watched), self.read_verdict())

    @abstractmethod
    def remove_run(self) -> None:
        """Delete every key of the run: the job is over and everybody has left."""

    @abstractmethod
    def list_runs(self) -> list[str]:
        """The run ids that have keys under this backend's key prefix, sorted.

        Raises:
            ConfigError: the store cannot enumerate keys (the embedded store).
        """

    @abstractmethod
    def clone(self) -> StoreBackend:
        """Another connection to the same keys, for another thread."""

    def close(self) -> None:  # noqa: B027 - an optional hook, not a required method
        """Release this connection; the default has nothing to release. Never raises."""
