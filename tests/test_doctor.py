"""``elastic-ext doctor``: the checks' rules with fakes, then real doctors on a real etcd:
three on loopback, and three in network namespaces with one node cut off its peers (the
wrong interface, or a firewall), which every doctor must name within seconds."""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

from elastic_ext.ops import cli
from elastic_ext.ops.doctor import checks
from elastic_ext.ops.doctor.checks import OK, SKIP, Address, check_run_id
from elastic_ext.ops.doctor.peers import Peer, Probe, judge, ring_targets
from elastic_ext.rendezvous.protocol.state import NodeInfo, Phase, RunState, Status
from elastic_ext.rendezvous.settings import parse_settings

IFACES = {"lo": "127.0.0.1", "eth0": "10.0.0.5", "ib0": "10.1.0.5", "docker0": "172.17.0.1"}


def no_dns() -> str:
    raise OSError("not resolvable")


# -- the address ---------------------------------------------------------------------------
def test_the_address_follows_the_agents_own_choice_in_order() -> None:
    pick = checks.pick_address
    assert pick({"ELASTIC_EXT_LOCAL_ADDR": "10.9.9.9", "ELASTIC_EXT_IFNAME": "ib0"}, None,
                IFACES, no_dns)[0] == Address("10.9.9.9", None, "ELASTIC_EXT_LOCAL_ADDR")
    assert pick({}, "10.0.0.5", IFACES, no_dns)[0] == Address("10.0.0.5", "eth0", "--local-addr")
    assert pick({"NCCL_SOCKET_IFNAME": "ib", "GLOO_SOCKET_IFNAME": "eth0"}, None, IFACES,
                no_dns)[0] == Address("10.1.0.5", "ib0", "NCCL_SOCKET_IFNAME=ib")
    excluded = pick({"GLOO_SOCKET_IFNAME": "^docker,eth"}, None, IFACES, no_dns)[0]
    assert excluded is not None and excluded.ifname == "ib0"
    assert pick({}, None, IFACES, lambda: "10.0.0.5")[0] == \
        Address("10.0.0.5", "eth0", "the hostname's address")


def test_an_interface_without_an_address_fails_naming_the_variable_and_the_choices() -> None:
    address, finding = checks.pick_address({"ELASTIC_EXT_IFNAME": "=eth1"}, None, IFACES, no_dns)
    assert address is None and finding is not None and finding.failed
    assert "ELASTIC_EXT_IFNAME==eth1" in finding.detail and "eth0 10.0.0.5" in finding.detail
    _, unresolved = checks.pick_address({}, None, IFACES, no_dns)
    assert unresolved is not None and "ELASTIC_EXT_IFNAME" in unresolved.detail


def test_this_machines_interfaces_are_read() -> None:
    assert checks.local_interfaces().get("lo") == "127.0.0.1"


# -- GPUs, snapshots, launch ---------------------------------------------------------------
def test_more_workers_than_gpus_fails_and_cpu_nodes_are_skipped() -> None:
    over = checks.check_gpus("8", (4, "nvidia-smi -L"))
    assert over.failed and "--nproc-per-node=4" in over.detail
    assert checks.check_gpus("4", (4, "x")).verdict == OK
    assert checks.check_gpus("2", (None, "no GPU tools")).verdict == SKIP
    assert checks.check_gpus("gpu", (2, "x")).verdict == OK
    assert checks.count_gpus({"CUDA_VISIBLE_DEVICES": "0,1,3"}) == (3, "CUDA_VISIBLE_DEVICES=0,1,3")
    assert checks.count_gpus({"CUDA_VISIBLE_DEVICES": ""})[0] == 0
    assert checks.check_gpus("1", checks.count_gpus({"CUDA_VISIBLE_DEVICES": "-1"})).failed


def test_the_snapshot_dir_must_be_writable_with_room(tmp_path: Path) -> None:
    assert checks.check_snapshot_dir(tmp_path / "new" / "dir").verdict == OK
    assert not list(tmp_path.iterdir())  # created nothing, left no probe file
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert checks.check_snapshot_dir(blocker / "snaps").failed
    full = checks.check_snapshot_dir(tmp_path, min_free=1 << 62)
    assert full.failed and "MiB free" in full.detail
    assert checks.check_snapshot_dir(Path("/proc/sys/doctor")).failed  # not writable


def test_ranks_and_master_set_by_hand_are_said_to_be_ignored() -> None:
    finding = checks.check_launch({"MASTER_ADDR": "n1", "RANK": "3"}, ["--node-rank"])
    assert finding.verdict == OK
    assert "$RANK, $MASTER_ADDR, --node-rank" in finding.detail


# -- the rendezvous id ---------------------------------------------------------------------
class FakeBackend:
    """The two reads ``check_run_id`` makes; each read of the beats moves the live ones."""

    def __init__(self, state: RunState | None, beats: dict[str, bytes | None],
                 live: Iterable[str] = (), expire: bool = False) -> None:
        self.state, self.beats, self.live = state, beats, set(live)
        self.heartbeats_expire = expire
        self.reads = 0

    def get_state(self) -> tuple[bytes, int] | None:
        return None if self.state is None else (self.state.to_bytes(), 1)

    def read_beats(self, nodes: Iterable[str]) -> dict[str, bytes | None]:
        self.reads += 1
        return {n: (f"{self.reads}:1.0".encode() if n in self.live else self.beats.get(n))
                for n in nodes}


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def run_state(status: Status = Status.ACTIVE) -> RunState:
    members = {n: NodeInfo("10.0.0.1", 1) for n in ("a", "b")}
    return RunState(generation="g1", round=3, phase=Phase.CLOSED, members=members,
                    order=("a", "b"), status=status)


SETTINGS = parse_settings(endpoint="127.0.0.1:2379", run_id="job1", min_nodes=1, max_nodes=2,
                          conf={})


def judge_run(backend: FakeBackend) -> Any:
    clock = FakeClock()
    return check_run_id(backend, SETTINGS, clock=clock, pause=clock.sleep)  # type: ignore[arg-type]


def test_a_run_with_moving_heartbeats_is_a_live_job() -> None:
    finding = judge_run(FakeBackend(run_state(), {"a": b"5:1.0", "b": b"7:1.0"}, live={"b"}))
    assert finding.failed and "in use by a live job" in finding.detail and "(b)" in finding.detail


def test_a_run_whose_agents_are_gone_or_left_is_free() -> None:
    stale = FakeBackend(run_state(), {"a": b"5:1.0", "b": b"left"})
    assert judge_run(stale).verdict == OK
    assert stale.reads > 2  # it watched the heartbeat for heartbeat_timeout before judging
    assert judge_run(FakeBackend(None, {})).verdict == OK
    assert judge_run(FakeBackend(run_state(Status.FINISHED), {})).verdict == OK


def test_leased_heartbeats_count_as_live_only_when_they_outlive_a_lease() -> None:
    held = FakeBackend(run_state(), {"a": b"5:1.0"}, expire=True)
    assert judge_run(held).failed
    expiring = FakeBackend(run_state(), {"a": b"5:1.0"}, expire=True)
    original = expiring.read_beats
    expiring.read_beats = lambda nodes: {n: None for n in original(nodes)}  # type: ignore[method-assign]
    assert judge_run(expiring).verdict == OK


def test_a_run_closed_by_an_operator_fails_with_the_fix() -> None:
    finding = judge_run(FakeBackend(run_state(Status.CLOSED), {}))
    assert finding.failed and "another --rdzv-id" in finding.detail


# -- the peers' verdict --------------------------------------------------------------------
def peers(n: int) -> dict[str, Peer]:
    return {f"k{i}": Peer(f"k{i}", f"node{i}", f"10.0.0.{i}", "eth0", 5000, "ELASTIC_EXT_IFNAME")
            for i in range(n)}


def test_a_node_most_others_cannot_reach_is_named_with_address_and_interface() -> None:
    bad = "k2"
    results = {p: {t: Probe(ok=bad not in (p, t), error="" if bad not in (p, t) else
                            "timed out after 2.0s", offset=0.01 if bad not in (p, t) else None)
                   for t in ring_targets(list(peers(4)), p)} for p in peers(4)}
    findings = judge(peers(4), results, clock_limit=3.0)
    failed = [f for f in findings if f.failed]
    assert len(failed) == 1, findings
    assert "node2 (10.0.0.2 on eth0, ELASTIC_EXT_IFNAME)" in failed[0].detail
    assert "3 of 3 peers" in failed[0].detail


def test_everyone_reached_and_one_clock_apart() -> None:
    def offset(p: str, t: str) -> float:
        return (10.0 if t == "k0" else 0.0) - (10.0 if p == "k0" else 0.0)
    results = {p: {t: Probe(True, offset=offset(p, t), rtt=0.001)
                   for t in ring_targets(list(peers(3)), p)} for p in peers(3)}
    findings = judge(peers(3), results, clock_limit=3.0)
    assert [f.verdict for f in findings if f.check == "network"] == [OK]
    clocks = [f for f in findings if f.failed]
    assert len(clocks) == 1 and clocks[0].check == "clock" and "node0" in clocks[0].detail


def test_the_ring_probes_a_few_neighbours_each() -> None:
    keys = [f"k{i:02d}" for i in range(10)]
    assert ring_targets(keys, "k08", ring=3) == ["k09", "k00", "k01"]
    assert ring_targets(["a"], "a") == []


# -- the command line ----------------------------------------------------------------------
def test_the_jobs_own_torchrun_line_is_taken(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["doctor", "--nnodes=2:3", "--nproc-per-node=1", "--max-restarts", "3",
                     "--rdzv-backend=c10d", "--rdzv-id=job1", "-m", "trainer", "--steps", "5",
                     "--snapshot-dir", str(tmp_path / "snaps")])
    out = capsys.readouterr().out
    assert code == 1
    assert f"ok    snapshot dir: {tmp_path / 'snaps'}" in out
    assert "FAIL  rendezvous: --rdzv-backend=c10d" in out
    assert re.fullmatch(r"doctor: 1 check\(s\) failed: rendezvous \(\d+\.\ds\)",
                        out.splitlines()[-1])


def test_other_commands_still_refuse_unknown_arguments() -> None:
    with pytest.raises(SystemExit):
        cli.main(["report", "metrics.jsonl", "--no-such-flag"])


def test_a_bad_rdzv_conf_fails_with_its_fix(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["doctor", "--rdzv-backend=etcd-ext", "--rdzv-endpoint=h:2379",
                     "--rdzv-conf=password=x"]) == 1
    assert "password_env" in capsys.readouterr().out


# -- real doctors ----------------------------------------------------------------------------
def doctor_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ELASTIC_EXT_", "NCCL_", "GLOO_", "PET_"))}
    return {**env, **extra}


def doctor_cmd(endpoint: str, run_id: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "elastic_ext.ops.cli", "doctor", "--nnodes=2:3",
            "--nproc-per-node=1", "--rdzv-backend=etcd-ext", f"--rdzv-endpoint={endpoint}",
            f"--rdzv-id={run_id}", "--wait=20", *extra, "-m", "trainer", "--steps", "5"]


@pytest.mark.timeout(90)
def test_three_doctors_on_loopback_meet_and_pass(etcd: Any, processes: Any) -> None:
    started = time.monotonic()
    procs = [processes.spawn(f"doctor{i}", doctor_cmd(etcd.endpoints, "job1"),
                             env=doctor_env(ELASTIC_EXT_LOCAL_ADDR=f"127.0.0.{i + 1}"))
             for i in range(3)]
    codes = [p.wait(60) for p in procs]
    took = time.monotonic() - started
    outputs = [p.output() for p in procs]
    assert codes == [0, 0, 0], outputs
    for out in outputs:
        assert "ok    peers: 3 nodes ran the doctor" in out
        assert "ok    network: 3 nodes, 6 probes" in out
    own = [float(re.findall(r"\((\d+\.\d)s\)$", out.strip())[-1]) for out in outputs]
    print(f"3 doctors on loopback: {took:.1f}s, doctors' own {own}")
    from elastic_ext.rendezvous.stores.etcd.client import EtcdClient

    client = EtcdClient(parse_settings(endpoint=etcd.endpoints, run_id="job1", min_nodes=1,
                                       max_nodes=1, conf={}))
    assert client.get_prefix("/elastic-ext/") == []  # every doctor revoked its lease


@pytest.mark.netns
@pytest.mark.timeout(150)
def test_a_node_cut_off_its_peers_is_named_by_every_doctor(processes: Any, tmp_path: Path) -> None:
    from elastic_ext.chaos import netns
    from elastic_ext.local.etcd import start_cluster

    reason = netns.unavailable()
    if reason:
        pytest.skip(reason)
    lab = netns.NetnsLab.allocate()
    try:
        store = lab.store_host
        cluster = start_cluster(processes, tmp_path, host=store.address, prefix=store.prefix,
                                call=lab.call_in_store)
        hosts = [lab.node_host(i) for i in range(3)]
        lab.cut_peers(2)
        started = time.monotonic()
        cmd = doctor_cmd(cluster.endpoints, "job2", "--probe-timeout=2")
        procs = [processes.spawn(f"doctor{i}", [*h.prefix, *cmd],
                                 env=doctor_env(ELASTIC_EXT_IFNAME="eth0"))
                 for i, h in enumerate(hosts)]
        codes = [p.wait(60) for p in procs]
        took = time.monotonic() - started
        outputs = [p.output() for p in procs]
        assert codes == [1, 1, 1], outputs
        bad = re.escape(f"({hosts[2].address} on eth0, ELASTIC_EXT_IFNAME=eth0) is not reachable")
        for out in outputs:
            named = [line for line in out.splitlines() if line.startswith("FAIL  network:")]
            assert len(named) == 1 and re.search(bad, named[0]), out
        own = [float(re.findall(r"\((\d+\.\d)s\)$", out.strip())[-1]) for out in outputs]
        # the issue's bound, on the doctors' own clock (a loaded machine's interpreter start
        # and torch import, a second or more each, are not the doctor's)
        assert max(own) <= 10, f"the doctors took {own} s"
        assert took < 30, f"the doctors' processes took {took:.1f}s"
        print(f"3 doctors in namespaces, one cut off: {took:.1f}s, doctors' own {own}")
    finally:
        processes.cleanup()
        lab.down()
