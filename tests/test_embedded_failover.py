"""The embedded store survives its host: candidates, moves, state carried, no second store.

In-process: each "node" is a backend of its own with a ``--local-addr`` of its own
(127.0.0.1, .2, .3 on loopback, each naming one candidate entry), every TCPStore in
this process; a host "dies" when its backend stops serving (``close``), which closes
every connection to the store as a killed agent's does. With real agents:
``test_the_survivors_train_on_when_the_hosting_node_is_killed`` below.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from torch.distributed import PrefixStore, TCPStore

from elastic_ext.jsonlines import read_json_lines
from elastic_ext.local.job import JobSpec, LocalJob, wait_for_step
from elastic_ext.local.processes import wait_until
from elastic_ext.net import free_ports
from elastic_ext.rendezvous import c10d_placement
from elastic_ext.rendezvous.backend import STATE_KEY, wrap_state
from elastic_ext.rendezvous.c10d_backend import C10dBackend
from elastic_ext.rendezvous.c10d_placement import own_entries
from elastic_ext.rendezvous.errors import ConfigError, StoreUnavailableError
from elastic_ext.rendezvous.liveness import Liveness
from elastic_ext.rendezvous.settings import Settings, parse_settings
from elastic_ext.rendezvous.state import NodeInfo, Phase, RunState, Status

ADDRS = ("127.0.0.1", "127.0.0.2", "127.0.0.3")


@pytest.fixture
def endpoint() -> str:
    """Three candidates on loopback, entry i on ADDRS[i]."""
    ports = free_ports(3)
    return "c10d://" + ",".join(f"{a}:{p}" for a, p in zip(ADDRS, ports, strict=True))


def settings(endpoint: str, local_addr: str | None, **conf: str) -> Settings:
    # connect_timeout stays at its default: a TCPStore connection on this machine can wait
    # seconds for a reverse lookup of its loopback peer (c10d logs the peer's name)
    conf = {"heartbeat_interval": "0.1", "heartbeat_timeout": "1", **conf}
    return parse_settings(endpoint=endpoint, run_id="run1", min_nodes=1, max_nodes=4,
                          conf=conf, local_addr=local_addr)


@pytest.fixture
def nodes(endpoint: str) -> Iterator[list[C10dBackend]]:
    """Node i on ADDRS[i], started in order: node 0 hosts."""
    backends = [C10dBackend.connect(settings(endpoint, addr)) for addr in ADDRS]
    yield backends
    for backend in backends:
        backend.close()


def state(round_: int, generation: str = "gen1") -> bytes:
    return RunState(generation, round_, Phase.CLOSED, {"n1": NodeInfo("h", 1)},
                    order=("n1",)).to_bytes()


def round_of(backend: C10dBackend) -> int:
    current = backend.get_state()
    assert current is not None
    return RunState.from_bytes(current[0]).round


def port_of(endpoint: str, index: int) -> int:
    return int(endpoint.split(",")[index].rsplit(":", 1)[1])


def listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


# -- settings ----------------------------------------------------------------------------
def test_a_candidate_list_keeps_its_order_and_one_endpoint_stays_as_it_was() -> None:
    s = settings("c10d://node1:29400,node2,node3:29500", None)
    assert [str(e) for e in s.endpoints] == ["node1:29400", "node2:29400", "node3:29500"]
    assert settings("c10d://node1:29400", None, is_host="true").is_host is True


@pytest.mark.parametrize("endpoint,conf,match", [
    ("c10d://a:1,b:2,a:1", {}, "names a:1 twice"),
    ("c10d://a:1,A:1", {}, "twice"),
    ("c10d://a:1,b:2", {"is_host": "true"}, "leave is_host=auto"),
])
def test_a_bad_candidate_list_is_refused_with_the_fix_named(endpoint, conf, match) -> None:
    with pytest.raises(ConfigError, match=match):
        settings(endpoint, None, **conf)


def test_a_node_may_host_the_entries_that_name_it(endpoint: str) -> None:
    assert own_entries(settings(endpoint, "127.0.0.2")) == {1}
    assert own_entries(settings(endpoint, None)) == {0, 1, 2}  # loopback, no --local-addr
    assert own_entries(settings(endpoint, "127.0.0.9")) == set()
    assert own_entries(settings(endpoint, "127.0.0.2", is_host="false")) == set()
    assert own_entries(settings(endpoint, "127.0.0.2"), may_host=False) == set()
    remote = settings("c10d://203.0.113.7:1,localhost:2", "10.1.2.3")
    assert own_entries(remote) == set()  # neither names this machine's --local-addr


# -- start --------------------------------------------------------------------------------
def test_entry_0_hosts_at_start_and_the_others_connect_to_it(nodes, endpoint) -> None:
    assert [n.hosts_store for n in nodes] == [True, False, False]
    assert all(n.outages_are_transient for n in nodes)
    nodes[1].set_state(state(1))
    assert round_of(nodes[2]) == 1 and round_of(nodes[0]) == 1
    assert not listening(port_of(endpoint, 1)) and not listening(port_of(endpoint, 2))


def test_one_endpoint_is_not_transient(endpoint) -> None:
    single = endpoint.split(",")[0]
    backend = C10dBackend.connect(settings(single, "127.0.0.1"))
    assert backend.hosts_store and not backend.outages_are_transient


def test_a_node_that_may_host_nothing_fails_naming_the_list(endpoint) -> None:
    began = time.monotonic()
    with pytest.raises(StoreUnavailableError, match="no candidate .* answered .*no entry names"):
        C10dBackend.connect(settings(endpoint, "127.0.0.9", connect_timeout="1"))
    assert time.monotonic() - began < 5


# -- moving ----------------------------------------------------------------------------
def test_when_the_host_dies_the_next_candidate_hosts_with_the_runs_state(nodes, endpoint):
    host, second, third = nodes
    second.set_state(state(4))
    assert round_of(third) == 4
    second.beat("n2")
    host.close()  # the host's agent is gone: its store and every connection to it
    assert not listening(port_of(endpoint, 0))
    assert round_of(second) == 4  # moved, with the state, on its first failed operation
    assert round_of(third) == 4
    assert second.hosts_store and not third.hosts_store
    assert listening(port_of(endpoint, 1)) and not listening(port_of(endpoint, 2))
    # heartbeats are not carried: the dead host's (and anyone's) key is missing there
    assert third.read_beats(["n2", "n1"]) == {"n2": None, "n1": None}
    # the state's tokens stay valid: it is the same value, nonce included
    current = second.get_state()
    assert current is not None
    result = third.set_state(state(5), current[1])
    assert result is not None and result[2] and round_of(second) == 5


def test_a_clone_follows_the_move_of_its_backend_and_the_hosting_one_shares_the_server(
        nodes) -> None:
    host, second, third = nodes
    keepers = [second.clone(), third.clone()]
    second.set_state(state(2))
    host.close()
    assert round_of(keepers[0]) == 2  # the keeper moves first (its agent's backend is idle)
    keepers[0].beat("n2")
    assert second.hosts_store and keepers[0].hosts_store
    assert round_of(second) == 2  # follows without a second search
    assert third.read_beats(["n2"])["n2"] is not None and round_of(keepers[1]) == 2


def test_a_newer_state_on_the_new_store_is_never_overwritten(nodes) -> None:
    host, second, third = nodes
    second.set_state(state(3))
    assert round_of(third) == 3  # third last read round 3
    current = second.get_state()
    assert current is not None
    second.set_state(state(4), current[1])
    host.close()
    assert round_of(second) == 4  # second arrives first with round 4
    assert round_of(third) == 4  # third brings round 3: the newer round 4 is kept


def test_an_older_round_of_the_same_generation_is_replaced_by_a_later_arrival(nodes) -> None:
    host, second, third = nodes
    second.set_state(state(3))
    assert round_of(second) == 3
    current = third.get_state()
    assert current is not None
    third.set_state(state(4), current[1])  # only third has seen round 4
    host.close()
    assert round_of(second) == 3  # second moved first and seeded what it knew
    assert round_of(third) == 4  # third arrives with round 4: same generation, newer
    assert round_of(second) == 4


def test_another_generation_on_the_new_store_is_left_alone(nodes) -> None:
    host, second, third = nodes
    second.set_state(state(3))
    assert round_of(third) == 3
    host.close()
    current = second.get_state()
    assert current is not None
    second.set_state(state(1, generation="gen2"), current[1])
    after = third.get_state()  # third arrives with gen1 round 3
    assert after is not None and RunState.from_bytes(after[0]).generation == "gen2"


def test_a_finished_run_does_not_move_when_its_last_host_leaves(nodes, endpoint) -> None:
    """At the end of a job the agents leave one by one: the others must not search the
    list for connect_timeout, nor open a store, to carry a run that is over."""
    host, second, third = nodes
    second.set_state(RunState("gen1", 3, Phase.CLOSED, {"n1": NodeInfo("h", 1)}, order=("n1",),
                              status=Status.FINISHED).to_bytes())
    assert round_of(third) == 3
    host.close()
    began = time.monotonic()
    with pytest.raises(StoreUnavailableError, match="run is finished, so it does not move"):
        third.get_state()
    assert time.monotonic() - began < 2
    assert not any(listening(port_of(endpoint, i)) for i in range(3))


def test_when_the_next_candidate_is_dead_too_the_one_after_hosts_after_the_grace(
        nodes, endpoint) -> None:
    host, second, third = nodes
    second.set_state(state(2))
    assert round_of(third) == 2
    second.close()  # a client: closing it changes nothing; its node simply never moves
    host.close()
    began = time.monotonic()
    assert round_of(third) == 2
    waited = time.monotonic() - began
    placement = third._placement
    assert placement is not None and waited >= placement.grace
    assert third.hosts_store and listening(port_of(endpoint, 2))
    assert not listening(port_of(endpoint, 1))


def test_an_owner_that_notices_late_joins_the_store_hosted_after_the_grace(
        nodes, endpoint) -> None:
    """The next candidate's agent was busy longer than the grace: the one after it hosts,
    and the late one joins that store instead of opening a second one on its own entry."""
    host, second, third = nodes
    second.set_state(state(2))
    assert round_of(third) == 2
    host.close()
    assert round_of(third) == 2 and third.hosts_store  # after the grace, on entry 2
    assert round_of(second) == 2 and not second.hosts_store
    assert not listening(port_of(endpoint, 1))


def test_moves_wrap_around_the_list_and_raise_the_term(nodes, endpoint) -> None:
    host, second, third = nodes
    second.set_state(state(2))
    host.close()
    assert round_of(second) == 2 and round_of(third) == 2
    back = C10dBackend.connect(settings(endpoint, ADDRS[0]))  # node 0's machine, restarted
    assert round_of(back) == 2
    second.close()  # the second host dies: after entry 2 (whose owner is alive) comes 0
    assert round_of(third) == 2 and third.hosts_store
    assert round_of(back) == 2 and not back.hosts_store
    assert [p.term for p in (third._placement, back._placement) if p] == [3, 3]
    back.close()


def test_a_newcomer_finds_the_current_host_and_opens_no_second_store(nodes, endpoint) -> None:
    host, second, third = nodes
    second.set_state(state(6))
    assert round_of(third) == 6
    host.close()
    assert round_of(second) == 6 and round_of(third) == 6
    for addr in (ADDRS[0], "127.0.0.9", None):  # the old host again, a stranger, any entry
        newcomer = C10dBackend.connect(settings(endpoint, addr))
        assert not newcomer.hosts_store and round_of(newcomer) == 6
        newcomer.close()
    assert not listening(port_of(endpoint, 0))
    assert not listening(port_of(endpoint, 2))


def plant_store(port: int, raw_state: bytes, term: int) -> TCPStore:
    """A store of run1 as another agent would have left it: state, term and store id."""
    server = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                      multi_tenant=True, timeout=timedelta(seconds=5))
    run: Any = PrefixStore("/elastic-ext/run1/", server)  # the stubs say str values
    run.set(STATE_KEY, wrap_state(b"0123\n" + raw_state))
    run.set(c10d_placement.TERM_KEY, str(term).encode())
    run.set(c10d_placement.STORE_ID_KEY, f"planted-{port}".encode())
    return server


def test_of_two_stores_of_the_run_everyone_picks_the_higher_term(endpoint) -> None:
    """What a bind race or a host that came back can leave: newcomers agree on one store,
    and the node whose entry holds the stale one joins the other instead of hosting."""
    stale = plant_store(port_of(endpoint, 0), state(3), term=1)
    current = plant_store(port_of(endpoint, 2), state(4), term=2)
    for addr in ("127.0.0.9", ADDRS[0], ADDRS[1]):
        newcomer = C10dBackend.connect(settings(endpoint, addr))
        placement = newcomer._placement
        assert placement is not None and (placement.at, placement.term) == (2, 2)
        assert round_of(newcomer) == 4 and not newcomer.hosts_store
        newcomer.close()
    assert not listening(port_of(endpoint, 1))
    del stale, current


def test_a_node_that_hosts_gives_way_to_a_store_of_higher_priority_opened_meanwhile(
        endpoint, monkeypatch) -> None:
    """The bind race: a rival store of the run appears between our search and our bind."""
    rivals: list[TCPStore] = []
    original = c10d_placement.Placement._host_if_due

    def rival_binds_first(self, *args):
        if not rivals:
            rivals.append(plant_store(port_of(endpoint, 2), state(7), term=4))
        return original(self, *args)
    monkeypatch.setattr(c10d_placement.Placement, "_host_if_due", rival_binds_first)
    node = C10dBackend.connect(settings(endpoint, ADDRS[0]))
    placement = node._placement
    assert rivals and placement is not None and (placement.at, placement.term) == (2, 4)
    assert not node.hosts_store and round_of(node) == 7
    assert not listening(port_of(endpoint, 0))  # our server is gone again
    node.close()


def test_a_missing_heartbeat_on_the_new_store_is_silence_dead_after_the_timeout() -> None:
    """After a move the dead host's key is missing: after the blind spot of the move,
    it is dead one heartbeat_timeout later, as a node whose counter stopped."""
    now = [100.0]
    live = Liveness(timeout=3.0, clock=lambda: now[0])
    live.observe({"host": b"1:0", "peer": b"1:0"})
    live.blind()  # the keeper's reads fail while the store moves
    now[0] += 2.0
    for beat in range(2, 9):
        live.observe({"host": None, "peer": f"{beat}:0".encode()})
        assert not live.is_dead("peer")
        assert live.is_dead("host") == (beat >= 8), beat
        now[0] += 0.5


# -- with real agents ----------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_survivors_train_on_when_the_hosting_node_is_killed(tmp_path: Path) -> None:
    """3 nodes on a 3-entry list; SIGKILL the hosting node (agent and workers) mid-run:
    the two others train on at world size 2, a node started afterwards joins them (and
    hosts nothing), and the job finishes."""
    ports = free_ports(3)
    endpoint = "c10d://" + ",".join(f"127.0.0.1:{p}" for p in ports)
    metrics = tmp_path / "metrics.jsonl"
    command = ["-m", "trainer", "--steps", "300", "--global-batch-size", "12",
               "--snapshot-dir", str(tmp_path / "snapshots"), "--snapshot-every", "10",
               "--metrics", str(metrics), "--step-delay", "0.05", "--seed", "3"]
    spec = JobSpec(command=command, store="embedded", nnodes="2:3", run_id="failover",
                   max_restarts=3, extra_torchrun_args=[f"--rdzv-endpoint={endpoint}"])
    with LocalJob(spec, tmp_path).start(3) as job:
        wait_until(lambda: [e for e in read_json_lines(metrics) if e["event"] == "step"
                            and e["world_size"] == 3 and e["step"] >= 30] or None,
                   120, 0.05, "step 30 at world size 3")
        host = job.store_host()
        assert host is not None
        killed_at = time.time()
        host.kill()
        resumed = wait_for_step(metrics, after=killed_at, world_size=2, timeout=90)
        survivors = [n for n in job.nodes if n is not host]
        assert all(n.alive() for n in survivors)
        newcomer = job.add_node()
        joined = wait_for_step(metrics, after=resumed["time"], world_size=3, timeout=120)
        assert not newcomer.hosts_store() and not listening(ports[0])
        codes = [n.proc.wait(timeout=150) for n in [*survivors, newcomer]]
        assert codes == [0, 0, 0], [n.proc.output()[-3000:] for n in [*survivors, newcomer]]
    events = list(read_json_lines(metrics))
    steps = [e["step"] for e in events if e["event"] == "step"]
    done = [e for e in events if e["event"] == "done"]
    assert done and done[-1]["step"] == max(steps)
    print(f"kill -> step at world size 2: {resumed['time'] - killed_at:.2f}s; "
          f"newcomer in at step {joined['step']}; done at step {done[-1]['step']}")
