"""The partition lab on its own: namespaces, the blackhole route, cutting a link, and no trace
after.

Needs root; skipped with the reason where namespaces cannot be created. Only
addresses inside namespaces this test creates are ever used, and the root
namespace gets the blackhole route for their range before anything else.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from elastic_ext.chaos import netns
from elastic_ext.local.processes import ProcessSet, wait_until

pytestmark = [pytest.mark.netns, pytest.mark.timeout(120)]

REASON = netns.unavailable()


def _routes() -> str:
    return subprocess.run(["ip", "route", "show", "table", "all"], capture_output=True, text=True,
                          check=True).stdout


def _namespaces() -> set[str]:
    return {p.name for p in Path("/run/netns").iterdir()} if Path("/run/netns").exists() else set()


@pytest.mark.skipif(REASON is not None, reason=f"no network namespaces here: {REASON}")
def test_a_lab_cuts_one_node_off_and_leaves_nothing_behind(tmp_path: Path) -> None:
    lab = netns.NetnsLab.allocate()
    plan = lab.plan
    processes = ProcessSet(tmp_path / "logs")
    try:
        assert f"blackhole {plan.subnet}" in _routes()
        # from the root namespace the range goes nowhere, not out of the default route
        failed = subprocess.run(["ip", "route", "get", plan.node_address(1)], capture_output=True,
                                text=True, check=False)
        assert failed.returncode != 0
        server_host = lab.node_host(1)
        lab.node_host(0)
        assert server_host.prefix == ("ip", "netns", "exec", plan.node_ns(1))
        script = ("import socket; s = socket.socket(); "
                  f"s.bind(({server_host.address!r}, 5000)); s.listen()\n"
                  "while True:\n c, _ = s.accept(); c.sendall(b'ok'); c.close()")
        server = processes.spawn("server", [*server_host.prefix, sys.executable, "-c", script])

        def probe() -> bytes:
            with socket.create_connection((server_host.address, 5000), timeout=1) as conn:
                return conn.recv(2)

        def reachable_from(ns: str) -> bool:
            try:
                return netns.call_in(ns, probe) == b"ok"
            except OSError:
                return False

        wait_until(lambda: reachable_from(plan.node_ns(0)), 30, 0.1, "the server in node 1")
        # ip netns exec replaced itself with the server, which answers: the one tagged pid is
        # the server's. (Asked before it answers, the tag may be ip's, or missing while the
        # exec is under way: CI once saw it vanish right after it showed.)
        assert server.pids() == [server.pid]
        assert reachable_from(plan.switch)
        assert lab.listening() == {plan.node_ns(1): {5000}}
        # call_in left this thread alone
        assert threading.current_thread() is threading.main_thread()
        lab.cut(1)
        assert not reachable_from(plan.node_ns(0))
        lab.heal(1)
        wait_until(lambda: reachable_from(plan.node_ns(0)), 30, 0.1, "node 1 after the heal")
        assert lab.pids() == [server.pid]
    finally:
        lab.down()
        processes.cleanup()
    assert not {ns for ns in _namespaces() if ns.startswith(plan.name + "-")}
    assert plan.subnet not in _routes()
    assert not (netns.STATE_DIR / f"{plan.name}.owner").exists()
