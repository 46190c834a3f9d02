"""Where the embedded store lives when it has several candidate hosts, and how it moves.

**Several endpoints** (``c10d://node1:29400,node2:29400,node3:29400``) are candidate
hosts, in order, and the store survives its host. The rule:

* *Whose entry.* A node may host the entries that name it: an entry equal to its
  ``--local-addr``, or one that is one of its host names or addresses (a loopback entry
  only when no ``--local-addr`` is given or it equals it, so that one machine can play
  several nodes). ``is_host=false`` and the operator commands host nothing.
* *Finding the store* (at start, and when the current one is gone): every entry is
  probed as a client. Of stores holding this run's state the highest ``store_term``
  wins (the term is raised by one at every move), then the earlier entry; failing that,
  the first entry that answers at all (a fresh store at the start of a job). A node
  hosts only when no entry answers: its first own entry in search order, once every
  entry ahead of it has refused connections for ``grace`` seconds
  (``2 * heartbeat_interval + 1``, at most half ``connect_timeout``: time for the live
  owner of an earlier entry, whose keeper reads the store every ``heartbeat_interval``,
  to notice and bind). The search order is the list from entry 0 at start, and the
  entries after the lost one, wrapping around, after a death; so entry 0 hosts at start,
  the next live candidate after a death (the entry right after the lost one at once),
  and a newcomer, or the old host started again, joins the current store instead of
  opening a second one. An entry that accepts connections but does not answer as a
  store (busy) is never hosted past: the search tries again.
* *Moving.* When an operation fails the backend probes its entry; the store there is
  gone when the address refuses connections (or its machine does not answer within
  2 s), or a different store answers there; a store that is only slow is waited for.
  Then it searches as above, for up to ``connect_timeout``, and brings the run's last
  state it read (every node knows the last round) to the new store: written if the
  store has none, replacing one of the same generation with an older round (both by
  compare-and-set; a newer state is never overwritten). The failed operation is then
  tried once on the new store. A backend and its clones (the handler's and the keeper's)
  share one placement: whichever sees the loss first moves, the other follows.
* *Heartbeats* are not carried over: the dead host's key is missing on the new store,
  which ``liveness`` counts as silence, so it is declared dead within
  ``heartbeat_timeout`` of the move like any other dead node; the survivors' keepers
  restart the round, and the next round's round store lives on the new host.

Races accepted: two nodes that both find no store answering can host two entries
if one binds between the other's last probe and its bind (milliseconds); right after
hosting, a node probes the others once more and gives way to a store of higher
priority, which closes the window unless both bind before either looks. A host that
hangs (SIGSTOP) or is cut off without a connection reset blocks its clients, whose
TCPStore waits for replies without a timeout: nobody moves away from it (until TCP
gives up, about 15 minutes on Linux), as with one endpoint.
"""

from __future__ import annotations

import enum
import ipaddress
import logging
import os
import socket
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol, cast

from tenacity import Retrying, retry_if_exception_type, stop_after_delay, wait_fixed
from torch.distributed import PrefixStore, TCPStore

from elastic_ext.rendezvous.backend import (
    STATE_KEY,
    unwrap_state,
)
from elastic_ext.rendezvous.errors import CorruptStateError, StoreUnavailableError
from elastic_ext.rendezvous.settings import Endpoint, Settings
from elastic_ext.rendezvous.state import RunState, Status
from elastic_ext.torch_compat import matches_machine_hostname

logger = logging.getLogger(__name__)

STORE_ERRORS = (RuntimeError, ValueError, TimeoutError)
TERM_KEY = "store_term"
"""Per run, several candidates only: one more than the term of the store the run came from."""
STORE_ID_KEY = "store_id"
"""Per run, several candidates only: a random name of this store, written by the first
agent to use it, so that an agent can tell its store from a new one at the same address.
Neither key is removed with the run (they live as long as the store, like round stores)."""
_SWEEP_PAUSE = 0.1
_ABSENT = b"\0etcd-ext: no such key\0"


class ByteStore(Protocol):
    """A c10d store as its binding really is: values are bytes (torch's stubs say ``str``)."""

    def set(self, key: str, value: bytes) -> None: ...
    def get(self, key: str) -> bytes: ...
    def check(self, keys: list[str]) -> bool: ...
    def compare_set(self, key: str, expected_value: bytes, desired_value: bytes) -> bytes: ...
    def multi_get(self, keys: list[str]) -> list[bytes]: ...
    def delete_key(self, key: str) -> bool: ...
    def add(self, key: str, amount: int) -> int: ...


def connect_tcp_store(settings: Settings, host_if_possible: bool = True) -> tuple[TCPStore, bool]:
    """Host the embedded store if this node should, else connect to it; (store, hosting).
    One endpoint only: several are placed by ``Placement``."""
    endpoint = settings.endpoints[0]
    timeout = timedelta(seconds=settings.timeouts.connect)
    want_host = settings.is_host
    if want_host is None:
        want_host = host_if_possible and matches_machine_hostname(endpoint.host)
    attempts = [True, False] if want_host and settings.is_host is None else [bool(want_host)]
    last: Exception | None = None
    for is_server in attempts:
        try:
            store = TCPStore(endpoint.host, endpoint.port, is_master=is_server,
                             wait_for_workers=False, multi_tenant=True, timeout=timeout)
        except STORE_ERRORS as exc:
            last = exc
            continue
        if is_server:
            logger.info("agent %d hosts the embedded etcd-ext store on %s", os.getpid(), endpoint)
        return store, is_server
    raise StoreUnavailableError(
        f"cannot reach the embedded c10d store at {endpoint} within "
        f"{settings.timeouts.connect:g}s ({last}); check --rdzv-endpoint, or start the node "
        "that hosts it (the one whose address matches the endpoint)") from last


def _is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def names_this_node(host: str, local_addr: str | None) -> bool:
    """Whether a candidate entry's host is this node (see the module docstring)."""
    if local_addr is not None and host == local_addr:
        return True
    if _is_loopback(host):
        return local_addr is None
    return matches_machine_hostname(host)


def own_entries(settings: Settings, *, may_host: bool = True) -> frozenset[int]:
    """The indices of the candidate entries this node may host."""
    if not may_host or settings.is_host is False:
        return frozenset()
    return frozenset(i for i, endpoint in enumerate(settings.endpoints)
                     if names_this_node(endpoint.host, settings.local_addr))


def read_key(store: ByteStore, key: str) -> bytes | None:
    """The key's value, or None, in one request that never waits: ``get`` waits for a
    missing key (a key removed after ``check`` said it was there would cost
    ``connect_timeout``), while ``compare_set`` echoes an expected value that is absent."""
    value = bytes(store.compare_set(key, _ABSENT, _ABSENT))
    return None if value == _ABSENT else value


def decode_state(raw: bytes) -> bytes:
    # value = magic + nonce line + state; the nonce makes every write's token unique
    return unwrap_state(raw).split(b"\n", 1)[1]


@dataclass
class _Answer:
    """A live store found at one candidate entry, and what it holds of this run."""

    index: int
    store: TCPStore
    has_run: bool
    term: int
    store_id: bytes | None


class _Refused(enum.Enum):
    """Nothing accepts connections at an entry (or its machine does not answer)."""

    REFUSED = "refused"


_REFUSED = _Refused.REFUSED
_Probe = _Answer | _Refused | None
"""What a probe of one entry found: a store, nothing listening, or (None) something that
accepts connections but did not answer as a store in time (busy, or not a TCPStore)."""


class _NoStoreYet(Exception):
    """One search found no store to use; the next may (within ``connect_timeout``)."""


class Placement:
    """Where the run's store is, for one agent: shared by a backend and its clones.

    ``lock`` is held while the store is searched for, so one thread moves and the
    others follow; ``epoch`` counts the moves, so each backend knows when to reconnect.
    ``server`` keeps the TCPStore this process serves alive (None: it serves none).
    """

    def __init__(self, settings: Settings, *, may_host: bool) -> None:
        self.settings = settings
        self.mine = own_entries(settings, may_host=may_host)
        self.lock = threading.RLock()
        self.at = -1
        self.epoch = 0
        self.term = 0
        self.store_id: bytes | None = None
        self.server: TCPStore | None = None
        self.last_state: bytes | None = None  # the newest raw state value any backend saw
        timeouts = settings.timeouts
        self.timeout = timedelta(seconds=timeouts.connect)
        # A machine that is down does not refuse connections: give up on it after this.
        self.probe_timeout = min(2.0, timeouts.connect)
        self.grace = min(timeouts.connect / 2, 2 * timeouts.heartbeat_interval + 1.0)

    @property
    def endpoints(self) -> tuple[Endpoint, ...]:
        return self.settings.endpoints

    def describe(self) -> str:
        return "c10d://" + ",".join(str(e) for e in self.endpoints)

    # -- what the backends call, under ``lock`` -------------------------------------------
    def connect_current(self, why: str = "it does not answer") -> TCPStore:
        """A new connection to the current store, or to where it went if it is gone.

        The store is gone when its address refuses connections, or a new store answers
        there; one that accepts connections but answers slowly is waited for."""
        retrying = Retrying(stop=stop_after_delay(self.settings.timeouts.connect),
                            wait=wait_fixed(_SWEEP_PAUSE),
                            retry=retry_if_exception_type(_NoStoreYet), reraise=True)
        try:
            found = retrying(self._probe_answering, self.at)
        except _NoStoreYet as exc:
            raise StoreUnavailableError(
                f"the embedded c10d store at {self.endpoints[self.at]} accepts connections "
                f"but did not answer within connect_timeout={self.settings.timeouts.connect:g}s; "
                "its host may be overloaded or hung") from exc
        if isinstance(found, _Answer) and found.store_id == self.store_id:
            return found.store
        if isinstance(found, _Answer):
            why = "a new store answers at its address"
        return self.move(leaving=self.at, why=why)

    def _probe_answering(self, index: int) -> _Answer | _Refused:
        found = self._probe(index)
        if found is None:
            raise _NoStoreYet
        return found

    def move(self, *, leaving: int | None, why: str = "") -> TCPStore:
        """Search the candidates (module docstring); a connection to the store found."""
        began = time.monotonic()
        if leaving is None:
            order = list(range(len(self.endpoints)))
        else:
            self._check_run_goes_on(leaving, why)
            logger.warning("etcd-ext: the embedded store at %s is gone (%s); looking for it on "
                           "the next candidates of %s", self.endpoints[leaving], why,
                           self.describe())
            count = len(self.endpoints)
            order = [(leaving + step) % count for step in range(1, count + 1)]
        refused: dict[int, float] = {}
        retrying = Retrying(stop=stop_after_delay(self.settings.timeouts.connect),
                            wait=wait_fixed(_SWEEP_PAUSE),
                            retry=retry_if_exception_type(_NoStoreYet), reraise=True)
        try:
            store = retrying(self._sweep, order, leaving, refused)
        except _NoStoreYet as exc:
            own = ", ".join(str(self.endpoints[i]) for i in sorted(self.mine))
            hosting = f"this node may host {own}" if own else "no entry names this node"
            raise StoreUnavailableError(
                f"no candidate of the embedded c10d store {self.describe()} answered within "
                f"connect_timeout={self.settings.timeouts.connect:g}s ({hosting}); start a "
                "node whose address is on the list, or check --rdzv-endpoint and "
                "--local-addr") from exc
        if leaving is not None:
            logger.warning("etcd-ext: the run's store moved to %s (%s) in %.1fs, term %d",
                           self.endpoints[self.at],
                           "hosted here" if self.server is not None else "another node hosts it",
                           time.monotonic() - began, self.term)
        return store

    def _check_run_goes_on(self, leaving: int, why: str) -> None:
        """A finished or closed run has nothing to carry: its agents are leaving, and the
        last host to go would only make the others search for ``connect_timeout``."""
        if self.last_state is None:
            return
        try:
            status = RunState.from_bytes(decode_state(self.last_state)).status
        except CorruptStateError:
            return
        if status is not Status.ACTIVE:
            raise StoreUnavailableError(
                f"the embedded c10d store at {self.endpoints[leaving]} is gone ({why}); the run "
                f"is {status.value}, so it does not move to another candidate")

    # -- the search -------------------------------------------------------------------------
    def _sweep(self, order: list[int], leaving: int | None, refused: dict[int, float]) -> TCPStore:
        now = time.monotonic()
        answers: list[_Answer] = []
        for index in order:
            found = self._probe(index)
            if found is _REFUSED:
                refused.setdefault(index, now)
                continue
            refused.pop(index, None)  # something is there: never host past it
            if isinstance(found, _Answer):
                answers.append(found)
        chosen = self._best(answers)
        if chosen is None and answers:
            chosen = answers[0]  # the first in search order: a store with no run yet
        server = None
        if chosen is None:
            chosen, server = self._host_if_due(order, leaving, refused, now)
        if chosen is None:
            raise _NoStoreYet
        try:
            return self._arrive(chosen, server)
        except STORE_ERRORS as exc:  # it went away as we arrived: search again
            logger.info("etcd-ext: the embedded store at %s failed as we arrived: %s",
                        self.endpoints[chosen.index], exc)
            raise _NoStoreYet from exc

    @staticmethod
    def _best(answers: Iterable[_Answer]) -> _Answer | None:
        """Of the stores holding this run: the highest term, then the earliest entry."""
        with_run = [a for a in answers if a.has_run]
        return max(with_run, key=lambda a: (a.term, -a.index)) if with_run else None

    def _host_if_due(self, order: list[int], leaving: int | None, refused: dict[int, float],
                     now: float) -> tuple[_Answer | None, TCPStore | None]:
        """Host our first own entry in ``order`` once every entry ahead of it has refused
        connections for ``grace`` seconds; (a connection to it, the server) or Nones."""
        for index in order:
            if index == leaving:
                break
            if index not in self.mine:
                if now - refused.get(index, now) < self.grace:
                    break
                continue
            endpoint = self.endpoints[index]
            try:
                server = TCPStore(endpoint.host, endpoint.port, is_master=True,
                                  wait_for_workers=False, multi_tenant=True, timeout=self.timeout)
                client = self._client(index)
            except STORE_ERRORS as exc:  # someone else bound it first: the next sweep sees it
                logger.info("etcd-ext: could not host the embedded store on %s (%s)",
                            endpoint, exc)
                break
            return _Answer(index, client, False, 0, None), server
        return None, None

    def _arrive(self, answer: _Answer, server: TCPStore | None) -> TCPStore:
        """Make ``answer`` the current store: its term, our last state, and, when we host
        it, give way to a store of higher priority that another node opened meanwhile."""
        run = cast(ByteStore, PrefixStore(self.settings.run_prefix, answer.store))
        store_id = bytes(run.compare_set(STORE_ID_KEY, b"", os.urandom(8).hex().encode()))
        term = self._claim_term(run)
        self._seed(run)
        if server is not None:
            rival = self._best(a for a in (self._probe(i) for i in range(len(self.endpoints))
                                           if i != answer.index) if isinstance(a, _Answer))
            if rival is not None and (rival.term, -rival.index) > (term, -answer.index):
                logger.warning("etcd-ext: %s serves this run too; giving way to it",
                               self.endpoints[rival.index])
                del server, answer
                return self._arrive(rival, None)
            logger.info("agent %d hosts the embedded etcd-ext store on %s", os.getpid(),
                        self.endpoints[answer.index])
        self.at, self.term, self.server, self.store_id = answer.index, term, server, store_id
        self.epoch += 1
        return answer.store

    def _claim_term(self, run: ByteStore) -> int:
        """The store's term: one above the store we came from, never lowered."""
        wanted = str(self.term + 1).encode()
        current = bytes(run.compare_set(TERM_KEY, b"", wanted))
        while True:
            try:
                term = int(current)
            except ValueError:
                term = 0
            if term >= self.term:
                return term
            current = bytes(run.compare_set(TERM_KEY, current, wanted))

    def _seed(self, run: ByteStore) -> None:
        """Bring our last known state; never overwrite a newer one."""
        ours = self.last_state
        if ours is None:
            return
        current = bytes(run.compare_set(STATE_KEY, b"", ours))
        if current == ours:
            return
        try:
            mine, theirs = (RunState.from_bytes(decode_state(v)) for v in (ours, current))
        except CorruptStateError:
            return  # get_state reports it
        if theirs.generation == mine.generation and theirs.round < mine.round:
            run.compare_set(STATE_KEY, current, ours)

    # -- probes -------------------------------------------------------------------------------
    def _probe_alive(self, index: int) -> bool:
        """Whether anything accepts connections at entry ``index`` (refused at once if not)."""
        endpoint = self.endpoints[index]
        try:
            socket.create_connection((endpoint.host, endpoint.port),
                                     timeout=self.probe_timeout).close()
        except OSError:
            return False
        return True

    def _probe(self, index: int) -> _Probe:
        """A client of the store at entry ``index`` and what it holds (see ``_Probe``)."""
        if index < 0 or not self._probe_alive(index):
            return _REFUSED
        endpoint = self.endpoints[index]
        try:
            store = self._client(index)
            run = cast(ByteStore, PrefixStore(self.settings.run_prefix, store))
            has_run = bool(run.check([STATE_KEY]))
            term_value = read_key(run, TERM_KEY) or b""
            term = int(term_value) if term_value.isdigit() else 0
            store_id = read_key(run, STORE_ID_KEY)
        except (*STORE_ERRORS, OSError) as exc:
            logger.debug("etcd-ext: %s accepts connections but did not answer as a store: %s",
                         endpoint, exc)
            return None
        return _Answer(index, store, has_run, term, store_id)

    def client_here(self) -> TCPStore:
        """A new connection to the store this agent serves."""
        return self._client(self.at)

    def _client(self, index: int) -> TCPStore:
        endpoint = self.endpoints[index]
        return TCPStore(endpoint.host, endpoint.port, is_master=False, wait_for_workers=False,
                        multi_tenant=True, timeout=self.timeout)
