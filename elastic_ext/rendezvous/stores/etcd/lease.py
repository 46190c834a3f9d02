"""The agent's etcd lease: its heartbeat key hangs on it, so a dead agent's key goes.

One per agent, shared by its backend and the backend's clones (``stores/etcd/backend.py``). A thread
of its own renews it every third of its TTL, never late behind a keeper tick's reads and
writes. With ``heartbeat_mode=lease`` the lease *is* the heartbeat (issue 27): its TTL is chosen
so that a frozen agent's key is gone within ``heartbeat_timeout``, and the others watch the
key; with ``heartbeat_mode=write`` the keeper writes a new value every interval and the lease
only tidies up after an agent that died (a TTL of 4 heartbeat timeouts, 10 s at least).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from tenacity import RetryCallState, Retrying, retry_if_exception, stop_after_attempt

from elastic_ext.rendezvous.errors import StoreUnavailableError
from elastic_ext.rendezvous.protocol.pace import Pace
from elastic_ext.rendezvous.stores.contract import STATE_POLL_S
from elastic_ext.rendezvous.stores.etcd.client import EtcdClient
from elastic_ext.rendezvous.stores.etcd.wire import op_put
from elastic_ext.rendezvous.stores.wire import heartbeat_value

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

PACE_PUT_S = 5.0
"""With ``heartbeat_mode=lease``, the least time between two puts of a heartbeat's value for
a change of its pace (``protocol/pace.py``)."""

EXPIRY_CHECK_S = 0.5
"""How often etcd's lessor looks for expired leases (``lease/lessor.go``, 3.4 and 3.5)."""


def lease_ttl(heartbeat_timeout: float, *, is_heartbeat: bool) -> int:
    """The TTL in whole seconds, as etcd takes it. As the heartbeat: the longest that finds
    a frozen node within ``heartbeat_timeout`` (etcd deletes an expired lease's keys at its
    next expiry check, up to ``EXPIRY_CHECK_S`` after the TTL ran out), never below etcd's
    minimum of 2 s. Else (it only tidies a dead agent's key away: liveness is the written
    counter) long enough that no stall of a live agent lets it expire, and that its
    keep-alives, one per third of it, are a small part of an idle agent's requests (at 12 s,
    0.25 a second of an agent's 1.25: issue 27)."""
    if is_heartbeat:
        return max(2, math.floor(heartbeat_timeout - EXPIRY_CHECK_S))
    return max(30, math.ceil(10 * heartbeat_timeout))


class AgentLease:
    """The lease, the heartbeat key on it (``hb_prefix + node``) and the thread renewing it."""

    def __init__(self, client: EtcdClient, hb_prefix: str, ttl: int,
                 heartbeat_timeout: float) -> None:
        self._client = client
        self._hb_prefix = hb_prefix
        self.ttl = ttl
        self._heartbeat_timeout = heartbeat_timeout
        self.id: int | None = None
        self._left = False  # the agent left the run: no heartbeat may follow its LEFT marker
        self._beats = 0  # the counter of the heartbeat value (``heartbeat_value``)
        self._node: str | None = None  # whose heartbeat key hangs on it, once known
        self._port: int | None = None
        self._pace: Pace | None = None  # this node's workers' pace, in the next value put
        self._pace_put: tuple[Pace | None, float] = (None, -math.inf)  # the last put, when
        self._renewing = False
        self._stop = threading.Event()
        self.lock = threading.Lock()

    @property
    def keepalive_every(self) -> float:
        """A third of the TTL: two keep-alives may be lost or late before it expires."""
        return self.ttl / 3

    def ensure(self, node: str, presence_port: int | None, put_beat: bool,
               pace: Pace | None = None) -> int | None:
        """The lease: granted when there is none or it expired (this agent was frozen or cut
        off from etcd for a TTL), with ``node``'s heartbeat key put on it if ``put_beat``
        (then put anew when ``pace`` moved: ``pace_put``), and renewed from then on. None
        once the agent left."""
        with self.lock:
            if self._left:
                return None
            self._node, self._port, self._pace = node, presence_port, pace
            if self.id is None:
                self.id, granted = self._client.lease_grant(self.ttl)
                if granted > self.ttl:
                    logger.warning(
                        "etcd-ext: etcd granted a lease of %ds, not %ds (its minimum: 1.5 "
                        "election timeouts), so a frozen node is found after %ds, beyond "
                        "heartbeat_timeout=%g; raise heartbeat_timeout or lower etcd's "
                        "--election-timeout", granted, self.ttl, granted,
                        self._heartbeat_timeout)
                    self.ttl = granted
                if put_beat:
                    self._client.txn([self.beat_op()])
            elif put_beat and (put := self.pace_put(pace)):
                self._client.txn(put)
            if not self._renewing:
                self._renewing = True
                threading.Thread(target=self._renew, name="etcd-ext-lease", daemon=True).start()
            return self.id

    def beat_op(self) -> dict[str, Any]:
        """A put of a new heartbeat value on the lease (under ``lock``, with a lease)."""
        assert self._node is not None and self.id is not None
        self._beats += 1
        self._pace_put = (self._pace, time.monotonic())
        return op_put(self._hb_prefix + self._node,
                      heartbeat_value(self._beats, self._port, self._pace), lease=self.id)

    def pace_put(self, pace: Pace | None) -> list[dict[str, Any]]:
        """With ``heartbeat_mode=lease`` (under ``lock``): a put of the heartbeat's value when
        ``pace`` moved (``Pace.differs``) since the last put, at most one every
        ``PACE_PUT_S``: every watcher of the heartbeats reads each put."""
        last, at = self._pace_put
        now = time.monotonic()
        if self.id is None or self._node is None or now - at < PACE_PUT_S or \
                (pace is None if last is None else not last.differs(pace)):
            return []
        return [self.beat_op()]

    def beat_ops(self) -> list[dict[str, Any]]:
        """``beat_op`` when there is a lease and a node (under ``lock``), else nothing."""
        return [] if self.id is None or self._node is None else [self.beat_op()]

    def retry(self, write: Callable[[], _T]) -> _T:
        """``write``, again after a "lease not found" (three tries): the lease expired while
        etcd was out of reach or overloaded (even between its grant and the put of the key
        on it), or it was revoked on leaving (then the write beats no more)."""
        def forget(_: RetryCallState) -> None:
            with self.lock:
                self.id = None
        retrying = Retrying(stop=stop_after_attempt(3), reraise=True, after=forget,
                            retry=retry_if_exception(lambda exc: isinstance(
                                exc, StoreUnavailableError) and "lease not found" in str(exc)))
        return retrying(write)

    def end(self) -> int | None:
        """The agent leaves: no heartbeat after this. The lease id, for the caller to
        revoke."""
        with self.lock:
            self._left = True
            lease, self.id = self.id, None
        self._stop.set()
        return lease

    def stop(self) -> None:
        self._stop.set()

    def _renew(self) -> None:
        """Keep-alives every third of the TTL; a lease found gone is granted anew and the
        key put again."""
        due = time.monotonic() + self.keepalive_every
        while not self._stop.wait(max(0.0, due - time.monotonic())):
            with self.lock:
                lease_id, node, port = self.id, self._node, self._port
            sent = time.monotonic()
            try:
                alive = lease_id is not None and self._client.lease_keepalive(lease_id) > 0
            except Exception as exc:  # etcd out of reach: its leader extends every lease
                logger.debug("etcd-ext: lease keep-alive: %s", exc)
                due = time.monotonic() + STATE_POLL_S
                continue
            due = sent + self.keepalive_every
            if alive or node is None:
                continue
            with self.lock:
                if self.id == lease_id and lease_id is not None:
                    logger.warning("etcd-ext: this agent's lease expired (frozen or out of "
                                   "reach of etcd for %ds); announcing it anew", self.ttl)
                    self.id = None
            try:
                self.ensure(node, port, put_beat=True)
            except Exception as exc:  # the next keep-alive finds no lease and tries again
                logger.debug("etcd-ext: lease grant: %s", exc)
