"""Prometheus metrics of one agent (``--rdzv-conf metrics_port=PORT``), with prometheus-client.

The metrics follow the agent's rendezvous events (``events.py``), the keeper's view of
its peers' heartbeats and of its own workers' pace (both read when scraped, so the
keeper's tick does no metrics work), and every request the agent makes to the store
(``MeasuredBackend``). Each agent has a registry of its own, so that a test or an
embedding program with several agents in one process keeps them apart. The names,
documented in the README, are a contract for dashboards: extend them, never rename.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from torch.distributed import Store

from elastic_ext.rendezvous.agent.events import EventKind
from elastic_ext.rendezvous.errors import ConfigError
from elastic_ext.rendezvous.protocol.clock import Clock
from elastic_ext.rendezvous.protocol.pace import Pace
from elastic_ext.rendezvous.stores.contract import KeeperRead, StoreBackend, Token

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from prometheus_client.core import Metric

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'elastic-ext[metrics]'"


def require_prometheus_client() -> None:
    """Fail at start-up, naming the fix, when metrics are asked for but cannot be served."""
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        raise ConfigError(f"--rdzv-conf metrics_port needs prometheus-client: {INSTALL_HINT}"
                          ) from None


class AgentMetrics:
    """The metrics of one agent of one run; ``serve`` exposes them over HTTP."""

    def __init__(self, run_id: str) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        self._run_id = run_id
        self._server: WSGIServer | None = None
        self.port: int | None = None
        """The port ``serve`` bound, once it did."""
        self._peer_silence: Callable[[], Mapping[str, float]] = dict
        self._pace: Callable[[], Pace | None] = lambda: None
        labels = ["run_id"]
        kw: dict[str, Any] = {"registry": self.registry}
        self.round = Gauge("elastic_ext_round", "Round this agent last joined", labels, **kw)
        self.members = Gauge("elastic_ext_members", "Nodes in that round", labels, **kw)
        self.rounds = Counter("elastic_ext_rounds", "Rounds this agent joined, by why they "
                              "opened (start, membership, failure)", [*labels, "reason"], **kw)
        self.restarts_used = Gauge("elastic_ext_restarts_used", "Worker-failure restarts "
                                   "charged to the job-wide budget", labels, **kw)
        self.restarts_left = Gauge("elastic_ext_restarts_left", "Restarts left in the "
                                   "job-wide budget (+Inf: unlimited)", labels, **kw)
        self.last_close = Gauge("elastic_ext_last_round_close_timestamp_seconds", "Unix time "
                                "this agent joined its last closed round", labels, **kw)
        self.nodes_lost = Counter("elastic_ext_nodes_lost", "Peers this agent saw die or "
                                  "leave, by how (dead, left)", [*labels, "how"], **kw)
        self.request_seconds = Histogram(
            "elastic_ext_store_request_duration_seconds", "Time of one request to the store "
            "(retries across endpoints included)", [*labels, "operation"],
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            **kw)
        self.request_errors = Counter("elastic_ext_store_request_errors", "Requests to the "
                                      "store that failed", [*labels, "operation"], **kw)
        self.stragglers = Counter("elastic_ext_stragglers", "Stragglers this agent named "
                                  "while it judged the round, by what it did (warn: named "
                                  "only, drop: left out)", [*labels, "action"], **kw)
        self.registry.register(_PeerHeartbeatAges(run_id, self.peer_ages))
        self.registry.register(_NodePace(run_id, self.pace))

    # -- inputs ---------------------------------------------------------------------------
    def on_event(self, kind: EventKind, fields: Mapping[str, Any]) -> None:
        """An ``EventLog`` listener: the rendezvous as it happens."""
        run = self._run_id
        if kind is EventKind.JOINED:
            self.round.labels(run).set(fields["round"])
            self.members.labels(run).set(fields["world_size"])
            self.rounds.labels(run, fields["opened_because"]).inc()
            self.last_close.labels(run).set(time.time())
            self.restarts_used.labels(run).set(fields["restarts"])
            budget = fields["max_restarts"]
            left = math.inf if budget is None else max(0, budget - fields["restarts"])
            self.restarts_left.labels(run).set(left)
        elif kind is EventKind.BUDGET_SPENT:
            self.restarts_left.labels(run).set(0)
        elif kind in (EventKind.NODE_DEAD, EventKind.NODE_LEFT):
            self.nodes_lost.labels(run, "dead" if kind is EventKind.NODE_DEAD else "left").inc()
        elif kind is EventKind.SLOW:
            self.stragglers.labels(run, "drop" if fields.get("dropped") else "warn").inc()

    def watch_peers(self, silence: Callable[[], Mapping[str, float]]) -> None:
        """Where the heartbeat ages come from when scraped (the keeper)."""
        self._peer_silence = silence

    def peer_ages(self) -> Mapping[str, float]:
        """Each peer's heartbeat age now, from what ``watch_peers`` named."""
        return self._peer_silence()

    def watch_pace(self, pace: Callable[[], Pace | None]) -> None:
        """Where this node's pace comes from when scraped (the keeper's ``pace``)."""
        self._pace = pace

    def pace(self) -> Pace | None:
        """This node's pace now, from what ``watch_pace`` named; None while unknown."""
        return self._pace()

    @contextmanager
    def request(self, operation: str) -> Iterator[None]:
        """Time one store request; count it as an error if it raises."""
        started = time.perf_counter()
        try:
            yield
        except BaseException:
            self.request_errors.labels(self._run_id, operation).inc()
            raise
        finally:
            self.request_seconds.labels(self._run_id, operation).observe(
                time.perf_counter() - started)

    # -- serving ------------------------------------------------------------------------
    def serve(self, port: int, addr: str = "") -> int:
        """Serve ``/metrics`` on ``port`` (0: any free one) of every interface; the port.

        Raises:
            ConfigError: the port cannot be bound.
        """
        from prometheus_client import start_http_server

        try:
            self._server, _ = start_http_server(port, addr=addr or "0.0.0.0",
                                                registry=self.registry)
        except OSError as exc:
            raise ConfigError(f"--rdzv-conf metrics_port={port}: cannot serve metrics there "
                              f"({exc}); choose another port, or 0 for any free one") from exc
        self.port = int(self._server.server_port)
        logger.info("etcd-ext: Prometheus metrics on port %d", self.port)
        return self.port

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class _PeerHeartbeatAges:
    """A collector: the heartbeat age of every peer, read from the keeper when scraped."""

    def __init__(self, run_id: str, ages: Callable[[], Mapping[str, float]]) -> None:
        self._run_id = run_id
        self._ages = ages

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import GaugeMetricFamily

        family = GaugeMetricFamily(
            "elastic_ext_peer_heartbeat_age_seconds", "Seconds since each peer's heartbeat "
            "counter last moved, on this agent's clock", labels=["run_id", "peer"])
        for peer, age in sorted(self._ages().items()):
            family.add_metric([self._run_id, peer], age)
        yield family


class _NodePace:
    """A collector: this node's step time and own step time, read from the keeper when
    scraped; no sample while a figure is unknown (no steps yet, or no DDP: no own time),
    so that a dashboard shows a gap rather than a made-up zero."""

    def __init__(self, run_id: str, pace: Callable[[], Pace | None]) -> None:
        self._run_id = run_id
        self._pace = pace

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import GaugeMetricFamily

        pace = self._pace()
        step = GaugeMetricFamily(
            "elastic_ext_step_seconds", "Median time of a training step of this node's "
            "workers (every node's under DDP: they step together)", labels=["run_id"])
        own = GaugeMetricFamily(
            "elastic_ext_own_step_seconds", "Median time of this node's slowest worker's own "
            "work per step (DDP's forward and backward, without the wait for peers)",
            labels=["run_id"])
        if pace is not None:
            step.add_metric([self._run_id], pace.step_s)
            if pace.own_s is not None:
                own.add_metric([self._run_id], pace.own_s)
        yield step
        yield own


class MeasuredBackend(StoreBackend):
    """A ``StoreBackend`` that times every request of the one it wraps, for the metrics."""

    def __init__(self, inner: StoreBackend, metrics: AgentMetrics) -> None:
        self._inner = inner
        self._metrics = metrics

    @property
    def name(self) -> str:
        return self._inner.name

    @property
    def outages_are_transient(self) -> bool:
        return self._inner.outages_are_transient

    @property
    def heartbeats_expire(self) -> bool:
        return self._inner.heartbeats_expire

    @property
    def hosts_store(self) -> bool:
        return self._inner.hosts_store

    def get_state(self) -> tuple[bytes, Token] | None:
        with self._metrics.request("get_state"):
            return self._inner.get_state()

    def set_state(self, state: bytes, token: Token | None = None
                  ) -> tuple[bytes, Token, bool] | None:
        with self._metrics.request("set_state"):
            return self._inner.set_state(state, token)

    def state_version(self) -> object | None:
        with self._metrics.request("state_version"):
            return self._inner.state_version()

    def wait_for_state(self, token: Token | None, timeout: float, clock: Clock
                       ) -> bool | tuple[bytes, Token]:
        return self._inner.wait_for_state(token, timeout, clock)  # waiting is no request time

    def on_state_change(self, callback: Callable[[], None]) -> None:
        self._inner.on_state_change(callback)

    def state_after(self, version: object | None) -> tuple[bytes, Token] | None:
        with self._metrics.request("state_after"):
            return self._inner.state_after(version)

    @property
    def keeps_heads(self) -> bool:
        return self._inner.keeps_heads

    def head_after(self, version: object | None) -> tuple[bytes, Token] | None:
        with self._metrics.request("head_after"):
            return self._inner.head_after(version)

    def read_seat(self, generation: str, round_: int, node: str) -> bytes | None:
        with self._metrics.request("read_seat"):
            return self._inner.read_seat(generation, round_, node)

    def read_seats(self, generation: str, round_: int) -> list[tuple[str, bytes]]:
        with self._metrics.request("read_seats"):
            return self._inner.read_seats(generation, round_)

    def join(self, generation: str, round_: int, node: str, entry: bytes) -> int:
        with self._metrics.request("join"):
            return self._inner.join(generation, round_, node, entry)

    def count_joins(self, generation: str, round_: int) -> int:
        with self._metrics.request("count_joins"):
            return self._inner.count_joins(generation, round_)

    def wait_for_joins(self, generation: str, round_: int, at_least: int, timeout: float,
                       clock: Clock) -> bool:
        return self._inner.wait_for_joins(generation, round_, at_least, timeout, clock)

    def read_joins(self, generation: str, round_: int) -> list[tuple[str, bytes]]:
        with self._metrics.request("read_joins"):
            return self._inner.read_joins(generation, round_)

    def drop_joins(self, generation: str, round_: int, nodes: Iterable[str]) -> None:
        with self._metrics.request("drop_joins"):
            self._inner.drop_joins(generation, round_, nodes)

    def write_verdict(self, verdict: bytes) -> None:
        with self._metrics.request("write_verdict"):
            self._inner.write_verdict(verdict)

    def read_verdict(self) -> bytes | None:
        with self._metrics.request("read_verdict"):
            return self._inner.read_verdict()

    def keeper_read(self, node: str, presence_port: int | None,
                    watched: Sequence[str], due: bool = True, pace: Pace | None = None
                    ) -> KeeperRead:
        with self._metrics.request("keeper_read"):
            return self._inner.keeper_read(node, presence_port, watched, due, pace)

    def beat(self, node: str, presence_port: int | None = None, pace: Pace | None = None
             ) -> None:
        with self._metrics.request("beat"):
            self._inner.beat(node, presence_port, pace)

    def leave(self, node: str) -> None:
        with self._metrics.request("leave"):
            self._inner.leave(node)

    def read_beats(self, nodes: Iterable[str]) -> dict[str, bytes | None]:
        with self._metrics.request("read_beats"):
            return self._inner.read_beats(nodes)

    def remove_run(self) -> None:
        with self._metrics.request("remove_run"):
            self._inner.remove_run()

    def round_store(self, generation: str, round_: int) -> Store:
        with self._metrics.request("round_store"):
            return self._inner.round_store(generation, round_)

    def drop_round_stores(self, generation: str, keep_from_round: int) -> None:
        with self._metrics.request("drop_round_stores"):
            self._inner.drop_round_stores(generation, keep_from_round)

    def list_runs(self) -> list[str]:
        with self._metrics.request("list_runs"):
            return self._inner.list_runs()

    def clone(self) -> MeasuredBackend:
        return MeasuredBackend(self._inner.clone(), self._metrics)

    def close(self) -> None:
        self._inner.close()
