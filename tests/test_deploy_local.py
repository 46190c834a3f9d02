"""deploy/local/etcd-cluster.sh: a 1- or 3-member etcd on loopback that starts, serves
etcd-ext and stops cleanly (no process, no directory left)."""

from __future__ import annotations

import base64
import os
import random
import signal
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from elastic_ext.local.processes import signal_pids, wait_until

SCRIPT = Path(__file__).resolve().parent.parent / "deploy" / "local" / "etcd-cluster.sh"

pytestmark = pytest.mark.etcd


def free_port_range(count: int) -> int:
    """The first of ``count`` consecutive loopback ports that are free now."""
    for _ in range(200):
        base = random.randrange(20000, 60000 - count)
        socks = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port range")


class Cluster:
    def __init__(self, state_dir: Path, port: int) -> None:
        self.dir = state_dir
        self.port = port
        self.env = dict(os.environ, ELASTIC_EXT_ETCD_DIR=str(state_dir),
                        ELASTIC_EXT_ETCD_PORT=str(port))

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(["bash", str(SCRIPT), *args], check=False, env=self.env,
                                capture_output=True, text=True, timeout=60,
                                stdin=subprocess.DEVNULL)
        if check and result.returncode != 0:
            raise AssertionError(f"etcd-cluster.sh {' '.join(args)} exited {result.returncode}:\n"
                                 f"{result.stdout}{result.stderr}")
        return result

    def pids(self) -> list[int]:
        return ([int(p.read_text()) for p in sorted(self.dir.glob("m*.pid"))] if self.dir.exists()
                else [])


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    if not Path(os.environ.get("ETCD", "/usr/bin/etcd")).exists() and not any(
            Path(d, "etcd").exists() for d in os.environ.get("PATH", "").split(":")):
        pytest.fail("etcd server binary not found: apt-get install -y etcd-server")
    c = Cluster(tmp_path / "etcd", free_port_range(6))
    seen: set[int] = set()
    try:
        yield c
    finally:
        seen.update(c.pids())
        c.run("stop", check=False)
        signal_pids(seen, signal.SIGKILL)  # only if stop failed to end them


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def put_get(endpoint: str, key: str, value: str) -> str:
    def b64(s: str) -> str:
        return base64.b64encode(s.encode()).decode()
    requests.post(f"http://{endpoint}/v3/kv/put", json={"key": b64(key), "value": b64(value)},
                  timeout=5).raise_for_status()
    kvs = requests.post(f"http://{endpoint}/v3/kv/range", json={"key": b64(key)},
                        timeout=5).json()["kvs"]
    return base64.b64decode(kvs[0]["value"]).decode()


@pytest.mark.timeout(120)
def test_one_member_starts_serves_and_stops_cleanly(cluster: Cluster) -> None:
    out = cluster.run("start").stdout
    endpoint = f"127.0.0.1:{cluster.port}"
    assert f"--rdzv-endpoint={endpoint}" in out
    assert cluster.run("endpoints").stdout.strip() == endpoint
    assert put_get(endpoint, "/elastic-ext-dev/k", "v") == "v"
    assert "healthy" in cluster.run("status").stdout
    # a second start refuses instead of clobbering the running member
    again = cluster.run("start", check=False)
    assert again.returncode != 0 and "already running" in again.stderr
    pids = cluster.pids()
    assert len(pids) == 1 and alive(pids[0])

    assert "stopped 1 member" in cluster.run("stop").stdout
    assert not any(alive(p) for p in pids)
    assert not cluster.dir.exists()
    assert cluster.run("status", check=False).returncode != 0
    with pytest.raises(requests.ConnectionError):
        requests.get(f"http://{endpoint}/health", timeout=2)


@pytest.mark.timeout(120)
def test_three_members_keep_serving_without_one_and_stop_cleanly(cluster: Cluster) -> None:
    out = cluster.run("start", "3").stdout
    endpoints = [f"127.0.0.1:{cluster.port + 2 * i}" for i in range(3)]
    assert f"--rdzv-endpoint={','.join(endpoints)}" in out
    members = requests.post(f"http://{endpoints[0]}/v3/cluster/member/list", json={},
                            timeout=5).json()["members"]
    assert sorted(m["name"] for m in members) == ["m0", "m1", "m2"]
    assert put_get(endpoints[0], "/elastic-ext-dev/k", "3") == "3"

    pids = cluster.pids()
    os.kill(pids[1], signal.SIGKILL)  # one member dies: the other two are a quorum
    wait_until(lambda: not alive(pids[1]), 10, 0.05, "member m1 to die")
    assert wait_until(lambda: _put_get_or_none(endpoints[2], "/elastic-ext-dev/k", "2 of 3"),
                      30, 0.2, "a write through m2 with m1 dead") == "2 of 3"
    status = cluster.run("status").stdout
    assert "m1 127.0.0.1" in status and "down" in status

    assert "stopped 2 member" in cluster.run("stop").stdout
    assert not any(alive(p) for p in pids)
    assert not cluster.dir.exists()


def _put_get_or_none(endpoint: str, key: str, value: str) -> str | None:
    try:
        return put_get(endpoint, key, value)
    except (requests.RequestException, KeyError, ValueError):
        return None


SHIPPED_SCRIPTS = [*sorted((SCRIPT.parent.parent / "slurm").glob("*.s*")), SCRIPT]


@pytest.mark.parametrize("script", SHIPPED_SCRIPTS, ids=lambda p: p.name)
def test_the_shipped_scripts_are_executable_bash(script: Path) -> None:
    """sbatch and srun run them by path: they must keep their x bit and parse."""
    assert os.access(script, os.X_OK), f"{script} lost its executable bit"
    assert script.read_text().startswith("#!/"), f"{script} has no #! line"
    checked = subprocess.run(["bash", "-n", str(script)], check=False, capture_output=True,
                             text=True, timeout=30)
    assert checked.returncode == 0, checked.stderr
